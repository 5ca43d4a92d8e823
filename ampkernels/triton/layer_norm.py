"""LayerNorm / RMSNorm in Triton, forward and backward, fp32 math (one kernel per pass, IS_RMS
switching off the mean and the bias).

Same contract as csrc/layer_norm.cu and the launchers take the same arguments as the
torch.ops.ampkernels.norm_{fwd,bwd}_cuda ops (ampkernels/ops/layer_norm.py calls either):
- x (rows, N) fp16/bf16/fp32, contiguous; weight/bias (N,) in x.dtype or fp32; optional
  residual (rows, N): the unrounded fp32 sum x + residual is normalised and stored as
  residual_out (fp32 if residual_in_fp32 else x.dtype); out in out_dtype (default x.dtype);
  mean (LayerNorm) and rstd saved in fp32.
- Forward: a program owns ROWS whole rows held in registers (BLOCK_N = next_power_of_2(N)
  up to _MAX_FWD_BLOCK); longer rows take the chunked kernel (one row per program, two passes
  over column chunks, the second reading the row from L2; N a compile-time constant), as do,
  with 16-bit params, RMSNorm's rows of 8192-16384 elements and LayerNorm's of 16384.
- Backward: a fixed grid of programs, each owning a contiguous chunk of rows, loops over it
  ROWS rows at a time, software-pipelined (tl.range num_stages: the next steps' x/dy loads are
  in flight as async copies into shared memory while this step is reduced); dx in dx_dtype;
  dweight = sum(dy * xhat) and dbias = sum(dy) are kept as (BLOCK_N,) fp32 registers and
  written as one partial row per program; _col_sum_kernel adds the partial rows in a fixed
  order. No atomics: bitwise repeatable for a given shape, dtypes and GPU. Rows up to 8192
  elements are held in registers; up to 16384 (RELOAD) only the two sums are, x/dy/weight
  being read again after the row sums; longer rows take the looped kernel (two passes over
  column chunks, the first pipelined). The per-N launch configs below are reasoned from a
  sweep of the unpipelined launch (bench_layer_norm --sweep times the alternatives);
  docs/performance.md has the numbers.
"""
import functools

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from . import cdiv, device_index, device_properties, on_device
from . import layer_norm_gluon as _gluon
from .launch import launch

_MAX_FWD_BLOCK = 16384  # elements of a row held in registers by the forward
_MAX_BWD_BLOCK = 8192   # ... by the backward with x, dy, weight and the dweight/dbias sums (16384 spills)
_MAX_BWD_RELOAD_BLOCK = 16384  # ... by the backward holding only the sums (RELOAD: x, dy, weight read twice)
_LOOP_BLOCK = 4096      # column chunk of the looped backward
_SMEM_MARGIN = 2048     # shared memory beyond the pipeline buffers (reduction scratch, mean/rstd)


# STORE_STATS=False (inference) compiles a variant without the mean/rstd stores (8 bytes a row:
# 1-2.5% at N <= 1024). Its output may differ from the training forward's in the last bit. A
# run-time flag instead (one kernel, the same bits) made this kernel 12-34% slower at long rows.
@triton.jit
def _norm_fwd_kernel(X, R, W, B, Y, RO, MEAN, RSTD, M, N, eps,
                     IS_RMS: tl.constexpr, HAS_R: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
                     BLOCK_N: tl.constexpr, ROWS: tl.constexpr, PARAMS_FIRST: tl.constexpr,
                     STORE_STATS: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_N)
    rmask = rows < M
    cmask = cols < N
    mask = rmask[:, None] & cmask[None, :]
    offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
    if PARAMS_FIRST:  # params loaded with x (their latency hidden behind x's; more registers live)
        if HAS_W:
            w = tl.load(W + cols, mask=cmask, other=0.0)
        if HAS_B:
            b = tl.load(B + cols, mask=cmask, other=0.0)
    x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_R:
        x += tl.load(R + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(RO + offs, x.to(RO.dtype.element_ty), mask=mask)
    if IS_RMS:
        xc = x
    else:
        mean = tl.sum(x, axis=1) / N
        if STORE_STATS:
            tl.store(MEAN + rows, mean, mask=rmask)
        xc = tl.where(mask, x - mean[:, None], 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=1) / N + eps)
    if STORE_STATS:
        tl.store(RSTD + rows, rstd, mask=rmask)
    y = xc * rstd[:, None]
    if HAS_W:
        if not PARAMS_FIRST:
            w = tl.load(W + cols, mask=cmask, other=0.0)
        y *= w.to(tl.float32)[None, :]
    if HAS_B:
        if not PARAMS_FIRST:
            b = tl.load(B + cols, mask=cmask, other=0.0)
        y += b.to(tl.float32)[None, :]
    tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _welford_combine(mean_a, m2_a, n_a, mean_b, m2_b, n_b):
    # Chan et al.'s merge of two (mean, sum of squared deviations, count) summaries
    n = n_a + n_b
    frac = tl.where(n == 0.0, 0.0, n_b / n)
    delta = mean_b - mean_a
    return mean_a + delta * frac, m2_a + m2_b + delta * delta * n_a * frac, n


@triton.jit
def _load_chunk(ptr, m, EVEN: tl.constexpr, POLICY: tl.constexpr):
    if EVEN:
        return tl.load(ptr, eviction_policy=POLICY).to(tl.float32)
    return tl.load(ptr, mask=m, other=0.0, eviction_policy=POLICY).to(tl.float32)


@triton.jit
def _store_chunk(ptr, value, m, EVEN: tl.constexpr):
    if EVEN:
        tl.store(ptr, value.to(ptr.dtype.element_ty))
    else:
        tl.store(ptr, value.to(ptr.dtype.element_ty), mask=m)


@triton.jit
def _chunk_stats(X, R, RO, base, cols, N, mean, m2, k, IS_RMS: tl.constexpr, HAS_R: tl.constexpr,
                 EVEN: tl.constexpr):
    """One chunk into each lane's running statistics; k: the chunk's 1-based index (a lane's
    k-th value). Masked lanes (past the row's end) keep their summary."""
    m = cols < N
    s = _load_chunk(X + base + cols, m, EVEN, "evict_last")
    if HAS_R:
        s += _load_chunk(R + base + cols, m, EVEN, "evict_last")
        _store_chunk(RO + base + cols, s, m, EVEN)
    if IS_RMS:
        m2 += s * s
    else:
        delta = s - mean
        new_mean = mean + delta * (1.0 / k)
        new_m2 = m2 + delta * (s - new_mean)
        if EVEN:
            mean, m2 = new_mean, new_m2
        else:
            mean, m2 = tl.where(m, new_mean, mean), tl.where(m, new_m2, m2)
    return mean, m2


@triton.jit
def _chunk_out(X, R, W, B, Y, base, cols, N, row_mean, rstd, HAS_R: tl.constexpr, HAS_W: tl.constexpr,
               HAS_B: tl.constexpr, EVEN: tl.constexpr):
    m = cols < N
    s = _load_chunk(X + base + cols, m, EVEN, "evict_first")
    if HAS_R:
        s += _load_chunk(R + base + cols, m, EVEN, "evict_first")
    y = (s - row_mean) * rstd
    if HAS_W:
        y *= _load_chunk(W + cols, m, EVEN, "evict_last")
    if HAS_B:
        y += _load_chunk(B + cols, m, EVEN, "evict_last")
    _store_chunk(Y + base + cols, y, m, EVEN)


# store_stats (0: inference) is a run-time argument: training and inference run one compiled
# kernel, the same bits; its branch sits between the two passes, where it measured no cost.
# N is a compile-time constant (one compile per row length, as torch.compile's own kernels for
# long rows): the loops have constant trip counts (unrolled by the compiler), the chunk
# offsets and 1 / k are constants: about 1.5x the bandwidth of the run-time-N kernel at N =
# 8192-16384 (docs/performance.md).
@triton.jit(do_not_specialize=["store_stats"])
def _norm_fwd_chunked_kernel(X, R, W, B, Y, RO, MEAN, RSTD, M, eps, store_stats, N: tl.constexpr,
                             IS_RMS: tl.constexpr, HAS_R: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
                             BLOCK_N: tl.constexpr, UNROLL: tl.constexpr, EVEN: tl.constexpr):
    # Rows too long for registers: one row per program in BLOCK_N-column chunks, two passes.
    # The first reads the row for its statistics (evict_last: kept in L2), the second reads it
    # again from L2 (evict_first) to normalise it. Each lane keeps its own running statistics
    # over the chunks, so the loop has no cross-thread reduction and, unrolled, keeps UNROLL
    # chunks' loads in flight: LayerNorm's are Welford's (mean, sum of squared deviations; no
    # E[x^2] - mean^2 cancellation for rows with large means), merged across lanes once at the
    # end; RMSNorm's a sum of squares. EVEN: N is a multiple of BLOCK_N (no masks).
    row = tl.program_id(0)
    base = row.to(tl.int64) * N
    cols0 = tl.arange(0, BLOCK_N)
    mean = tl.zeros((BLOCK_N,), tl.float32)
    m2 = tl.zeros((BLOCK_N,), tl.float32)
    for start in tl.range(0, N, BLOCK_N, loop_unroll_factor=UNROLL):
        mean, m2 = _chunk_stats(X, R, RO, base, start + cols0, N, mean, m2, start // BLOCK_N + 1, IS_RMS, HAS_R, EVEN)
    if IS_RMS:
        row_mean = 0.0
        row_m2 = tl.sum(m2, axis=0)
    else:
        count = (N // BLOCK_N + (cols0 < N % BLOCK_N)).to(tl.float32)  # values each lane summarised
        row_mean, row_m2, _ = tl.reduce((mean, m2, count), 0, _welford_combine)
    rstd = 1.0 / tl.sqrt(row_m2 / N + eps)
    if store_stats:
        if not IS_RMS:
            tl.store(MEAN + row, row_mean)
        tl.store(RSTD + row, rstd)
    for start in tl.range(0, N, BLOCK_N, loop_unroll_factor=UNROLL):
        _chunk_out(X, R, W, B, Y, base, start + cols0, N, row_mean, rstd, HAS_R, HAS_W, HAS_B, EVEN)


@triton.jit
def _bwd_tiles(X, DY, W, w, offs, cols, mask, cmask, mean, rstd, IS_RMS: tl.constexpr, HAS_W: tl.constexpr,
               W_IN_REGS: tl.constexpr, POLICY: tl.constexpr, MASKED: tl.constexpr):
    """One step's (dy, xhat, g = dy * weight) as fp32 (ROWS, BLOCK_N) tiles. W_IN_REGS: the
    weight is w (held by the caller), else it is read from W here. MASKED: mask/cmask apply."""
    if MASKED:
        x = tl.load(X + offs, mask=mask, other=0.0, eviction_policy=POLICY).to(tl.float32)
        dy = tl.load(DY + offs, mask=mask, other=0.0, eviction_policy=POLICY).to(tl.float32)
    else:
        x = tl.load(X + offs, eviction_policy=POLICY).to(tl.float32)
        dy = tl.load(DY + offs, eviction_policy=POLICY).to(tl.float32)
    if IS_RMS:
        xhat = x * rstd[:, None]
    elif MASKED:
        xhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
    else:
        xhat = (x - mean[:, None]) * rstd[:, None]
    g = dy
    if HAS_W:
        if not W_IN_REGS:
            if MASKED:
                w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)
            else:
                w = tl.load(W + cols).to(tl.float32)
        g = dy * w[None, :]
    return dy, xhat, g


@triton.jit
def _norm_bwd_kernel(DY, X, W, MEAN, RSTD, DRO, DX, DRES, DW_P, DB_P, M, N, rows_per_prog,
                     IS_RMS: tl.constexpr, HAS_W: tl.constexpr, HAS_DRO: tl.constexpr, HAS_DRES: tl.constexpr,
                     WANT_DW: tl.constexpr, WANT_DB: tl.constexpr, BLOCK_N: tl.constexpr, ROWS: tl.constexpr,
                     STAGES: tl.constexpr, RELOAD: tl.constexpr, MASKED: tl.constexpr):
    # A program owns rows [row_start, row_end) and walks them ROWS at a time, whole rows in
    # registers. STAGES > 1 software-pipelines the walk (tl.range num_stages): the compiler
    # issues the loads of the next STAGES - 1 steps (x, dy, mean, rstd, dresidual_out) as async
    # copies into shared memory while this step is reduced, so HBM latency is hidden without
    # more programs per SM. dweight/dbias sums: (BLOCK_N,) fp32 vectors for the whole walk, each
    # step's (ROWS, BLOCK_N) products summed over its rows at once.
    # RELOAD (rows too long for x, dy, weight and both sums in registers: N = 16384): the weight
    # is read per step, and after the two row sums x and dy are read a second time (from L2 or
    # the pipeline's shared memory, not HBM) instead of being held across the sums; only the
    # dweight/dbias sums stay in registers for the walk.
    # MASKED = ROWS > 1 or N < BLOCK_N; without it (one row a step, N a power of two) no load,
    # store or select carries a mask (fewer registers: N = 16384 spills less).
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    cmask = cols < N
    row_start = pid.to(tl.int64) * rows_per_prog  # int64 rows (the loop variable inherits it): row * N
    row_end = tl.minimum(row_start + rows_per_prog, M)  # below is an int64 offset, for tensors over 2^31 elements
    w = tl.zeros((BLOCK_N,), tl.float32)  # unused unless HAS_W and not RELOAD
    if HAS_W and not RELOAD:
        w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)
    dw_acc = tl.zeros((BLOCK_N,), tl.float32)
    db_acc = tl.zeros((BLOCK_N,), tl.float32)
    offs = tl.arange(0, ROWS)[:, None] * N + cols[None, :]  # within a step: int32 (ROWS * N < 2^31)
    for r0 in tl.range(row_start, row_end, ROWS, num_stages=STAGES):
        rows = r0 + tl.arange(0, ROWS)
        rmask = rows < row_end
        mask = rmask[:, None] & cmask[None, :]  # unused unless MASKED
        base = r0 * N  # a scalar int64 row offset; the tiles' offsets stay int32 (64-bit offset tensors cost registers)
        if MASKED:
            rstd = tl.load(RSTD + rows, mask=rmask, other=0.0)
        else:
            rstd = tl.load(RSTD + rows)
        mean = rstd  # unused for RMSNorm
        if not IS_RMS:
            if MASKED:
                mean = tl.load(MEAN + rows, mask=rmask, other=0.0)
            else:
                mean = tl.load(MEAN + rows)
        dy, xhat, g = _bwd_tiles(X + base, DY + base, W, w, offs, cols, mask, cmask, mean, rstd, IS_RMS, HAS_W,
                                 not RELOAD, "", MASKED)
        if WANT_DW:
            dw_acc += tl.sum(dy * xhat, axis=0)
        if WANT_DB:
            db_acc += tl.sum(dy, axis=0)
        c1 = tl.sum(g * xhat, axis=1) / N
        if RELOAD:
            # a second read of its own (evict_first: the row's last use), not merged with the first
            dy, xhat, g = _bwd_tiles(X + base, DY + base, W, w, offs, cols, mask, cmask, mean, rstd, IS_RMS,
                                     HAS_W, False, "evict_first", MASKED)
        c2 = tl.zeros_like(c1)
        if not IS_RMS:
            c2 = tl.sum(g, axis=1) / N  # after the second read: fewer values live across c1's sum
        dx = (g - xhat * c1[:, None] - c2[:, None]) * rstd[:, None]
        if MASKED:
            if HAS_DRO:
                dx += tl.load(DRO + base + offs, mask=mask, other=0.0).to(tl.float32)
            tl.store(DX + base + offs, dx.to(DX.dtype.element_ty), mask=mask)
            if HAS_DRES:
                tl.store(DRES + base + offs, dx.to(DRES.dtype.element_ty), mask=mask)
        else:
            if HAS_DRO:
                dx += tl.load(DRO + base + offs).to(tl.float32)
            tl.store(DX + base + offs, dx.to(DX.dtype.element_ty))
            if HAS_DRES:
                tl.store(DRES + base + offs, dx.to(DRES.dtype.element_ty))
    if WANT_DW:
        tl.store(DW_P + pid * N + cols, dw_acc, mask=cmask)
    if WANT_DB:
        tl.store(DB_P + pid * N + cols, db_acc, mask=cmask)


@triton.jit
def _norm_bwd_looped_kernel(DY, X, W, MEAN, RSTD, DRO, DX, DRES, DW_P, DB_P, M, N, rows_per_prog,
                            IS_RMS: tl.constexpr, HAS_W: tl.constexpr, HAS_DRO: tl.constexpr,
                            HAS_DRES: tl.constexpr, WANT_DW: tl.constexpr, WANT_DB: tl.constexpr,
                            BLOCK_N: tl.constexpr, STAGES: tl.constexpr):
    # Rows too long for registers: two passes per row over column chunks; the program's
    # dweight/dbias sums live in its own partial row (only this program touches it). STAGES
    # pipelines the first pass's chunk loads (read-only data); the second pass reads and writes
    # the partial row, so it stays unpipelined (no async copy may read a slot before this
    # thread's store to it).
    pid = tl.program_id(0)
    cols0 = tl.arange(0, BLOCK_N)
    row_start = pid.to(tl.int64) * rows_per_prog  # int64 rows: the loop variable inherits it
    row_end = tl.minimum(row_start + rows_per_prog, M)
    p_base = pid.to(tl.int64) * N
    for start in range(0, N, BLOCK_N):
        cols = start + cols0
        zero = tl.zeros((BLOCK_N,), tl.float32)
        if WANT_DW:
            tl.store(DW_P + p_base + cols, zero, mask=cols < N)
        if WANT_DB:
            tl.store(DB_P + p_base + cols, zero, mask=cols < N)
    for row in range(row_start, row_end):
        base = row * N
        rstd = tl.load(RSTD + row)
        mean = 0.0
        if not IS_RMS:
            mean = tl.load(MEAN + row)
        a1 = tl.zeros((BLOCK_N,), tl.float32)
        a2 = tl.zeros((BLOCK_N,), tl.float32)
        for start in tl.range(0, N, BLOCK_N, num_stages=STAGES):
            cols = start + cols0
            m = cols < N
            xhat = tl.where(m, (tl.load(X + base + cols, mask=m, other=0.0).to(tl.float32) - mean) * rstd, 0.0)
            g = tl.load(DY + base + cols, mask=m, other=0.0).to(tl.float32)
            if HAS_W:
                g *= tl.load(W + cols, mask=m, other=0.0).to(tl.float32)
            a1 += g * xhat
            a2 += g
        c1 = tl.sum(a1, axis=0) / N
        c2 = 0.0
        if not IS_RMS:
            c2 = tl.sum(a2, axis=0) / N
        for start in range(0, N, BLOCK_N):
            cols = start + cols0
            m = cols < N
            xhat = tl.where(m, (tl.load(X + base + cols, mask=m, other=0.0).to(tl.float32) - mean) * rstd, 0.0)
            dy = tl.load(DY + base + cols, mask=m, other=0.0).to(tl.float32)
            g = dy
            if HAS_W:
                g = dy * tl.load(W + cols, mask=m, other=0.0).to(tl.float32)
            dx = (g - xhat * c1 - c2) * rstd
            if HAS_DRO:
                dx += tl.load(DRO + base + cols, mask=m, other=0.0).to(tl.float32)
            tl.store(DX + base + cols, dx.to(DX.dtype.element_ty), mask=m)
            if HAS_DRES:
                tl.store(DRES + base + cols, dx.to(DRES.dtype.element_ty), mask=m)
            if WANT_DW:
                p = DW_P + p_base + cols
                tl.store(p, tl.load(p, mask=m, other=0.0) + dy * xhat, mask=m)
            if WANT_DB:
                p = DB_P + p_base + cols
                tl.store(p, tl.load(p, mask=m, other=0.0) + dy, mask=m)


@triton.jit
def _col_sum_kernel(P, OUT0, OUT1, num_rows, N, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    # OUTk[c] = sum over r of P[k, r, c] in a fixed order (a fixed tile walk, then a fixed tree);
    # k = program_id(1): dweight and dbias in one launch (a launch costs the host more than
    # this kernel costs the GPU)
    k = tl.program_id(1)
    P += k.to(tl.int64) * num_rows * N
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < N
    acc = tl.zeros((BLOCK_R, BLOCK_C), tl.float32)
    for r0 in range(0, num_rows, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        m = (rows < num_rows)[:, None] & cmask[None, :]
        acc += tl.load(P + rows.to(tl.int64)[:, None] * N + cols[None, :], mask=m, other=0.0)
    if k == 0:
        tl.store(OUT0 + cols, tl.sum(acc, axis=0).to(OUT0.dtype.element_ty), mask=cmask)
    else:
        tl.store(OUT1 + cols, tl.sum(acc, axis=0).to(OUT1.dtype.element_ty), mask=cmask)


def _sms(device):
    # TRITON_INTERPRET=1 on CPU tensors: 2
    return device_properties(device_index(device)).multi_processor_count if device.type == "cuda" else 2


def _smem_per_program(device):
    if device.type != "cuda":
        return 1 << 30
    p = device_properties(device_index(device))
    return getattr(p, "shared_memory_per_block_optin", 0) or p.shared_memory_per_block


# Backward launch (_bwd_config). ROWS / warps / programs per SM are the best of a sweep of the
# unpipelined launch; pipelining adds loads in flight without changing what a step costs in
# registers (96-116 a thread, no spills, sm_90).
# - 3 stages: two steps' x/dy in flight per program besides the one being reduced. An H200 needs
#   about 25 KB of loads in flight per SM to cover HBM latency at full bandwidth (4.8 TB/s x
#   ~0.7 us / 132 SMs); 3 stages keep 48-64 KB in flight per SM at N = 768..8192, 2 half that.
# - N = 16384 (RELOAD, 16 warps, 1 program per SM, 2 stages): x, dy, weight and both sums in
#   registers spill, so only the dweight/dbias sums stay and x/dy/weight are read again after
#   the row sums. Its 2-stage buffers take 160 KB of shared memory (192 KB with fp32 params):
#   3 stages do not fit. At 32 warps LayerNorm's two (BLOCK_N,) sums still spill; RMSNorm (one
#   sum) fits, hence its 32-warp launch. layer_norm_gluon.py keeps the row in shared memory
#   instead, and runs there (GLUON_MIN_N).
#
# Forward launch (_FWD, _FWD_WIDE_PARAMS), from sweeps on the H200 (fp16 and bf16 LayerNorm):
# - 16-bit params: 2 rows / 2 warps a program up to N = 1024, then one row / 4 warps (8 at
#   16384); shorter rows keep 4096 elements / 4 warps a program (not swept).
# - fp32 params with 16-bit x (the AMP case): each row step reads the params again from L2, 8
#   bytes per element against x's 2 of HBM, so several rows a step share one read. All still
#   behind the CUDA kernel at N >= 8192, which "auto" runs for this case.
# - PARAMS_FIRST (the params loaded with x, as torch.compile's LayerNorm kernels do, rather than
#   after the two reductions): on where it measured faster; 20-35% slower with 8-16 warps at
#   N >= 4096.
# L2 eviction hints on x and the params and a persistent launch reading the params once per
# program were slower (docs/performance.md).
# BLOCK_N -> (ROWS, num_warps, PARAMS_FIRST)
_FWD = {1024: (2, 2, False), 2048: (1, 4, False), 4096: (1, 4, True), 8192: (1, 4, False), 16384: (1, 8, False)}
_FWD_WIDE_PARAMS = {2048: (4, 8, False), 4096: (2, 8, False), 8192: (1, 8, True), 16384: (2, 32, False)}


# The chunked two-pass kernel takes rows past the register kernel, and, with 16-bit params,
# RMSNorm's of 8192 and 16384 elements and LayerNorm's of 16384, where it is faster than the
# register kernel: (chunk columns, warps, unroll), chosen from timings on the H200 (LayerNorm
# at 16384 leaves the unroll to the compiler). Without unrolling
# (one chunk's loads in flight a thread) or pipelined through shared memory it ran 10-30% slower.
_CHUNKED_LONG = (4096, 16, 8)
_CHUNKED_RMS = {8192: (4096, 16, 4), 16384: (4096, 16, 8)}
_CHUNKED_LN = {16384: (4096, 16, 1)}


def _fwd_chunked(block, is_rms, wide_params):
    """(chunk columns, warps, unroll) when the chunked kernel runs rows of this BLOCK_N, else None."""
    if block > _MAX_FWD_BLOCK:
        return _CHUNKED_LONG
    if wide_params:
        return None
    return (_CHUNKED_RMS if is_rms else _CHUNKED_LN).get(block)


@functools.lru_cache(None)
def _fwd_config(n, wide_params=False):
    """(BLOCK_N, ROWS, num_warps, PARAMS_FIRST) for rows of n elements; wide_params: fp32
    params, 16-bit x."""
    block = triton.next_power_of_2(n)
    if wide_params and block in _FWD_WIDE_PARAMS:
        return block, *_FWD_WIDE_PARAMS[block]
    if block in _FWD:
        return block, *_FWD[block]
    if block < 1024:  # several rows per program, up to 4096 elements
        return block, min(64, 4096 // block), 4, False
    return block, 1, 8, False  # longer rows take the chunked kernel, which ignores the config


@functools.lru_cache(None)
def _bwd_config(n, is_rms=False, wide_params=False):
    """(BLOCK_N, ROWS, num_warps, programs per SM, looped, num_stages) for rows of n elements
    (wide_params: fp32 weight with 16-bit x). The register kernel takes RELOAD when BLOCK_N >
    _MAX_BWD_BLOCK (see norm_bwd)."""
    block = triton.next_power_of_2(n)
    if block > _MAX_BWD_RELOAD_BLOCK:
        return _looped_bwd_config()
    if block > _MAX_BWD_BLOCK:
        if is_rms:
            # RMSNorm (one sum) fits unpipelined at 32 warps with 16-bit params, 16 with fp32
            # params: both faster than LayerNorm's pipelined 16-warp launch (docs/performance.md)
            return block, 1, 16 if wide_params else 32, 1, False, 1
        return block, 1, 16, 1, False, 2
    rows = min(64, max(1, 2048 // block))
    warps = 4 if block * rows <= 2048 else 8 if block <= 4096 else 16
    return block, rows, warps, 16 // warps, False, 3


def _looped_bwd_config():
    return _LOOP_BLOCK, 1, 16, 1, True, 3


def _bwd_fit(cfg, smem, x, dy, weight, dresidual_out):
    """cfg with num_stages lowered until the pipeline's shared-memory buffers fit smem bytes per
    program (fp32 x, fp32 params or dresidual_out on long rows); a RELOAD config that cannot
    keep its 2 stages takes the looped kernel instead. Depends only on shape, dtypes and GPU."""
    block, rows, warps, per_sm, looped, stages = cfg
    reload = not looped and block > _MAX_BWD_BLOCK
    xdy = x.element_size() + dy.element_size()
    w = weight.element_size() if weight is not None else 0
    if looped:  # the first pass's chunk loads
        per_stage = block * (xdy + w)
    else:
        dro = dresidual_out.element_size() if dresidual_out is not None else 0
        per_stage = block * rows * (xdy + dro) + 8 * rows + (block * (xdy + w) if reload else 0)
    while stages > 1 and (stages - 1) * per_stage + _SMEM_MARGIN > smem:
        stages -= 1
    if reload and stages < min(cfg[5], 2):
        return _bwd_fit(_looped_bwd_config(), smem, x, dy, weight, None)
    return block, rows, warps, per_sm, looped, stages


def _wide_params(x, weight):
    """fp32 params with 16-bit x (the AMP case), which the launch tables key on."""
    return x.element_size() == 2 and weight is not None and weight.element_size() == 4


def _check_2d(x, name):
    if x.dim() != 2 or not x.is_contiguous():
        raise ValueError(f"triton norm: {name} must be a contiguous 2-D tensor, got shape {tuple(x.shape)}")


@functools.lru_cache(None)
def _fp32_dummy(device):
    """An fp32 pointer for MEAN/RSTD when they are not written: the same pointer type as when they
    are (for the chunked kernel, the same compiled kernel)."""
    return torch.empty(4, dtype=torch.float32, device=device)


def norm_fwd(x, weight, bias, residual, eps, is_rms, out_dtype, residual_in_fp32, want_stats=True):
    """(out, residual_out, mean, rstd), as torch.ops.ampkernels.norm_fwd_cuda; want_stats=False
    (inference: no backward reads them) leaves mean and rstd empty and unwritten."""
    _check_2d(x, "x")
    M, N = x.shape
    out = torch.empty((M, N), dtype=out_dtype or x.dtype, device=x.device)
    res_out = x.new_empty(0)
    if residual is not None:
        res_out = torch.empty((M, N), dtype=torch.float32 if residual_in_fp32 else x.dtype, device=x.device)
    mean = torch.empty(0 if is_rms or not want_stats else M, dtype=torch.float32, device=x.device)
    rstd = torch.empty(M if want_stats else 0, dtype=torch.float32, device=x.device)
    if M == 0 or N == 0:
        return out, res_out, mean, rstd
    dummy, stat_dummy = x, _fp32_dummy(x.device)
    ptrs = (x, dummy if residual is None else residual, dummy if weight is None else weight,
            dummy if bias is None else bias, out, dummy if residual is None else res_out,
            mean if want_stats and not is_rms else stat_dummy, rstd if want_stats else stat_dummy)
    flags = dict(IS_RMS=is_rms, HAS_R=residual is not None, HAS_W=weight is not None, HAS_B=bias is not None)
    wide_params = _wide_params(x, weight)
    block, rows, warps, params_first = _fwd_config(N, wide_params)
    chunked = _fwd_chunked(block, is_rms, wide_params)
    gluon_per_sm = _gluon_fwd_programs_per_sm(x, weight, bias, residual, is_rms)
    with on_device(x):
        if gluon_per_sm:
            rows_per_prog = cdiv(M, min(M, _sms(x.device) * gluon_per_sm))
            launch(_gluon.norm_fwd_smem_kernel, (cdiv(M, rows_per_prog),), x, ptrs[2], ptrs[3], out, ptrs[6], ptrs[7], M,
                   rows_per_prog, eps, N=N, BLOCK=_gluon.fwd_block(N), IS_RMS=is_rms, HAS_W=True, HAS_B=bias is not None,
                   STORE_STATS=want_stats, STAGES=_gluon.STAGES, num_warps=_gluon.NUM_WARPS)
        elif chunked:
            chunk, chunk_warps, unroll = chunked
            launch(_norm_fwd_chunked_kernel, (M,), *ptrs, M, eps, int(want_stats), N=N, **flags, BLOCK_N=chunk,
                   UNROLL=unroll, EVEN=N % chunk == 0, num_warps=chunk_warps)
        else:
            launch(_norm_fwd_kernel, (cdiv(M, rows),), *ptrs, M, N, eps, **flags, BLOCK_N=block, ROWS=rows,
                   PARAMS_FIRST=params_first, STORE_STATS=want_stats, num_warps=warps)
    return out, res_out, mean, rstd


def norm_bwd(dy, x, weight, mean, rstd, dresidual_out, is_rms, want_dweight, want_dbias, dx_dtype, dresidual_dtype,
             param_dtype):
    """(dx, dresidual, dweight, dbias), as torch.ops.ampkernels.norm_bwd_cuda."""
    _check_2d(x, "x")
    _check_2d(dy, "dy")
    M, N = x.shape
    dx = torch.empty((M, N), dtype=dx_dtype, device=x.device)
    dres = x.new_empty(0)
    if dresidual_dtype is not None and dresidual_dtype != dx_dtype:
        dres = torch.empty((M, N), dtype=dresidual_dtype, device=x.device)
    param_dtype = param_dtype or (weight.dtype if weight is not None else x.dtype)
    dw = torch.empty(N if want_dweight else 0, dtype=param_dtype, device=x.device)
    db = torch.empty(N if want_dbias else 0, dtype=param_dtype, device=x.device)
    if M == 0 or N == 0:
        return dx, dres, dw.zero_(), db.zero_()
    # the launch config depends on the table's config for N, the dtypes and the GPU only: fitted
    # once per such key (a call costs the host little besides Triton's own launches). The fit
    # models the pipeline's buffers; the compiler's own use can exceed it (with Triton 3.8,
    # N = 16384 with dresidual_out: 14 KB more, past the H200's 227 KB): then Triton refuses the
    # launch, and the next smaller config that launches is what the key keeps
    table_cfg = _bwd_config(N, is_rms, _wide_params(x, weight))
    key = (table_cfg, x.dtype, dy.dtype, weight.dtype if weight is not None else None,
           dresidual_out.dtype if dresidual_out is not None else None, dres.dtype if dres.numel() else None,
           want_dweight, want_dbias, x.device)
    cfg = _BWD_CONFIGS.get(key)
    if cfg is None:
        cfg = _BWD_CONFIGS[key] = _bwd_fit(table_cfg, _smem_per_program(x.device), x, dy, weight, dresidual_out)
    # with cfg and the pointers' alignment (_bwd_launch), all that the two launches specialize on
    kept_key = (key, M, N, is_rms, dx.dtype, param_dtype, mean.dtype, rstd.dtype)
    while True:
        try:
            _bwd_launch(cfg, dy, x, weight, mean, rstd, dresidual_out, is_rms, want_dweight, want_dbias, dx, dres, dw,
                        db, kept_key)
            break
        except OutOfResources:
            smaller = _smaller_bwd_config(cfg, x, dy, weight)
            if smaller is None:
                raise
            cfg = _BWD_CONFIGS[key] = smaller
    return dx, dres, dw, db


_BWD_CONFIGS = {}  # norm_bwd's launch key -> the config it launches (see norm_bwd)
# (shapes, dtypes, flags, config, pointer alignment: _bwd_launch's kept_key) -> the Kept backward and
# column-sum launches (ampkernels.triton.launch): a call that keys the same runs them without
# launch()'s per-argument key and its lookup (about a quarter of a call's host time)
_BWD_KEPT = {}
_MAX_KEPT = 1024


# The Gluon kernels (layer_norm_gluon.py) take the backward of the rows RELOAD takes and the
# forward of 16-bit x with fp32 params on rows of 4104-16384; they run from the row lengths where
# they measured faster than the Triton kernels above (H200, fp16/bf16, M*N = 2^27; N 8192 and
# 16384 measured): the backward at 16384 (3.46-3.66 TB/s against 2.26-3.57), the AMP forward of
# LayerNorm from 8192 (3.05-3.28 against 2.28-2.70) and of RMSNorm at 16384 (3.63-3.64 against
# 3.43-3.44; at 8192 it was slower, 3.56-3.58 against 3.85-3.88).
GLUON_MIN_N = {"bwd": 16384, "fwd_layer_norm": 8192, "fwd_rms_norm": 16384}


def _gluon_can_run(x):
    """Gluon present and a GPU with cp.async (sm_80+); never CPU tensors (no interpreter)."""
    if not _gluon.available() or x.device.type == "cpu":
        return False
    return x.device.type != "cuda" or device_properties(device_index(x.device)).major >= 8


def _gluon_bwd_takes(x, dy, dresidual_out, dres):
    """Whether the Gluon backward runs this RELOAD call: _gluon_can_run, the shared memory for
    its ring, and a call it takes (_gluon.bwd_eligible)."""
    if x.shape[1] < GLUON_MIN_N["bwd"] or not _gluon_can_run(x):
        return False
    need = _gluon.bwd_smem_bytes(x.element_size(), dy.element_size()) + _SMEM_MARGIN
    return need <= _smem_per_program(x.device) and _gluon.bwd_eligible(x, dy, dresidual_out, dres)


def _gluon_fwd_programs_per_sm(x, weight, bias, residual, is_rms):
    """Programs per SM of the Gluon forward for this call (0: it does not take it): the AMP case
    (16-bit x, fp32 weight), no residual, the shared memory for its ring and params."""
    min_n = GLUON_MIN_N["fwd_rms_norm" if is_rms else "fwd_layer_norm"]
    if x.shape[1] < min_n or not _wide_params(x, weight) or not _gluon_can_run(x) or \
            not _gluon.fwd_eligible(x, residual):
        return 0
    block = _gluon.fwd_block(x.shape[1])
    need = _gluon.fwd_smem_bytes(block, x.element_size(), 1 + (bias is not None)) + _SMEM_MARGIN
    smem = _smem_per_program(x.device)
    return 0 if need > smem else 2 if 2 * need <= smem else 1  # (an SM has a little more than a block)


def _smaller_bwd_config(cfg, x, dy, weight):
    """One step down after a launch refused for shared memory: a stage fewer (RELOAD keeps 2),
    then the looped kernel at the stages that fit; None when nothing is smaller."""
    block, rows, warps, per_sm, looped, stages = cfg
    reload = not looped and block > _MAX_BWD_BLOCK
    if stages > (2 if reload else 1):
        return block, rows, warps, per_sm, looped, stages - 1
    if not looped:
        return _bwd_fit(_looped_bwd_config(), _smem_per_program(x.device), x, dy, weight, None)
    return None


def _bwd_launch(cfg, dy, x, weight, mean, rstd, dresidual_out, is_rms, want_dweight, want_dbias, dx, dres, dw, db,
                kept_key=None):
    """The backward's launches for cfg; kept_key (norm_bwd's): keep them and rerun the kept ones
    for calls of the same key (None, as the sweep calls it: launch() each time)."""
    M, N = x.shape
    block, rows, warps, per_sm, looped, stages = cfg
    gluon_bwd = not looped and block > _MAX_BWD_BLOCK and _gluon_bwd_takes(x, dy, dresidual_out, dres)
    progs = min(cdiv(M, rows), _sms(x.device) * per_sm)
    rows_per_prog = cdiv(cdiv(M, progs), rows) * rows
    progs = cdiv(M, rows_per_prog)
    dummy = x
    # the programs' fp32 partial rows: [dweight's, then dbias's], each (progs, N)
    partials = torch.empty((want_dweight + want_dbias, progs, N), dtype=torch.float32, device=x.device)
    dw_p = partials[0] if want_dweight else dummy
    db_p = partials[-1] if want_dbias else dummy
    head = (dy, x, dummy if weight is None else weight, rstd if is_rms else mean, rstd)
    if gluon_bwd:
        args = (*head, dx, dw_p, db_p, M, rows_per_prog)
    else:
        args = (*head, dummy if dresidual_out is None else dresidual_out, dx, dres if dres.numel() else dummy,
                dw_p, db_p, M, N, rows_per_prog)
    sum_args = ()
    if partials.shape[0]:
        sum_args = (partials, dw if want_dweight else db, db if want_dbias else dw, progs, N)
    if kept_key is not None:
        kept_key = (kept_key, cfg, gluon_bwd, tuple(a.data_ptr() % 16 == 0 for a in args + sum_args
                                                    if isinstance(a, torch.Tensor)))
    kept = _BWD_KEPT.get(kept_key) if kept_key is not None else None
    with on_device(x):
        if kept is not None:
            kept[0].run(*args)
            if sum_args:
                kept[1].run(*sum_args)
            return
        flags = dict(IS_RMS=is_rms, HAS_W=weight is not None, HAS_DRO=dresidual_out is not None,
                     HAS_DRES=dres.numel() > 0, WANT_DW=want_dweight, WANT_DB=want_dbias)
        if gluon_bwd:
            bwd = launch(_gluon.norm_bwd_smem_kernel, (progs,), *args, N=N, IS_RMS=is_rms, HAS_W=weight is not None,
                         WANT_DW=want_dweight, WANT_DB=want_dbias, STAGES=_gluon.STAGES, num_warps=_gluon.NUM_WARPS)
        elif looped:
            bwd = launch(_norm_bwd_looped_kernel, (progs,), *args, **flags, BLOCK_N=block, STAGES=stages,
                         num_warps=warps)
        else:
            bwd = launch(_norm_bwd_kernel, (progs,), *args, **flags, BLOCK_N=block, ROWS=rows, STAGES=stages,
                         RELOAD=block > _MAX_BWD_BLOCK, MASKED=rows > 1 or block != N, num_warps=warps)
        col_sum = None
        if sum_args:
            col_sum = launch(_col_sum_kernel, (cdiv(N, 128), partials.shape[0]), *sum_args, BLOCK_R=16, BLOCK_C=128,
                             num_warps=4)
    if kept_key is not None and bwd is not None and (col_sum is not None or not sum_args):
        if len(_BWD_KEPT) >= _MAX_KEPT:  # row counts vary (sequence lengths): keep the cache bounded
            _BWD_KEPT.clear()
        _BWD_KEPT[kept_key] = (bwd, col_sum)

