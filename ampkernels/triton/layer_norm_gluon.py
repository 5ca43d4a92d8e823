"""LayerNorm / RMSNorm in Gluon: the backward for rows of 8200-16384 elements and the forward of
16-bit x with fp32 params for rows of 4104-16384, where the Triton kernels of layer_norm.py fall
short (H200 norm benchmark; docs/performance.md names its rows):
- backward: the RELOAD kernel cannot hold a LayerNorm row of 16384 elements and the
  dweight/dbias sums in registers, so it reads x and dy twice through Triton's pipeliner: 2.56-2.65
  TB/s, against 3.24-3.27 for the CUDA backend's pipelined kernel (target 85% of 3.2);
- forward with fp32 params: the Triton kernels read the params again from L2 for every row (8
  bytes an element against x's 4 of HBM): LayerNorm at 4.0x / 3.4-3.5x nn.LayerNorm under
  autocast at N = 8192 / 16384 (target 85% of 5x).
Gluon lets both do what the CUDA kernels do: a persistent program reads the params once into
shared memory (fp32) and walks its rows through a 2-stage cp.async ring (the next row's copies
in flight while this row is reduced), each pass reading the row from shared memory.
layer_norm.py runs them where they measured faster than its own kernels (GLUON_MIN_N).

Backward: a program per SM (16 warps) owns a contiguous chunk of rows; a thread owns the same 32
columns of every row, 4 chunks of 8 contiguous elements (16 bytes of a 16-bit row), walked one
at a time with dweight/dbias sums of their own, the only values kept in registers for the walk.
Per row: pass 1 adds dy * w * xhat and dy * w (one two-value reduction over the block) and the
dweight/dbias sums; pass 2 reads x, dy and w again and writes dx. The partial rows are summed by
layer_norm.py's _col_sum_kernel in a fixed order: bitwise repeatable, as the other backwards.
Registers (ptxas for sm_90, bf16): the whole row at once spilled 108 bytes a thread with Triton
3.6, chunk by chunk 0-4. Triton 3.8 merged pass 2's shared-memory loads into pass 1's, keeping
the row in registers across the row sums (92 bytes); a barrier between the passes stops that (0
bytes), but with Triton 3.6 it spilled 20, so only a Gluon with gl.barrier (3.8) gets it.
Forward: three passes over the row in shared memory (the mean, the centred sum of squares, as
the Triton kernels compute them, then the output); 35-64 registers, no spill.

Contract: layer_norm.norm_bwd's / norm_fwd's, for 16-bit x (and dy) whose rows start 16-byte
aligned (N a multiple of 8), without residuals. Gluon has no interpreter: scripts/
triton_compile_check.py compiles the kernels for sm_90 on the CPU and tests/test_layer_norm.py
tests them on the GPU.
"""
try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
except ImportError:  # a Triton without Gluon: the Triton kernels only
    gluon = None

BLOCK_N = 16384   # columns a program's layout covers: rows of up to this many elements
BWD_MIN_N = 8200  # the backward: shorter rows fit in registers (layer_norm.py's register kernel)
FWD_MIN_N = 4104  # the forward with fp32 params: up to 4096 the Triton kernel reached the target
NUM_WARPS = 16    # 32 columns a thread at 16384: the dweight/dbias sums take 64 of its 128 registers
STAGES = 2        # rows in the ring: the one being reduced and the next (in flight)


def available():
    return gluon is not None


def bwd_smem_bytes(x_size, dy_size):
    """Shared memory the backward allocates: the ring of x and dy rows and the fp32 weight (the
    reduction's scratch is a few hundred bytes more)."""
    return STAGES * BLOCK_N * (x_size + dy_size) + BLOCK_N * 4


def fwd_block(n):
    """Columns the forward's layout covers for rows of n elements."""
    return 8192 if n <= 8192 else BLOCK_N


def fwd_smem_bytes(block, x_size, params):
    """Shared memory the forward allocates: the ring of x rows and `params` fp32 param rows."""
    return STAGES * block * x_size + params * block * 4


def fwd_eligible(x, residual):
    """The forward calls this file takes: 16-bit x, rows of FWD_MIN_N..BLOCK_N elements starting
    16-byte aligned, no residual (layer_norm.py's kernels take those)."""
    n = x.shape[1]
    return (FWD_MIN_N <= n <= BLOCK_N and n % 8 == 0 and x.element_size() == 2 and x.data_ptr() % 16 == 0
            and residual is None)


def bwd_eligible(x, dy, dresidual_out, dres):
    """The backward calls this file takes: 16-bit x and dy, rows of BWD_MIN_N..BLOCK_N elements starting
    16-byte aligned, no residual gradients (layer_norm.py's kernels take those)."""
    n = x.shape[1]
    return (BWD_MIN_N <= n <= BLOCK_N and n % 8 == 0 and x.element_size() == 2 and dy.element_size() == 2
            and x.data_ptr() % 16 == 0 and dy.data_ptr() % 16 == 0 and dresidual_out is None and not dres.numel())


if gluon is not None:
    _BLOCK_N = gl.constexpr(BLOCK_N)
    _CHUNKS = gl.constexpr(4)  # 16-byte chunks of a thread per row: BLOCK_N / (8 * 32 * NUM_WARPS)
    _BARRIER_BEFORE_DX = gl.constexpr(hasattr(gl, "barrier"))  # see the module docstring

    @gluon.jit
    def _add_pair(a0, a1, b0, b1):
        return a0 + b0, a1 + b1

    @gluon.jit
    def _copy_row(SRC, buf, slot, row, N: gl.constexpr, row_cols, MASKED: gl.constexpr):
        """cp.async of row `row` of SRC into ring slot `slot` of buf (the caller commits). Whole
        rows, not chunks: the compiler puts a barrier between any two copies into one buffer."""
        if MASKED:  # masked-off 16-byte chunks are filled with zeros
            async_copy.async_copy_global_to_shared(buf.index(slot), SRC + row * N + row_cols, mask=row_cols < N)
        else:
            async_copy.async_copy_global_to_shared(buf.index(slot), SRC + row * N + row_cols)

    @gluon.jit
    def _issue_row(X, DY, x_buf, dy_buf, slot, row, N: gl.constexpr, row_cols, MASKED: gl.constexpr):
        """The backward's copies of a row: x and dy, one commit group."""
        _copy_row(X, x_buf, slot, row, N, row_cols, MASKED)
        _copy_row(DY, dy_buf, slot, row, N, row_cols, MASKED)
        async_copy.commit_group()

    @gluon.jit
    def _chunk(x_buf, dy_buf, w_buf, slot, k: gl.constexpr, mean, rstd, IS_RMS: gl.constexpr, HAS_W: gl.constexpr,
               layout: gl.constexpr):
        """Chunk k of the row in ring slot `slot`: (dy, xhat, g = dy * weight), fp32."""
        CH: gl.constexpr = layout.size_per_thread[0] * 32 * layout.warps_per_cta[0]
        x = x_buf.index(slot).slice(k * CH, CH).load(layout).to(gl.float32)
        dy = dy_buf.index(slot).slice(k * CH, CH).load(layout).to(gl.float32)
        if IS_RMS:
            xhat = x * rstd
        else:
            xhat = (x - mean) * rstd
        g = dy
        if HAS_W:
            g = dy * w_buf.slice(k * CH, CH).load(layout)
        return dy, xhat, g

    @gluon.jit
    def _sums(x_buf, dy_buf, w_buf, slot, k: gl.constexpr, mean, rstd, t1, t2, dw, db, IS_RMS: gl.constexpr,
              HAS_W: gl.constexpr, WANT_DW: gl.constexpr, WANT_DB: gl.constexpr, layout: gl.constexpr):
        """Pass 1 over chunk k: the row sums' per-thread terms t1 (g * xhat), t2 (g), and the
        chunk's dweight/dbias sums."""
        dy, xhat, g = _chunk(x_buf, dy_buf, w_buf, slot, k, mean, rstd, IS_RMS, HAS_W, layout)
        t1 += g * xhat
        t2 += g
        if WANT_DW:
            dw += dy * xhat
        if WANT_DB:
            db += dy
        return t1, t2, dw, db

    @gluon.jit
    def _dx(x_buf, dy_buf, w_buf, slot, k: gl.constexpr, mean, rstd, c1, c2, DX_ROW, cols, N: gl.constexpr,
            IS_RMS: gl.constexpr, HAS_W: gl.constexpr, MASKED: gl.constexpr, layout: gl.constexpr):
        """Pass 2 over chunk k: dx = (g - xhat * c1 - c2) * rstd, stored."""
        CH: gl.constexpr = layout.size_per_thread[0] * 32 * layout.warps_per_cta[0]
        _, xhat, g = _chunk(x_buf, dy_buf, w_buf, slot, k, mean, rstd, IS_RMS, HAS_W, layout)
        dx = ((g - xhat * c1 - c2) * rstd).to(DX_ROW.dtype.element_ty)
        if MASKED:
            gl.store(DX_ROW + k * CH + cols, dx, mask=cols + k * CH < N)
        else:
            gl.store(DX_ROW + k * CH + cols, dx)

    @gluon.jit
    def _store_partial(P, chunks, cols, N: gl.constexpr):
        """A program's partial row from its 4 chunk sums (a tuple)."""
        CH: gl.constexpr = cols.shape[0]
        for k in gl.static_range(_CHUNKS):
            gl.store(P + k * CH + cols, chunks[k], mask=cols + k * CH < N)

    @gluon.jit
    def norm_bwd_smem_kernel(DY, X, W, MEAN, RSTD, DX, DW_P, DB_P, M, rows_per_prog, N: gl.constexpr,
                             IS_RMS: gl.constexpr, HAS_W: gl.constexpr, WANT_DW: gl.constexpr, WANT_DB: gl.constexpr,
                             STAGES: gl.constexpr):
        # N is a constant: with it a multiple of 8, every row's start is provably 16-byte aligned,
        # which cp.async's 16-byte copies need
        NW: gl.constexpr = gl.num_warps()
        CH: gl.constexpr = _BLOCK_N // _CHUNKS
        layout: gl.constexpr = gl.BlockedLayout([CH // (32 * NW)], [32], [NW], [0])
        flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
        MASKED: gl.constexpr = N != _BLOCK_N
        pid = gl.program_id(0)
        cols = gl.arange(0, CH, layout=layout)
        row_cols = gl.arange(0, _BLOCK_N, layout=layout)  # chunk k of thread t: columns k * CH + 8t ..
        row_start = pid.to(gl.int64) * rows_per_prog  # int64 rows: row * N may pass 2^31
        row_end = gl.minimum(row_start + rows_per_prog, M)
        last = row_end - 1  # rows past it are clamped to it: the ring's tail copies need no predicate
        x_buf = gl.allocate_shared_memory(X.dtype.element_ty, [STAGES, _BLOCK_N], flat)
        dy_buf = gl.allocate_shared_memory(DY.dtype.element_ty, [STAGES, _BLOCK_N], flat)
        for s in gl.static_range(STAGES - 1):
            _issue_row(X, DY, x_buf, dy_buf, s, gl.minimum(row_start + s, last), N, row_cols, MASKED)
        w_buf = x_buf.index(0)  # unused without HAS_W
        if HAS_W:
            w_buf = gl.allocate_shared_memory(gl.float32, [_BLOCK_N], flat,
                                              gl.load(W + row_cols, mask=row_cols < N, other=0.0).to(gl.float32))
        zero = gl.zeros([CH], gl.float32, layout)
        dw0, dw1, dw2, dw3 = zero, zero, zero, zero
        db0, db1, db2, db3 = zero, zero, zero, zero
        # a row's mean/rstd are loaded one row ahead: their latency hides behind a row's work
        rstd_next = gl.load(RSTD + row_start)
        mean_next = rstd_next
        if not IS_RMS:
            mean_next = gl.load(MEAN + row_start)
        for i in range((row_end - row_start).to(gl.int32)):
            row = row_start + i
            rstd = rstd_next
            mean = mean_next
            nxt = gl.minimum(row + 1, last)
            rstd_next = gl.load(RSTD + nxt)
            if not IS_RMS:
                mean_next = gl.load(MEAN + nxt)
            # refill the slot the previous row used (the compiler puts a barrier before it), then
            # wait for this row's copies: at most STAGES - 1 groups, the newer rows', in flight
            _issue_row(X, DY, x_buf, dy_buf, (i + STAGES - 1) % STAGES, gl.minimum(row + STAGES - 1, last), N,
                       row_cols, MASKED)
            async_copy.wait_group(STAGES - 1)
            slot = i % STAGES
            t1, t2 = zero, zero
            t1, t2, dw0, db0 = _sums(x_buf, dy_buf, w_buf, slot, 0, mean, rstd, t1, t2, dw0, db0, IS_RMS, HAS_W,
                                     WANT_DW, WANT_DB, layout)
            t1, t2, dw1, db1 = _sums(x_buf, dy_buf, w_buf, slot, 1, mean, rstd, t1, t2, dw1, db1, IS_RMS, HAS_W,
                                     WANT_DW, WANT_DB, layout)
            t1, t2, dw2, db2 = _sums(x_buf, dy_buf, w_buf, slot, 2, mean, rstd, t1, t2, dw2, db2, IS_RMS, HAS_W,
                                     WANT_DW, WANT_DB, layout)
            t1, t2, dw3, db3 = _sums(x_buf, dy_buf, w_buf, slot, 3, mean, rstd, t1, t2, dw3, db3, IS_RMS, HAS_W,
                                     WANT_DW, WANT_DB, layout)
            if IS_RMS:
                c1 = gl.sum(t1, axis=0) / N
                c2 = 0.0
            else:  # both row sums in one reduction: one exchange through shared memory, not two
                s1, s2 = gl.reduce((t1, t2), 0, _add_pair)
                c1 = s1 / N
                c2 = s2 / N
            if _BARRIER_BEFORE_DX:
                gl.barrier()
            for k in gl.static_range(_CHUNKS):
                _dx(x_buf, dy_buf, w_buf, slot, k, mean, rstd, c1, c2, DX + row * N, cols, N, IS_RMS, HAS_W, MASKED,
                    layout)
        async_copy.wait_group(0)  # the tail's copies land before the program exits
        if WANT_DW:
            _store_partial(DW_P + pid * N, (dw0, dw1, dw2, dw3), cols, N)
        if WANT_DB:
            _store_partial(DB_P + pid * N, (db0, db1, db2, db3), cols, N)

    @gluon.jit
    def _param_smem(P, row_cols, N: gl.constexpr, BLOCK: gl.constexpr, flat: gl.constexpr):
        """A weight or bias row as fp32 in shared memory, read from global memory once."""
        return gl.allocate_shared_memory(gl.float32, [BLOCK], flat,
                                         gl.load(P + row_cols, mask=row_cols < N, other=0.0).to(gl.float32))

    @gluon.jit
    def norm_fwd_smem_kernel(X, W, B, Y, MEAN, RSTD, M, rows_per_prog, eps, N: gl.constexpr, BLOCK: gl.constexpr,
                             IS_RMS: gl.constexpr, HAS_W: gl.constexpr, HAS_B: gl.constexpr,
                             STORE_STATS: gl.constexpr, STAGES: gl.constexpr):
        # (see the module docstring) BLOCK: 8192 or 16384 columns, 2 or 4 chunks of a thread
        NW: gl.constexpr = gl.num_warps()
        CH: gl.constexpr = 8 * 32 * NW  # 8 contiguous elements (16 bytes) a thread per chunk
        layout: gl.constexpr = gl.BlockedLayout([8], [32], [NW], [0])
        flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
        MASKED: gl.constexpr = N != BLOCK
        pid = gl.program_id(0)
        cols = gl.arange(0, CH, layout=layout)
        row_cols = gl.arange(0, BLOCK, layout=layout)  # chunk k of thread t: columns k * CH + 8t ..
        row_start = pid.to(gl.int64) * rows_per_prog
        row_end = gl.minimum(row_start + rows_per_prog, M)
        last = row_end - 1
        x_buf = gl.allocate_shared_memory(X.dtype.element_ty, [STAGES, BLOCK], flat)
        for s in gl.static_range(STAGES - 1):
            _copy_row(X, x_buf, s, gl.minimum(row_start + s, last), N, row_cols, MASKED)
            async_copy.commit_group()
        w_buf = x_buf.index(0)  # unused without HAS_W / HAS_B
        b_buf = w_buf
        if HAS_W:
            w_buf = _param_smem(W, row_cols, N, BLOCK, flat)
        if HAS_B:
            b_buf = _param_smem(B, row_cols, N, BLOCK, flat)
        for i in range((row_end - row_start).to(gl.int32)):
            row = row_start + i
            _copy_row(X, x_buf, (i + STAGES - 1) % STAGES, gl.minimum(row + STAGES - 1, last), N, row_cols, MASKED)
            async_copy.commit_group()
            async_copy.wait_group(STAGES - 1)
            xs = x_buf.index(i % STAGES)
            mean = 0.0
            if not IS_RMS:
                acc = gl.zeros([CH], gl.float32, layout)
                for k in gl.static_range(BLOCK // CH):
                    acc += xs.slice(k * CH, CH).load(layout).to(gl.float32)
                mean = gl.sum(acc, axis=0) / N
            acc = gl.zeros([CH], gl.float32, layout)
            for k in gl.static_range(BLOCK // CH):
                xc = xs.slice(k * CH, CH).load(layout).to(gl.float32) - mean
                if MASKED and not IS_RMS:  # (RMSNorm's masked columns are zeros already)
                    xc = gl.where(cols + k * CH < N, xc, 0.0)
                acc += xc * xc
            rstd = 1.0 / gl.sqrt(gl.sum(acc, axis=0) / N + eps)
            if STORE_STATS:
                if not IS_RMS:
                    gl.store(MEAN + row, mean)
                gl.store(RSTD + row, rstd)
            for k in gl.static_range(BLOCK // CH):
                y = (xs.slice(k * CH, CH).load(layout).to(gl.float32) - mean) * rstd
                if HAS_W:
                    y *= w_buf.slice(k * CH, CH).load(layout)
                if HAS_B:
                    y += b_buf.slice(k * CH, CH).load(layout)
                if MASKED:
                    gl.store(Y + row * N + k * CH + cols, y.to(Y.dtype.element_ty), mask=cols + k * CH < N)
                else:
                    gl.store(Y + row * N + k * CH + cols, y.to(Y.dtype.element_ty))
        async_copy.wait_group(0)  # the tail's copies land before the program exits
