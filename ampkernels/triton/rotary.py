"""Triton kernel of rotary_embedding (ampkernels/ops/rotary.py): one tensor's rotate-half
rotation, forward or backward, the contract of csrc/rotary.cu. x (the output's gradient when
backward) is 4-D with a contiguous last dim; cos and sin come broadcast to its shape (stride 0
on the broadcast dims). A program takes BLOCK_R rows (one (dim0, dim1, dim2) index each) and
their head_dim / 2 pairs; fp32 math."""
import torch
import triton
import triton.language as tl

from . import cdiv, on_device
from .launch import launch


@triton.jit
def _rotary_kernel(X, COS, SIN, OUT, rows, size1, size2, sx0, sx1, sx2, sc0, sc1, sc2, ss0, ss1, ss2,
                   so0, so1, so2, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr,
                   BACKWARD: tl.constexpr):
    row = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    i2 = row % size2
    rest = row // size2
    i1 = rest % size1
    i0 = rest // size1
    col = tl.arange(0, BLOCK_H)
    mask = (row < rows)[:, None] & (col < HALF)[None, :]
    xo = (i0 * sx0 + i1 * sx1 + i2 * sx2)[:, None] + col[None, :]
    co = (i0 * sc0 + i1 * sc1 + i2 * sc2)[:, None] + col[None, :]
    so = (i0 * ss0 + i1 * ss1 + i2 * ss2)[:, None] + col[None, :]
    oo = (i0 * so0 + i1 * so1 + i2 * so2)[:, None] + col[None, :]
    x1 = tl.load(X + xo, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(X + xo + HALF, mask=mask, other=0.0).to(tl.float32)
    c1 = tl.load(COS + co, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(COS + co + HALF, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(SIN + so, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(SIN + so + HALF, mask=mask, other=0.0).to(tl.float32)
    if BACKWARD:  # the transposed rotation
        o1 = x1 * c1 + x2 * s2
        o2 = x2 * c2 - x1 * s1
    else:
        o1 = x1 * c1 - x2 * s1
        o2 = x2 * c2 + x1 * s2
    tl.store(OUT + oo, o1.to(OUT.dtype.element_ty), mask=mask)
    tl.store(OUT + oo + HALF, o2.to(OUT.dtype.element_ty), mask=mask)


def rotary(x, cos, sin, unsqueeze_dim, out_dtype, backward):
    if x.dim() != 4 or cos.dim() != 3 or cos.shape != sin.shape or x.shape[-1] % 2 or cos.shape[-1] != x.shape[-1]:
        raise ValueError(f"rotary_triton: x must be 4-D with an even last dim, cos and sin 3-D of one shape with "
                         f"that last dim, got {tuple(x.shape)}, {tuple(cos.shape)} and {tuple(sin.shape)}")
    if cos.dtype != sin.dtype:
        raise ValueError(f"rotary_triton: cos and sin must share a dtype, got {cos.dtype} and {sin.dtype}")
    x = x if x.stride(-1) == 1 else x.contiguous()
    c, s = ((t if t.stride(-1) == 1 else t.contiguous()).unsqueeze(unsqueeze_dim).expand(x.shape) for t in (cos, sin))
    out = torch.empty_like(x, dtype=out_dtype)
    if out.stride(-1) != 1:
        out = x.new_empty(x.shape, dtype=out_dtype)
    half = x.shape[-1] // 2
    rows = x.shape[0] * x.shape[1] * x.shape[2]
    if rows == 0 or half == 0:
        return out
    block_h = 1 << (half - 1).bit_length()
    block_r = max(1, min(64, 4096 // block_h))
    with on_device(x):
        launch(_rotary_kernel, (cdiv(rows, block_r),), x, c, s, out, rows, x.shape[1], x.shape[2],
               *x.stride()[:3], *c.stride()[:3], *s.stride()[:3], *out.stride()[:3],
               HALF=half, BLOCK_H=block_h, BLOCK_R=block_r, BACKWARD=bool(backward), num_warps=4)
    return out
