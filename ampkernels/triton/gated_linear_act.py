"""Triton kernels for gated_linear_act: h = act(x @ Wg^T + bg) * (x @ Wu^T + bu).

Forward on Hopper: the warp-specialized ping-pong kernel of linear_act_pingpong.py (GATED): each
tile's main loop is ONE 128-wide wgmma over 64 rows of the gate's weight and 64 of the up
projection's, loaded side by side into each shared-memory stage; the epilogue pairs g and u
through shared memory (gu's halves leave from there when stored) and writes h over g's half. The
epilogue overlaps the other consumer's main loop, so h costs about what the packed matmul's
(M, 2H) output costs.

Forward elsewhere (`_gated_fwd_kernel`): one program owns a BLOCK_M x BLOCK_N tile of h (M, H) and walks
K in BLOCK_K steps, loading each x tile ONCE and multiplying it into two fp32 accumulators,
one per weight (gate and up, two pointers: the weights need not be packed). The epilogue adds
the biases in fp32, rounds g and u to h's dtype (the values backward reads, stored into the
(M, 2H) buffer `gu` -- g in columns [0, H), u in [H, 2H) -- when STORE) and stores act(g) * u.
Tile walk (GROUP_M bands, persistent launch) as linear_act's pointer kernel (linear_act.py).

Backward (`_gated_bwd_kernel`): from dh (M, H) and gu, one elementwise pass writes
dg = dh * u * act'(g) and du = dh * act(g) into dgu (M, 2H) (which may be gu itself: every
program loads its tiles before it stores them), plus fp32 column sums per row block (the bias
gradients' partials, summed in a fixed order). The GEMMs of the backward run on cuBLAS.
"""
import torch
import triton
import triton.language as tl

from . import cdiv, on_device
from .epilogue import _act_fwd, _act_grad, _tile_origin
from .launch import launch
from .linear_act import _AUTOTUNE, _INTERPRET, _pingpong, _programs, _tma_ok, log, pingpong_enabled


def _fwd_configs(tune=_AUTOTUNE):
    if _INTERPRET:
        return [triton.Config({"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 4}, num_warps=4)]
    # two accumulators a tile: 128 x 128 holds 2 x 64 fp32 registers a thread at 8 warps, and the
    # erf-GELU epilogue with both biases then spills a few bytes (ptxas -v through
    # scripts/triton_compile_check.py); 128 x 64 at 8 warps (173 registers) does not, so it goes
    # first (the only config when autotuning is off). 4-warp configs spilled 4-36 B: dropped.
    # smem per stage (fp16): (BM + 2 BN) BK 2 bytes, 32 KB for 128 x 64 x 64
    cfg = [
        (128, 64, 64, 4, 8),
        (128, 128, 64, 3, 8),
        (128, 128, 64, 4, 8),
        (64, 128, 64, 4, 8),
        (128, 128, 32, 4, 8),
    ]
    cfg = cfg if tune else cfg[:1]
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8}, num_stages=s, num_warps=w)
            for bm, bn, bk, s, w in cfg]


@triton.autotune(configs=_fwd_configs(), key=["M", "H", "K", "ACT", "STORE", "HAS_BG", "HAS_BU"])
@triton.jit
def _gated_fwd_kernel(
    x_ptr, wg_ptr, wu_ptr, bg_ptr, bu_ptr, h_ptr, gu_ptr,
    M, H, K,
    stride_xm, stride_wg, stride_wu,
    ACT: tl.constexpr, HAS_BG: tl.constexpr, HAS_BU: tl.constexpr, STORE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    pid = tl.program_id(0)
    NUM_PROGRAMS = tl.num_programs(0)
    num_m = (M + BLOCK_M - 1) // BLOCK_M
    num_n = (H + BLOCK_N - 1) // BLOCK_N
    num_tiles = num_m * num_n
    for tile in range(pid, num_tiles, NUM_PROGRAMS):
        off_m, off_n = _tile_origin(tile, num_m, num_n, GROUP_M, BLOCK_M, BLOCK_N)
        offs_m = off_m + tl.arange(0, BLOCK_M)
        offs_n = off_n + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        # tail rows/cols clamped, not masked (as linear_act's kernel): they are never stored
        rm = tl.where(offs_m < M, offs_m, 0).to(tl.int64)
        rn = tl.where(offs_n < H, offs_n, 0).to(tl.int64)
        x_tile = x_ptr + rm[:, None] * stride_xm + offs_k[None, :]
        wg_tile = wg_ptr + rn[:, None] * stride_wg + offs_k[None, :]
        wu_tile = wu_ptr + rn[:, None] * stride_wu + offs_k[None, :]
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, (K + BLOCK_K - 1) // BLOCK_K):
            k_mask = offs_k[None, :] < K - k * BLOCK_K
            a = tl.load(x_tile, mask=k_mask, other=0.0)  # once, for both products
            bg = tl.load(wg_tile, mask=k_mask, other=0.0)
            bu = tl.load(wu_tile, mask=k_mask, other=0.0)
            acc_g = tl.dot(a, tl.trans(bg), acc_g)
            acc_u = tl.dot(a, tl.trans(bu), acc_u)
            x_tile += BLOCK_K
            wg_tile += BLOCK_K
            wu_tile += BLOCK_K
        n_mask = offs_n < H
        if HAS_BG:
            acc_g += tl.load(bg_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        if HAS_BU:
            acc_u += tl.load(bu_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        out_ty = h_ptr.dtype.element_ty
        g = acc_g.to(out_ty)  # rounded as the unfused path's GEMM outputs are
        u = acc_u.to(out_ty)
        out_mask = (offs_m[:, None] < M) & n_mask[None, :]
        row = offs_m[:, None].to(tl.int64)
        if STORE:
            gu_off = row * (2 * H) + offs_n[None, :]
            tl.store(gu_ptr + gu_off, g, mask=out_mask)
            tl.store(gu_ptr + gu_off + H, u, mask=out_mask)
        h = _act_fwd(g.to(tl.float32), ACT) * u.to(tl.float32)
        tl.store(h_ptr + row * H + offs_n[None, :], h.to(out_ty), mask=out_mask)


def gated_linear_act_fwd(x, wg, wu, bg, bu, act_id, store):
    """(h, gu) for x (M, K), wg and wu (H, K) with unit column stride, biases (H,) or None, one
    dtype. gu (M, 2H) holds g = x Wg^T + bg and u = x Wu^T + bu side by side when store, else it
    is an empty (0, 0) tensor."""
    M, K = x.shape
    H = wg.shape[0]
    h = torch.empty((M, H), dtype=x.dtype, device=x.device)
    gu = torch.empty((M, 2 * H) if store else (0, 0), dtype=x.dtype, device=x.device)
    if M == 0 or H == 0:
        return h, gu
    if K == 0:  # empty reduction: g and u are the biases (tl.dot needs K >= 16)
        from ..reference import ACTIVATIONS, gated_act
        z = torch.zeros((M, 2 * H), dtype=torch.float32, device=x.device)
        for i, b in enumerate((bg, bu)):
            if b is not None:
                z[:, i * H:(i + 1) * H] += b.float()
        z = z.to(x.dtype)
        h.copy_(gated_act(z[:, :H], z[:, H:], ACTIVATIONS[act_id]))
        if store:
            gu.copy_(z)
        return h, gu
    programs = _programs(x)
    with on_device(x):
        if _pingpong_ok(x, wg, wu, h, gu, store):
            try:
                _pingpong.gated_linear_act_fwd_pingpong(x, wg, wu, bg, bu, act_id, h, gu if store else None, programs)
                return h, gu
            except Exception as e:  # a Triton whose Gluon cannot build it: say so once, keep working
                _PINGPONG_BROKEN[0] = f"{type(e).__name__}: {e}"
                log.warning("ampkernels: Gluon ping-pong gated matmul unavailable (%s); using the pointer kernel",
                            _PINGPONG_BROKEN[0][:300])
        _pointer_fwd(x, wg, wu, bg, bu, act_id, h, gu, store, programs)
    return h, gu


_PINGPONG_BROKEN = [None]  # the error, if the gated ping-pong kernel ever failed to launch


def _pingpong_ok(x, wg, wu, h, gu, store):
    """The warp-specialized Hopper kernel (linear_act_pingpong.py) takes the call: on when linear_act's
    is, every operand TMA-ready (gu's u half starts H elements into each row: 16-byte aligned too)."""
    return (_PINGPONG_BROKEN[0] is None and x.is_cuda and pingpong_enabled(x.device) and _tma_ok(x, wg, wu, h)
            and (not store or (_tma_ok(gu) and wg.shape[0] * gu.element_size() % 16 == 0)))


def _pointer_fwd(x, wg, wu, bg, bu, act_id, h, gu, store, programs):
    M, K = x.shape
    H = wg.shape[0]

    def grid(meta):
        return (min(programs, cdiv(M, meta["BLOCK_M"]) * cdiv(H, meta["BLOCK_N"])),)

    _gated_fwd_kernel[grid](x, wg, wu, x if bg is None else bg, x if bu is None else bu, h, gu if store else h,
                            M, H, K, x.stride(0), wg.stride(0), wu.stride(0), ACT=act_id,
                            HAS_BG=bg is not None, HAS_BU=bu is not None, STORE=store)


@triton.jit
def _gated_bwd_kernel(dh_ptr, gu_ptr, dgu_ptr, part_ptr, M, H, ACT: tl.constexpr, WANT_PARTIAL: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SUB_M: tl.constexpr):
    # BLOCK_M rows a program, SUB_M at a time (few elements a thread, as linear_act's dz pass);
    # partial row pid_m of part (2H wide): column sums of dg, then of du
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_g = tl.zeros((SUB_M, BLOCK_N), tl.float32)
    col_u = tl.zeros((SUB_M, BLOCK_N), tl.float32)
    for r in tl.static_range(0, BLOCK_M, SUB_M):
        offs_m = pid_m * BLOCK_M + r + tl.arange(0, SUB_M)
        mask = (offs_m[:, None] < M) & (offs_n[None, :] < H)
        row = offs_m[:, None].to(tl.int64)
        h_off = row * H + offs_n[None, :]
        g_off = row * (2 * H) + offs_n[None, :]
        dh = tl.load(dh_ptr + h_off, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(gu_ptr + g_off, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(gu_ptr + g_off + H, mask=mask, other=0.0).to(tl.float32)
        out_ty = dgu_ptr.dtype.element_ty
        dg = (dh * u * _act_grad(g, ACT)).to(out_ty)
        du = (dh * _act_fwd(g, ACT)).to(out_ty)
        tl.store(dgu_ptr + g_off, dg, mask=mask)
        tl.store(dgu_ptr + g_off + H, du, mask=mask)
        if WANT_PARTIAL:  # the bias gradients: sums of dg and du as stored
            col_g += tl.where(mask, dg.to(tl.float32), 0.0)
            col_u += tl.where(mask, du.to(tl.float32), 0.0)
    if WANT_PARTIAL:
        n_mask = offs_n < H
        tl.store(part_ptr + pid_m * (2 * H) + offs_n, tl.sum(col_g, axis=0), mask=n_mask)
        tl.store(part_ptr + pid_m * (2 * H) + H + offs_n, tl.sum(col_u, axis=0), mask=n_mask)


def gated_act_backward(dh, gu, dgu, act_id, want_dbias):
    """dgu = [dh * u * act'(g), dh * act(g)] for contiguous dh (M, H), gu and dgu (M, 2H); dgu may
    be gu (in place). Returns the fp32 column sums of dgu (2H,) when want_dbias, else None."""
    M, H = dh.shape
    if M == 0 or H == 0:
        return torch.zeros(2 * H, dtype=torch.float32, device=dh.device) if want_dbias else None
    BLOCK_M, BLOCK_N, SUB_M = (32, 32, 16) if _INTERPRET else (64, 128, 16)
    grid = (cdiv(M, BLOCK_M), cdiv(H, BLOCK_N))
    part = torch.empty((grid[0], 2 * H), dtype=torch.float32, device=dh.device) if want_dbias else dgu
    with on_device(dh):
        launch(_gated_bwd_kernel, grid, dh, gu, dgu, part, M, H, ACT=act_id, WANT_PARTIAL=want_dbias,
               BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, SUB_M=SUB_M, num_warps=4)
    return part.sum(0) if want_dbias else None


@triton.jit
def _gated_act_fwd_kernel(gu_ptr, h_ptr, M, H, ACT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < H)
    row = offs_m[:, None].to(tl.int64)
    g = tl.load(gu_ptr + row * (2 * H) + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * (2 * H) + H + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
    h = _act_fwd(g, ACT) * u  # the forward epilogue's formula on the values it stored: its bits
    tl.store(h_ptr + row * H + offs_n[None, :], h.to(h_ptr.dtype.element_ty), mask=mask)


def gated_act_forward(gu, act_id):
    """h = act(g) * u (M, H) from a contiguous gu = [g | u] (M, 2H), as the forward computed it."""
    M, H = gu.shape[0], gu.shape[1] // 2
    h = torch.empty((M, H), dtype=gu.dtype, device=gu.device)
    if M and H:
        BLOCK_M, BLOCK_N = (32, 32) if _INTERPRET else (16, 256)
        with on_device(gu):
            launch(_gated_act_fwd_kernel, (cdiv(M, BLOCK_M), cdiv(H, BLOCK_N)), gu, h, M, H, ACT=act_id,
                   BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, num_warps=4)
    return h
