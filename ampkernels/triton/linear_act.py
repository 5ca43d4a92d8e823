"""Triton kernels for linear_act: y = act(x @ W^T + b).

Forward (`_linear_act_fwd_kernel`): one program owns a BLOCK_M x BLOCK_N tile of y (M, N).
It walks K in BLOCK_K steps, accumulating x (M, K) . W^T (K, N) in fp32 with tl.dot; the
epilogue adds the bias in fp32, rounds the pre-activation to y's dtype (the value backward
reads, stored to `pre` when STORE_PRE), and stores act(pre) in y's dtype. Programs walk the
tiles in GROUP_M-row bands so that the programs in flight share W and x tiles in L2. The
launch is persistent on a GPU (one program per SM, or two for the TMA kernel's PER_SM = 2
configs, each looping over tiles): no launch tail wave, and the bias/activation epilogue costs
no extra pass over y.
On Hopper (`_linear_act_fwd_tma_kernel`, the default when the operands are 16-byte aligned
with N, K multiples of 8) the same kernel moves tiles with TMA descriptors: no per-element
address math, zero-filled out-of-bounds loads, clipped stores, no masks; per shape it is timed
once against the warp-specialized ping-pong kernel of linear_act_pingpong.py and the faster runs.

Backward (`_linear_act_dz_kernel`): dz = dy * act'(saved) over BLOCK_M x BLOCK_N tiles, in
dy's dtype, plus fp32 column sums of dz per row block (the dbias partials, later summed in
a fixed order: deterministic). The two GEMMs of the backward (dx = dz W, dW = dz^T x) run
on cuBLAS: applying act' on the fly inside them would recompute it once per output tile
column (K / BLOCK_N times), which for erf/tanh/exp activations costs more CUDA-core time than
one extra elementwise pass costs bandwidth.

Activation ids follow ampkernels.reference.ACTIVATIONS. All activation math is fp32 (epilogue.py);
the GELUs and SiLU and their derivatives use the GPU's approximate ex2/rcp (within 2e-5 relative
of float64, tests/test_linear_act.py).
"""
import logging
import os

import torch
import triton
import triton.language as tl

from . import cdiv, device_index, device_properties, on_device
from . import linear_act_pingpong as _pingpong
from .epilogue import _act_fwd, _act_grad, _tile_origin
from .launch import launch

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # older Triton: the pointer kernel only
    TensorDescriptor = None

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# AMPKERNELS_TRITON_AUTOTUNE=0: one config per kernel, no tuning runs (fast test sessions)
_AUTOTUNE = os.environ.get("AMPKERNELS_TRITON_AUTOTUNE", "1") != "0"
log = logging.getLogger("ampkernels")


def _fwd_configs(tune=_AUTOTUNE):
    if _INTERPRET:  # small tiles: the interpreter runs them as numpy on CPU
        return [triton.Config({"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 4}, num_warps=4)]
    # Hopper (228 KB smem/SM): 128x256 and 256x128 tiles with 3 stages keep wgmma busy on large
    # shapes; 128x128 with 4 stages suits small N or K; 8 warps = 2 warpgroups for a 128-row tile.
    cfg = [
        (128, 128, 64, 4, 8),  # first: the only one when autotuning is off (fits smem in every mode)
        (128, 256, 64, 3, 8),
        (256, 128, 64, 3, 8),
        (128, 128, 64, 4, 4),
        (64, 128, 64, 4, 4),
    ]
    cfg = cfg if tune else cfg[:1]
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8}, num_stages=s, num_warps=w)
            for bm, bn, bk, s, w in cfg]


@triton.autotune(configs=_fwd_configs(), key=["M", "N", "K", "ACT", "STORE_PRE", "HAS_BIAS"])
@triton.jit
def _linear_act_fwd_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, pre_ptr,
    M, N, K,
    stride_xm, stride_wn,
    ACT: tl.constexpr, HAS_BIAS: tl.constexpr, STORE_PRE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    pid = tl.program_id(0)
    NUM_PROGRAMS = tl.num_programs(0)
    num_m = (M + BLOCK_M - 1) // BLOCK_M
    num_n = (N + BLOCK_N - 1) // BLOCK_N
    num_tiles = num_m * num_n
    for tile in range(pid, num_tiles, NUM_PROGRAMS):
        off_m, off_n = _tile_origin(tile, num_m, num_n, GROUP_M, BLOCK_M, BLOCK_N)
        offs_m = off_m + tl.arange(0, BLOCK_M)
        offs_n = off_n + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        # clamp rows/cols instead of masking the loads: the tail tile re-reads valid memory and
        # its extra rows/cols are never stored (keeps the main loop's loads unmasked along M/N)
        rm = tl.where(offs_m < M, offs_m, 0).to(tl.int64)
        rn = tl.where(offs_n < N, offs_n, 0).to(tl.int64)
        x_tile = x_ptr + rm[:, None] * stride_xm + offs_k[None, :]
        w_tile = w_ptr + rn[:, None] * stride_wn + offs_k[None, :]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, (K + BLOCK_K - 1) // BLOCK_K):
            k_left = K - k * BLOCK_K
            a = tl.load(x_tile, mask=offs_k[None, :] < k_left, other=0.0)
            b = tl.load(w_tile, mask=offs_k[None, :] < k_left, other=0.0)
            acc = tl.dot(a, tl.trans(b), acc)
            x_tile += BLOCK_K
            w_tile += BLOCK_K

        if HAS_BIAS:
            bias = tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)
            acc += bias[None, :]
        pre = acc.to(y_ptr.dtype.element_ty)  # rounded as the unfused path (GEMM, then act) rounds it
        out_mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
        out_off = offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
        if STORE_PRE:
            tl.store(pre_ptr + out_off, pre, mask=out_mask)
        y = _act_fwd(pre.to(tl.float32), ACT)
        tl.store(y_ptr + out_off, y.to(y_ptr.dtype.element_ty), mask=out_mask)


def _tma_configs(tune=_AUTOTUNE):
    """The TMA kernel's autotune configs (tune=False: the first only)."""
    if _INTERPRET:  # flattened and subtiled, as the GPU's first config, in small tiles
        return [triton.Config({"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 4, "FLATTEN": True,
                               "SUBTILE": True, "PER_SM": 1}, num_warps=4, pre_hook=_set_block_shapes)]
    # smem per stage (fp16): (BM + BN) * BK * 2 bytes; the epilogue stages y (and pre) tiles too;
    # configs that do not fit (e.g. 128x256 with pre stored at 4 stages) are dropped by the
    # autotuner. FLATTEN: one loop over (tile, k) for the software pipeliner, so the next tile's
    # first loads are in flight during this tile's epilogue; SUBTILE: the epilogue in two
    # BLOCK_N / 2 halves, half the staging smem (room for a 4th stage). Both after Triton's
    # persistent-matmul tutorial. PER_SM = 2: two programs per SM (<= 112 KB of smem each with
    # 3 stages and a subtiled epilogue; 4 warps, or 8 at <= 128 registers), so one's epilogue
    # runs beside the other's main loop: wgmma leaves the FP32 and SFU pipes free. 2 stages were
    # 10-20% slower than 3. First (the only one when autotuning is off): the flattened 4-warp
    # two-per-SM config, the fastest for all four activations at 8192x1024x4096 on the H200.
    cfg = [(128, 128, 64, 3, 4, True, True, 2), (128, 128, 64, 3, 8, False, False, 1),
           (128, 256, 64, 3, 8, False, False, 1), (256, 128, 64, 3, 8, False, False, 1),
           (128, 256, 64, 3, 8, True, True, 1), (128, 256, 64, 4, 8, True, True, 1),
           (128, 128, 64, 4, 8, True, True, 1), (128, 128, 128, 3, 8, True, True, 1),
           (128, 128, 64, 3, 4, False, True, 2), (128, 128, 64, 3, 8, False, True, 2)]
    cfg = cfg if tune else cfg[:1]
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8, "FLATTEN": flat, "SUBTILE": sub,
                           "PER_SM": per_sm}, num_stages=s, num_warps=w, pre_hook=_set_block_shapes)
            for bm, bn, bk, s, w, flat, sub, per_sm in cfg]


def _set_block_shapes(nargs):
    bm, bn, bk = nargs["BLOCK_M"], nargs["BLOCK_N"], nargs["BLOCK_K"]
    out_n = bn // 2 if nargs["SUBTILE"] else bn  # y and pre are stored in halves when subtiled
    nargs["x_desc"].block_shape = [bm, bk]
    nargs["w_desc"].block_shape = [bn, bk]
    nargs["y_desc"].block_shape = [bm, out_n]
    nargs["pre_desc"].block_shape = [bm, out_n]


@triton.jit
def _tma_epilogue(acc, off_m, off_n, b_ptr, y_desc, pre_desc, N, ACT: tl.constexpr, HAS_BIAS: tl.constexpr,
                  STORE_PRE: tl.constexpr, WIDTH: tl.constexpr):
    # acc: BLOCK_M x WIDTH fp32 at (off_m, off_n): + bias, rounded pre-activation, act
    if HAS_BIAS:
        offs_n = off_n + tl.arange(0, WIDTH)
        acc += tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    out_ty = b_ptr.dtype.element_ty  # b_ptr is the bias or, without one, x: always y's dtype
    pre = acc.to(out_ty)
    if STORE_PRE:
        pre_desc.store([off_m, off_n], pre)
    y_desc.store([off_m, off_n], _act_fwd(pre.to(tl.float32), ACT).to(out_ty))


@triton.autotune(configs=_tma_configs(), key=["M", "N", "K", "ACT", "STORE_PRE", "HAS_BIAS"])
@triton.jit
def _linear_act_fwd_tma_kernel(
    x_desc, w_desc, y_desc, pre_desc, b_ptr,
    M, N, K,
    ACT: tl.constexpr, HAS_BIAS: tl.constexpr, STORE_PRE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    FLATTEN: tl.constexpr, SUBTILE: tl.constexpr, PER_SM: tl.constexpr,
):
    # Same tile walk and epilogue as _linear_act_fwd_kernel; operands move by TMA (Hopper's
    # bulk tensor copies: no address math in registers, out-of-bounds boxes are zero-filled on
    # load and clipped on store, so no masks anywhere).
    pid = tl.program_id(0)
    NUM_PROGRAMS = tl.num_programs(0)  # PER_SM per SM (the grid), or one per tile when fewer
    num_m = (M + BLOCK_M - 1) // BLOCK_M
    num_n = (N + BLOCK_N - 1) // BLOCK_N
    num_tiles = num_m * num_n
    # the epilogue walks the tiles with its own counter: with FLATTEN the pipeliner may then
    # issue the next tile's loads before this tile's epilogue without a shared dependency
    tile_out = pid - NUM_PROGRAMS
    for tile in tl.range(pid, num_tiles, NUM_PROGRAMS, flatten=FLATTEN):
        off_m, off_n = _tile_origin(tile, num_m, num_n, GROUP_M, BLOCK_M, BLOCK_N)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, (K + BLOCK_K - 1) // BLOCK_K):
            a = x_desc.load([off_m, k * BLOCK_K])
            b = w_desc.load([off_n, k * BLOCK_K])
            acc = tl.dot(a, b.T, acc)
        tile_out += NUM_PROGRAMS
        off_m, off_n = _tile_origin(tile_out, num_m, num_n, GROUP_M, BLOCK_M, BLOCK_N)
        if SUBTILE:
            acc0, acc1 = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))
            _tma_epilogue(acc0, off_m, off_n, b_ptr, y_desc, pre_desc, N, ACT, HAS_BIAS, STORE_PRE, BLOCK_N // 2)
            _tma_epilogue(acc1, off_m, off_n + BLOCK_N // 2, b_ptr, y_desc, pre_desc, N, ACT, HAS_BIAS, STORE_PRE,
                          BLOCK_N // 2)
        else:
            _tma_epilogue(acc, off_m, off_n, b_ptr, y_desc, pre_desc, N, ACT, HAS_BIAS, STORE_PRE, BLOCK_N)


def _tma_ok(*tensors):
    """TMA descriptors need 16-byte aligned bases and row strides (N, K multiples of 8 in fp16)."""
    return all(t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0 for t in tensors)


_TMA_STATE = {"broken": None}  # set to the error if a TMA launch ever fails: then pointers only


def tma_enabled(device):
    if (TensorDescriptor is None or os.environ.get("AMPKERNELS_TRITON_TMA", "1") == "0"
            or _TMA_STATE["broken"] is not None or _INTERPRET):
        return False
    return device.type == "cuda" and _cc_major(device) >= 9


def _cc_major(device):
    return device_properties(device_index(device)).major


def _programs(x):
    """Programs of a persistent launch: one per SM on a GPU (each strides over the tiles by that
    count); unbounded in the interpreter, where each program takes one tile."""
    return device_properties(device_index(x.device)).multi_processor_count if x.is_cuda else 1 << 30


_PINGPONG_STATE = {"broken": None}  # set to the error if a ping-pong launch ever fails


def pingpong_enabled(device):
    # AMPKERNELS_TRITON_PINGPONG=0 turns it off (troubleshooting: Gluon is Triton's experimental API)
    if (not _pingpong.available() or os.environ.get("AMPKERNELS_TRITON_PINGPONG", "1") == "0"
            or _PINGPONG_STATE["broken"] is not None or not tma_enabled(device)):
        return False
    return _cc_major(device) == 9  # wgmma: Hopper only


# Which of the two Hopper kernels runs a forward, per (device, dtype, M bucket, N, K, ACT,
# STORE_PRE, HAS_BIAS): timed once, like the TMA kernel's own autotuning (after it). Neither wins
# everywhere on the H200 (docs/performance.md): the ping-pong kernel wins erf GELU at
# 8192x1024x4096 and loses it at 8192x4096x4096.
_KERNEL_PICK = {}


def _pingpong_is_faster(key, run_pingpong, run_tma):
    pick = _KERNEL_PICK.get(key)
    if pick is None:
        if not _AUTOTUNE or torch.cuda.is_current_stream_capturing():
            # no timing runs: the ping-pong kernel beat the TMA kernel's first config (what runs
            # untuned) in 47 of 48 CUDA-graph-replay rows on the H200
            return True
        # a kernel that cannot run raises here: _fwd then turns the ping-pong kernel off, and
        # the TMA kernel too if that was the one (it fails again in its own launch)
        t_pingpong = _median_ms(run_pingpong)
        run_tma()  # its autotuning, outside the timing
        pick = t_pingpong <= _median_ms(run_tma)
        _KERNEL_PICK[key] = pick
    return pick


def _median_ms(fn):
    import triton.testing
    return triton.testing.do_bench(fn, warmup=5, rep=25, return_mode="median")


def linear_act_fwd(x, weight, bias, act_id, store_pre, tma=None, pingpong=None):
    """(y, pre) for x (M, K), weight (N, K), bias (N,) or None, all contiguous, one dtype.

    pre is x @ W^T + b in x's dtype when store_pre, else an empty (0, 0) tensor.
    tma: None picks the TMA kernel on Hopper+ when the operands allow it; True/False force it
    (tests run the TMA kernel under TRITON_INTERPRET=1 this way).
    pingpong: None runs the warp-specialized Hopper kernel (linear_act_pingpong.py) when enabled
    (pingpong_enabled) and timed faster than the TMA kernel for this shape; True/False force it
    (TMA-ready operands).
    """
    with on_device(x):
        return _fwd(x, weight, bias, act_id, store_pre, tma, pingpong)


def _fwd(x, weight, bias, act_id, store_pre, tma, pingpong):
    M, K = x.shape
    N = weight.shape[0]
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    pre = torch.empty((M, N) if store_pre else (0, 0), dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return y, pre
    if K == 0:  # empty reduction: z = bias (or 0); tl.dot needs K >= 16 anyway
        z = torch.zeros((M, N), dtype=torch.float32, device=x.device)
        if bias is not None:
            z += bias.float()
        z = z.to(x.dtype)
        from ..reference import ACTIVATIONS, act_fwd
        y.copy_(act_fwd(z.float(), ACTIVATIONS[act_id]))
        if store_pre:
            pre.copy_(z)
        return y, pre
    programs = _programs(x)  # (when there are fewer tiles, each program takes one)

    def grid(meta):
        return (min(programs * meta.get("PER_SM", 1), cdiv(M, meta["BLOCK_M"]) * cdiv(N, meta["BLOCK_N"])),)

    b_arg = bias if bias is not None else x
    pre_arg = pre if store_pre else y
    use_tma = (tma_enabled(x.device) if tma is None else tma) and TensorDescriptor is not None
    if use_tma and _tma_ok(x, weight, y):
        def run_tma():
            # block shapes are placeholders: the autotuner's pre_hook sets them per config
            descs = [TensorDescriptor.from_tensor(t, [16, 16]) for t in (x, weight, y, pre_arg)]
            _linear_act_fwd_tma_kernel[grid](*descs, b_arg, M, N, K, ACT=act_id,
                                             HAS_BIAS=bias is not None, STORE_PRE=store_pre)

        def run_pingpong():
            _pingpong.linear_act_fwd_pingpong(x, weight, bias, act_id, y, pre if store_pre else None, programs)

        if pingpong or (pingpong is None and x.is_cuda and pingpong_enabled(x.device)):
            try:
                # M by power-of-two bucket: a new batch size does not time the two again
                key = (x.device, x.dtype, triton.next_power_of_2(M), N, K, act_id, store_pre, bias is not None)
                if pingpong or _pingpong_is_faster(key, run_pingpong, run_tma):
                    run_pingpong()
                    return y, pre
            except Exception as e:  # a Triton whose Gluon cannot build it: say so once, keep working
                if pingpong:
                    raise
                _PINGPONG_STATE["broken"] = f"{type(e).__name__}: {e}"
                log.warning("ampkernels: Gluon ping-pong matmul unavailable (%s); using the TMA kernel",
                            _PINGPONG_STATE["broken"][:300])
        try:
            run_tma()
            return y, pre
        except Exception as e:  # an old driver/ptxas without TMA: say so once, keep working
            if tma:
                raise
            _TMA_STATE["broken"] = f"{type(e).__name__}: {e}"
            log.warning("ampkernels: Triton TMA matmul unavailable (%s); using the pointer kernel",
                        _TMA_STATE["broken"][:300])
    _linear_act_fwd_kernel[grid](x, weight, b_arg, y, pre_arg, M, N, K, x.stride(0), weight.stride(0),
                                 ACT=act_id, HAS_BIAS=bias is not None, STORE_PRE=store_pre)
    return y, pre


@triton.jit
def _linear_act_dz_kernel(dy_ptr, s_ptr, dz_ptr, part_ptr, M, N, ACT: tl.constexpr, WANT_PARTIAL: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SUB_M: tl.constexpr,
                          STORE_DZ: tl.constexpr = True):
    # identity (ACT 0) reads no saved tensor; STORE_DZ=False keeps only the column sums
    # BLOCK_M rows per program (one row of dbias partials each), walked SUB_M rows at a time:
    # a thread holds few elements whatever BLOCK_M is (a whole 64 x 128 tile at once took 255
    # registers and spilled, by ptxas -v, scripts/triton_compile_check.py)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # dbias partials summed elementwise over the row steps and across rows once at the end: a
    # cross-warp tl.sum per row step halved the pass's bandwidth
    col = tl.zeros((SUB_M, BLOCK_N), tl.float32)
    for r in tl.static_range(0, BLOCK_M, SUB_M):
        offs_m = pid_m * BLOCK_M + r + tl.arange(0, SUB_M)
        mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
        off = offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
        dy = tl.load(dy_ptr + off, mask=mask, other=0.0).to(tl.float32)
        if ACT == 0:
            dz = dy.to(dz_ptr.dtype.element_ty)
        else:
            s = tl.load(s_ptr + off, mask=mask, other=0.0).to(tl.float32)
            dz = (dy * _act_grad(s, ACT)).to(dz_ptr.dtype.element_ty)
        if STORE_DZ:
            tl.store(dz_ptr + off, dz, mask=mask)
        if WANT_PARTIAL:  # dbias = column sums of dz as stored, accumulated in fp32 in a fixed order
            col += tl.where(mask, dz.to(tl.float32), 0.0)
    if WANT_PARTIAL:
        tl.store(part_ptr + pid_m * N + offs_n, tl.sum(col, axis=0), mask=offs_n < N)


def linear_act_dz(dy, saved, act_id, want_dbias, out=None):
    """(dz, dbias_fp32 or None): dz = dy * act'(saved) in dy's dtype; dbias = column sums in fp32.

    out: where dz goes (a new tensor when None); it may be dy itself, for callers that own dy:
    each program loads its tile of dy before it stores the same tile of dz."""
    dz = torch.empty_like(dy) if out is None else out
    return dz, _dz_pass(dy, saved, dz, act_id, want_dbias, True)


def column_sums(t):
    """The fp32 column sums of a 2-D tensor (an identity layer's bias gradient), in a
    fixed order: the dz pass storing nothing. Not t.sum(0): over T rows torch's reduction stages
    per-block partials in a global buffer, a transient the size of a hidden-sized tensor (H200,
    T=16384: a 128 MiB block alive at FusedMLP's Triton peak beside pre and h, allocated on the
    line of that sum; python -m tests.memory --snapshot shows it)."""
    t = t.contiguous()
    return _dz_pass(t, None, t, 0, True, False)


def _dz_pass(dy, saved, dz, act_id, want_dbias, store_dz):
    """Launches the dz pass; the fp32 column sums of dz (None unless want_dbias)."""
    M, N = dy.shape
    if M == 0 or N == 0:
        return torch.zeros(N, dtype=torch.float32, device=dy.device) if want_dbias else None
    # 64 x 128 tiles, 16 rows at a time: 16-byte vectors along N, 16 elements per thread, and
    # enough rows per program to keep the dbias partials small
    BLOCK_M, BLOCK_N, SUB_M = (32, 32, 16) if _INTERPRET else (64, 128, 16)
    grid = (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N))
    part = torch.empty((grid[0], N), dtype=torch.float32, device=dy.device) if want_dbias else dz
    with on_device(dy):
        launch(_linear_act_dz_kernel, grid, dy, dy if saved is None else saved, dz, part, M, N, ACT=act_id,
               WANT_PARTIAL=want_dbias, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, SUB_M=SUB_M, STORE_DZ=store_dz,
               num_warps=4)
    return part.sum(0) if want_dbias else None


@triton.jit
def _act_fwd_pass_kernel(pre_ptr, y_ptr, numel, ACT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    pre = tl.load(pre_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs, _act_fwd(pre, ACT).to(y_ptr.dtype.element_ty), mask=mask)


def act_forward(pre, act_id):
    """act(pre) in pre's dtype, for a contiguous pre: the forward epilogue's formulas applied to
    the rounded pre-activation it stored, so the result is the forward's output bit for bit
    (fused_mlp's backward recomputes its hidden activation with it)."""
    assert pre.is_contiguous(), "act_forward: pre must be contiguous"
    y = torch.empty_like(pre)
    if pre.numel():
        BLOCK = 1024 if _INTERPRET else 4096  # 32 elements a thread at 4 warps: 16-byte vectors
        with on_device(pre):
            launch(_act_fwd_pass_kernel, (cdiv(pre.numel(), BLOCK),), pre, y, pre.numel(), ACT=act_id, BLOCK=BLOCK,
                   num_warps=4)
    return y
