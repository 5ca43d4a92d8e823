"""Triton row passes of linear_cross_entropy (ampkernels/ops/linear_cross_entropy.py).

The token pass: one program owns one row of a chunk's logits (16-bit, up to ~256k wide) and
walks it in BLOCK-wide steps, twice:
1. per lane a running max and a sum of exp relative to it (online, rescaled when the max
   grows), plus the sum of the logits (label smoothing); reduced across lanes once at the end
   into the row's fp32 log-sum-exp. The row loss: lse - (1-eps) z_t - eps/V sum(z), 0 when the
   target is ignore_index, NaN when it is out of range; the lse stored too when asked.
2. (WRITE_GRAD) scale * (softmax - (1-eps) onehot - eps/V) stored over the logits in place.
Max references that are -inf (a row's lanes untouched so far) are taken as 0, as torch's
logsumexp does, so masked lanes never make 0 * inf.
The vocabulary pass: the same gradient over a block of columns of every row, from the rows'
lse (the token pass's), nothing reduced.
"""
import os

import triton
import triton.language as tl

from . import on_device
from .launch import launch

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _row_scale(scale_ptr, row, SCALE_PER_ROW: tl.constexpr):
    if SCALE_PER_ROW:
        return tl.load(scale_ptr + row)
    return tl.load(scale_ptr)


@triton.jit
def _write_grad(z_row, width, tc, lse, sc, eps, V, SMOOTH: tl.constexpr, BLOCK: tl.constexpr):
    """z_row[:width] <- sc * (exp(z - lse) - (1-eps) [col == tc] - eps/V), in place."""
    lanes = tl.arange(0, BLOCK)
    for off in range(0, width, BLOCK):
        cols = off + lanes
        mask = cols < width
        z = tl.load(z_row + cols, mask=mask, other=0.0).to(tl.float32)
        g = tl.exp(z - lse) - tl.where(cols == tc, 1.0 - eps, 0.0)
        if SMOOTH:
            g -= eps / V
        tl.store(z_row + cols, (g * sc).to(z_row.dtype.element_ty), mask=mask)


@triton.jit
def _write_zeros(z_row, width, BLOCK: tl.constexpr):
    lanes = tl.arange(0, BLOCK)
    for off in range(0, width, BLOCK):
        cols = off + lanes
        tl.store(z_row + cols, tl.zeros([BLOCK], z_row.dtype.element_ty), mask=cols < width)


@triton.jit
def _lce_rows_kernel(z_ptr, ld, t_ptr, loss_ptr, lse_ptr, scale_ptr, V, ignore_index, eps,
                     SCALE_PER_ROW: tl.constexpr, WRITE_GRAD: tl.constexpr, SMOOTH: tl.constexpr,
                     STORE_LSE: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    z_row = z_ptr + row * ld
    t = tl.load(t_ptr + row)
    lanes = tl.arange(0, BLOCK)
    if t != ignore_index:
        in_range = (t >= 0) & (t < V)
        # z_t is read before the row's reductions, whose barriers every warp passes before any
        # warp writes the gradient over the row: read after them, a warp that lagged behind could
        # read the gradient another warp had already stored at z_t (a wrong loss; seen under
        # compute-sanitizer, whose timing let warps drift apart)
        zt = tl.load(z_row + t, mask=in_range, other=float("nan")).to(tl.float32)
        m = tl.full([BLOCK], float("-inf"), tl.float32)
        s = tl.zeros([BLOCK], tl.float32)
        zsum = tl.zeros([BLOCK], tl.float32)
        for off in range(0, V, BLOCK):
            cols = off + lanes
            mask = cols < V
            z = tl.load(z_row + cols, mask=mask, other=float("-inf")).to(tl.float32)
            new = tl.maximum(m, z)
            ref = tl.where(new == float("-inf"), 0.0, new)
            s = s * tl.exp(m - ref) + tl.exp(z - ref)
            m = new
            if SMOOTH:
                zsum += tl.where(mask, z, 0.0)
        mx = tl.max(m, 0)
        ref = tl.where(mx == float("-inf"), 0.0, mx)
        lse = ref + tl.log(tl.sum(s * tl.exp(m - ref), 0))
        loss = lse - (1.0 - eps) * zt
        if SMOOTH:
            loss -= eps / V * tl.sum(zsum, 0)
        tl.store(loss_ptr + row, loss)
        if STORE_LSE:
            tl.store(lse_ptr + row, lse)
        if WRITE_GRAD:
            _write_grad(z_row, V, t, lse, _row_scale(scale_ptr, row, SCALE_PER_ROW), eps, V, SMOOTH, BLOCK)
    else:
        tl.store(loss_ptr + row, 0.0)
        if STORE_LSE:
            tl.store(lse_ptr + row, 0.0)
        if WRITE_GRAD:
            _write_zeros(z_row, V, BLOCK)


@triton.jit
def _lce_grad_kernel(z_ptr, ld, t_ptr, lse_ptr, scale_ptr, width, col0, V, ignore_index, eps,
                     SCALE_PER_ROW: tl.constexpr, SMOOTH: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    z_row = z_ptr + row * ld
    t = tl.load(t_ptr + row)
    if t != ignore_index:
        _write_grad(z_row, width, t - col0, tl.load(lse_ptr + row), _row_scale(scale_ptr, row, SCALE_PER_ROW), eps,
                    V, SMOOTH, BLOCK)
    else:
        _write_zeros(z_row, width, BLOCK)


def block_size(v, smooth):
    """Lanes per step: 16 elements per thread at 8 warps for long rows (16-byte vectors; two
    fp32 accumulators each), 8 with label smoothing (a third accumulator: at 16 ptxas spilled,
    scripts/triton_compile_check.py -v), fewer for short rows."""
    if _INTERPRET:
        return min(256, max(16, triton.next_power_of_2(v)))
    return min(2048 if smooth else 4096, max(128, triton.next_power_of_2(v)))


def rows_pass(z, target, loss, scale, ignore_index, eps, write_grad, lse=None):
    """See ops/linear_cross_entropy.rows_pass: z (n, V) fp16/bf16 with contiguous rows (row stride
    >= V: padded rows keep the chunk's GEMMs on aligned kernels), target (n,) int64, loss (n,)
    fp32, scale fp32 (1,) or (n,), lse None or (n,) fp32 (written)."""
    n, v = z.shape
    if n == 0:
        return
    assert (z.stride(1) == 1 or v <= 1) and z.stride(0) >= v and target.is_contiguous() and loss.is_contiguous()
    BLOCK = block_size(v, eps != 0.0)
    with on_device(z):
        launch(_lce_rows_kernel, (n,), z, z.stride(0), target, loss, loss if lse is None else lse, scale, v,
               ignore_index, float(eps), SCALE_PER_ROW=scale.numel() > 1, WRITE_GRAD=write_grad,
               SMOOTH=eps != 0.0, STORE_LSE=lse is not None, BLOCK=BLOCK, num_warps=8 if BLOCK >= 2048 else 4)


def grad_pass(z, target, lse, scale, col0, vocab, ignore_index, eps):
    """See ops/linear_cross_entropy.grad_pass: z (n, width) holds columns col0.. of a vocabulary
    of `vocab`; lse (n,) fp32 from the token pass."""
    n, width = z.shape
    if n == 0 or width == 0:
        return
    assert (z.stride(1) == 1 or width <= 1) and z.stride(0) >= width and target.is_contiguous()
    BLOCK = block_size(width, False)
    with on_device(z):
        launch(_lce_grad_kernel, (n,), z, z.stride(0), target, lse, scale, width, col0, vocab, ignore_index,
               float(eps), SCALE_PER_ROW=scale.numel() > 1, SMOOTH=eps != 0.0, BLOCK=BLOCK,
               num_warps=8 if BLOCK >= 2048 else 4)
