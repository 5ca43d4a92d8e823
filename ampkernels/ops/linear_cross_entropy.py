"""linear_cross_entropy: cross_entropy(x @ weight.T + bias, target) without the full logits.

    == F.cross_entropy(F.linear(x, weight, bias).float(), target, ignore_index=...,
                       label_smoothing=..., reduction=...)

The tokens run in chunks of rows; only one chunk's logits (rows x vocab, compute dtype) exist
at a time. Per chunk: logits = x_c W^T (+ b) on cuBLAS, then ONE pass per row (the backend's
kernel): the fp32 log-sum-exp over the 16-bit logits (online max/sum over blocks of the row),
the row's loss (label smoothing, ignore_index), and -- when gradients are wanted -- the
gradient softmax - (1-eps)*onehot - eps/V written in place over the logits; then
dx_c = dlogits @ W and db += column sums (fp32).

The weight gradient, by the weight's dtype:
- fp32 (master weights under autocast): dW += dlogits^T @ x_c per chunk, accumulated by cuBLAS
  into the fp32 gradient itself (3 GEMMs in all; the accumulator is the gradient, no extra).
- 16-bit: an fp32 accumulator would be a weight-sized buffer the 16-bit gradient does not need
  (154 MiB at GPT-2's head, 2 GiB at Llama-3's), and accumulating in 16 bits chunk after chunk
  rounds once per chunk. Instead the token pass stores each row's lse, and the vocabulary pass
  recomputes the logits a block of vocabulary columns at a time for all tokens,
  dlogits_v = softmax_v - onehot_v from the stored lse, and writes dW_v = dlogits_v^T @ x in one
  GEMM (fp32 accumulation, one rounding, as eager's): 4 GEMMs, extra memory one column block.
  An odd vocabulary's last rows run through a small zero-padded copy, not a padded copy of W.

Training with reduction "mean"/"sum": the gradients are computed in the forward (the vocabulary
pass in backward, where grad_output is known) in "sum" units -- not divided by the number of
valid tokens, so that fp16 gradients of 1/n-scaled probabilities do not underflow -- and
backward scales them by grad_output (GradScaler's scale) / n_valid in place. reduction="none"
(a gradient per token) computes the loss alone in the forward and recomputes the logits in
backward, with the per-token scale applied inside the row pass. Inference computes the loss
alone.

"auto" on CUDA runs the composite F.cross_entropy(F.linear(...).float(), ...) itself up to 2^22
logits, where it costs less host time and holds little (`_COMPOSITE_MAX_LOGITS`).

Backends for the row pass: "cuda" (csrc/linear_cross_entropy.cu), "triton"
(ampkernels/triton/linear_cross_entropy.py), "torch" (the same chunked algorithm in torch ops:
the CPU path, fp32/fp64 inputs, the reference for dispatch). The GEMMs are torch's (cuBLAS) on
every backend.

One op, eager and compiled: the custom op `ampkernels::linear_cross_entropy_fwd` with its fake
and its autograd registered on it (torch.library `register_autograd`); reduction "none"'s
backward is the custom op `ampkernels::linear_cross_entropy_bwd`, the vocabulary pass
`ampkernels::linear_cross_entropy_wgrad`. Under torch.compile the op
stays opaque: inductor would otherwise build the whole logits tensor. A custom op costs the
host ~10 us a call more than an autograd Function; this one runs once a step.

Pieces, in the order data meets them: chunked implementation -> custom ops (forward, backward)
with fakes -> autograd -> "auto" -> functional API.
"""
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import backends
from .shared import autocast_dtypes, guard_or_false, torch_path_params

_KERNEL_DTYPES = (torch.float16, torch.bfloat16)
REDUCTIONS = ("mean", "sum", "none")

# A chunk's logits hold max(tokens * hidden, _CHUNK_MIN_ELEMS) elements at most (x's own size,
# or 64 MiB in bf16 when x is smaller): bounded whatever tokens x vocab is, and wide enough
# that the weight-gradient GEMM (K = chunk rows) is not dominated by re-reading its fp32
# accumulator (vocab x hidden x 4 bytes read and written once per chunk). 64 MiB and the
# compute-dtype copy of fp32 master weights keep GPT-2's head (8192 x 768 x 50257) under
# Liger-Kernel's 160 MiB. Under torch.compile the bar is inductor's unfused head (the whole
# logits, 1.5 GiB there) and its time: 4x the floor re-reads the accumulator a third as often
# (4 chunks instead of 13 at GPT-2's head). With the fp32 accumulator (fp32 weights) a chunk also
# holds at least vocab * hidden / 2 logits (hidden / 2 rows), half the compute-dtype copy of the
# weight the call makes anyway: each chunk's dW GEMM then runs K >= hidden / 2 and its
# accumulator traffic (8 bytes an element of dW) stays below the GEMM's own time. At Llama-3's
# head (8192 x 4096 x 128256, 2 GiB fp32 dW) 256-row chunks re-read it 32 times, 97.5 ms
# against eager's 52.7 on the H100; 2048-row chunks read it 4 times.
_CHUNK_MIN_ELEMS = 1 << 25
_COMPILED_CHUNK_SCALE = 4
_ROW_ALIGN = 64


def current_chunk_floor():
    """The least elements a chunk's logits may hold, for a call traced now (eager or compiled)."""
    return _CHUNK_MIN_ELEMS * (_COMPILED_CHUNK_SCALE if torch.compiler.is_compiling() else 1)


def chunk_rows(m, k, v, floor, accumulate=False):
    """Rows of one chunk, whose logits hold at most max(m * k, floor) elements (and at least
    v * k / 2 when `accumulate`, the fp32 weight-gradient accumulator): as even as the chunk count
    allows, a multiple of 64 (alignment of the GEMMs' row offsets) where the chunk holds more than
    64 rows, rounded up where that stays within the budget (one chunk fewer), else down."""
    if m == 0:
        return 1
    budget = max(m * k, floor, v * k // 2 if accumulate else 0)
    cap = max(1, budget // max(v, 1))
    if cap >= m:
        return m
    n_chunks = -(-m // cap)
    rows = -(-m // n_chunks)
    if rows > _ROW_ALIGN:
        up = -(-rows // _ROW_ALIGN) * _ROW_ALIGN
        rows = up if up <= cap else rows // _ROW_ALIGN * _ROW_ALIGN
    return max(1, rows)


def _acc_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


# ---------------------------------------------------------------- the row pass

def _rows_torch(z, target, loss, scale, ignore_index, eps, write_grad, lse_out=None, lse_in=None, col0=0,
                vocab=None):
    """The row passes in torch ops, a block of rows at a time (fp32 temporaries bounded). With
    lse_in: the vocabulary pass (z: columns col0.. of a vocabulary of `vocab`; no loss)."""
    from ..reference import row_blocks
    ct = _acc_dtype(z.dtype)
    w = z.shape[1]
    v = w if vocab is None else vocab
    for s, e in row_blocks(z):
        zb = z[s:e].to(ct)
        t = target[s:e]
        valid = t != ignore_index
        tc = t - col0
        hit = valid & (tc >= 0) & (tc < w)
        if lse_in is None:
            tc = torch.where(hit, tc, 0)
            lse = torch.logsumexp(zb, -1)
            zt = zb.gather(1, tc[:, None]).squeeze(1)
            zt = torch.where(hit, zt, float("nan"))  # a target out of range: a NaN loss
            row = lse - (1.0 - eps) * zt
            if eps:
                row = row - (eps / v) * zb.sum(-1)
            loss[s:e] = torch.where(valid, row, 0.0)
            if lse_out is not None:
                lse_out[s:e] = torch.where(valid, lse, 0.0)
        else:
            lse = lse_in[s:e].to(ct)
        if write_grad:
            g = torch.exp(zb - lse[:, None])
            if eps:
                g -= eps / v
            g.scatter_add_(1, torch.where(hit, tc, 0)[:, None], hit.to(ct)[:, None] * -(1.0 - eps))
            sc = scale[s:e] if scale.numel() > 1 else scale
            g *= sc.to(ct).reshape(-1, 1)
            g.masked_fill_(~valid[:, None], 0.0)  # ignored rows: 0 whatever the scale (as torch)
            z[s:e].copy_(g)


def rows_pass(z, target, loss, scale, ignore_index, eps, write_grad, backend, lse=None):
    """The token pass over each row of the logits chunk z (n, V): loss[i] = the row's
    cross-entropy (0 for an ignored row), lse[i] its log-sum-exp when lse is given, and, if
    write_grad, z[i] = scale * d loss[i] / d z[i] in place. scale: fp32, (1,) or (n,)."""
    if z.shape[0] == 0:
        return
    if backend == "cuda":
        torch.ops.ampkernels.linear_cross_entropy_rows_cuda_(z, target, loss, scale, ignore_index, eps, write_grad, lse)
    elif backend == "triton":
        from ..triton import linear_cross_entropy as tk
        tk.rows_pass(z, target, loss, scale, ignore_index, eps, write_grad, lse)
    else:
        _rows_torch(z, target, loss, scale, ignore_index, eps, write_grad, lse_out=lse)


def grad_pass(z, target, lse, scale, col0, vocab, ignore_index, eps, backend):
    """The vocabulary pass: z (n, width) holds the logits of columns [col0, col0 + width) of
    every row (vocabulary `vocab`); overwritten in place by scale * their gradient, from the
    rows' lse (the token pass's). Ignored rows: 0."""
    if z.shape[0] == 0 or z.shape[1] == 0:
        return
    if backend == "cuda":
        torch.ops.ampkernels.linear_cross_entropy_grad_cuda_(z, target, lse, scale, col0, vocab, ignore_index, eps)
    elif backend == "triton":
        from ..triton import linear_cross_entropy as tk
        tk.grad_pass(z, target, lse, scale, col0, vocab, ignore_index, eps)
    else:
        _rows_torch(z, target, None, scale, ignore_index, eps, True, lse_in=lse, col0=col0, vocab=vocab)


# ---------------------------------------------------------------- GEMM pieces

_ADDMM_FP32_ACCUM = [hasattr(torch.ops.aten.addmm, "dtype_out")]  # turned off if this torch refuses it


def _accumulate_wgrad(dw, dz, xc):
    """dw (+)= dz^T @ xc with an fp32 (fp64 for fp64) accumulator: straight from cuBLAS for
    16-bit dz on CUDA (addmm with out_dtype, beta=1, into dw), else by an upcast GEMM."""
    ct = _acc_dtype(dz.dtype)
    if dz.dtype in _KERNEL_DTYPES and dz.is_cuda:
        if dw is None:
            return torch.mm(dz.t(), xc, out_dtype=torch.float32)
        if _ADDMM_FP32_ACCUM[0]:
            try:
                return torch.addmm(dw, dz.t(), xc, out_dtype=torch.float32, out=dw)
            except RuntimeError:  # a torch whose addmm.dtype_out wants self in the inputs' dtype
                _ADDMM_FP32_ACCUM[0] = False
        return dw.add_(torch.mm(dz.t(), xc, out_dtype=torch.float32))
    a, b = (dz, xc) if dz.dtype == ct else (dz.to(ct), xc.to(ct))
    return a.t().mm(b) if dw is None else dw.addmm_(a.t(), b)


_VOCAB_ALIGN = 64  # elements: rows of 128 bytes (16-bit)


def padded_vocab(v, x):
    """The vocabulary size the chunk GEMMs run at: on CUDA v rounded up to a multiple of 64.
    With an odd vocabulary (GPT-2's 50257) cuBLAS has no sm90 kernel for an N or K of that size
    and ran the three GEMMs on sm75 CUTLASS kernels, 5-7x slower (on the H200 at 2048 x 768 x
    50257 the logits GEMM took 1.92 ms, at 50304 0.27 ms); inductor pads the same way."""
    return -(-v // _VOCAB_ALIGN) * _VOCAB_ALIGN if x.is_cuda else v


def _padded_param(t, n, dtype):
    """t in `dtype` with its first dimension zero-padded to n, in one new tensor (t itself
    when it already is both): fp32 master weights are cast and padded in one copy."""
    if t is None or (t.shape[0] == n and t.dtype == dtype):
        return t
    out = t.new_empty((n,) + tuple(t.shape[1:]), dtype=dtype)
    out[:t.shape[0]].copy_(t)
    out[t.shape[0]:].zero_()  # only the padding: the copy writes the rest
    return out


def _weight_parts(weight, bias, dtype, vp):
    """The weight (and bias) in `dtype` as [(c0, c1, w, b)]: row blocks whose logits fill columns
    c0..c1 of a vp-wide chunk, zero rows past the vocabulary. fp32 (master) weights, whose
    gradient is accumulated over one padded weight: one copy, cast and padded at once. 16-bit
    weights: the aligned rows as they are and, for an odd vocabulary, its last rows in a small
    padded copy (not a padded copy of the whole weight)."""
    v = weight.shape[0]
    if not wgrad_by_vocab(weight) or weight.dtype != dtype or vp == v:
        return [(0, vp, _padded_param(weight, vp, dtype), _padded_param(bias, vp, dtype))]
    va = v // _VOCAB_ALIGN * _VOCAB_ALIGN
    parts = [(0, va, weight[:va], None if bias is None else _padded_param(bias[:va], va, dtype))] if va else []
    tail_b = None if bias is None else _padded_param(bias[va:], vp - va, dtype)
    return parts + [(va, vp, _padded_param(weight[va:], vp - va, dtype), tail_b)]


def _logits(xc, weight, bias, out):
    if bias is None:
        return torch.mm(xc, weight.t(), out=out)
    return torch.addmm(bias, xc, weight.t(), out=out)


def _n_valid(target, ignore_index, dtype):
    return (target != ignore_index).sum().to(dtype)


def _reduce(losses, target, ignore_index, reduction):
    if reduction == "none":
        return losses
    total = losses.sum()
    return total if reduction == "sum" else total / _n_valid(target, ignore_index, total.dtype)


def _empty(x):
    return x.new_empty(0)


def wgrad_by_vocab(weight):
    """Whether the weight gradient comes from the vocabulary pass (16-bit weights) rather than
    an fp32 accumulator over the token chunks (fp32/fp64 weights: the accumulator is the
    gradient)."""
    return weight.dtype in _KERNEL_DTYPES


def _chunk_loop(x, weight, bias, target, losses, scale, ignore_index, eps, need, floor, backend, lse=None):
    """The token pass both custom ops make, chunk by chunk: the logits GEMM, the row pass (the
    row losses into `losses`, which holds all M rows or one chunk's scratch, each row's lse into
    `lse` when given, and the gradient scaled by `scale`, (1,) or (M,), in place when any
    gradient is needed), then dx, dw (fp32 accumulation; fp32 weights only) and db. weight and
    bias in x's dtype or fp32 (master weights under autocast: cast here). Returns (dx, dw, db),
    empty (0,) tensors where not needed."""
    need_dx, need_dw, need_db = need
    m, k = x.shape
    v = weight.shape[0]
    acc = _acc_dtype(x.dtype)
    dx = torch.empty_like(x) if need_dx else _empty(x)
    dw = None
    db = torch.zeros(v, dtype=acc, device=x.device) if need_db else _empty(x)
    rows = chunk_rows(m, k, v, floor, need_dw)
    # the GEMMs run over vp >= v logit columns against zero weight (and bias) rows: the padding
    # columns of the logits are 0, never touched by the row pass, so they add nothing to dx and
    # only to dw's padding rows, which are cut off
    vp = padded_vocab(v, x)
    parts = _weight_parts(weight, bias, x.dtype, vp)
    assert not need_dw or len(parts) == 1, "the fp32 accumulator runs over one padded weight"
    buf = x.new_empty(min(rows, m), vp)
    # every chunk's views made at once (a Python slice per tensor per chunk cost the host more
    # than the launches at GPT-2's 13 chunks); a part spanning the whole chunk is not sliced
    n_chunks = -(-m // rows)  # none for no tokens
    per_row = [x, target, losses if losses.numel() == m else None, scale if scale.numel() > 1 else None,
               dx if need_dx else None, lse]
    chunks = [(None,) * n_chunks if t is None else t.split(rows) for t in per_row]
    parts = [(c0, c1, w, b, c0 == 0 and c1 == vp) for c0, c1, w, b in parts]
    grad = any(need)
    for xc, tc, lc, sc, dxc, lsec in zip(*chunks) if n_chunks else ():
        zp = buf if xc.shape[0] == buf.shape[0] else buf[:xc.shape[0]]
        for c0, c1, w, b, whole in parts:
            _logits(xc, w, b, zp if whole else zp[:, c0:c1])
        z = zp if vp == v else zp[:, :v]
        rows_pass(z, tc, losses[:xc.shape[0]] if lc is None else lc, scale if sc is None else sc, ignore_index, eps,
                  grad, backend, lsec)
        if need_dx:
            for j, (c0, c1, w, _, whole) in enumerate(parts):
                zc = zp if whole else zp[:, c0:c1]
                if j == 0:
                    torch.mm(zc, w, out=dxc)
                else:
                    dxc.addmm_(zc, w)
        if need_dw:
            dw = _accumulate_wgrad(dw, zp, xc)
        if need_db:
            db += z.sum(0, dtype=acc)
    if need_dw and dw is None:  # no tokens
        dw = torch.zeros(v, k, dtype=acc, device=x.device)
    return dx, dw[:v] if need_dw else _empty(x), db


# A block of the vocabulary pass holds max(tokens * hidden / 2, floor / 32) logits: half of x's
# size (at GPT-2's head 8192 x 384, 6 MiB; Liger-Kernel holds 12 MiB beyond its gradients there),
# at least 1 Mi elements (4 Mi under torch.compile) so that a few tokens take few blocks.
_VOCAB_BLOCK_DIVISOR = 32


def vocab_block_cols(m, k, v, floor):
    """Columns of one block of the vocabulary pass: a multiple of 64, or the whole vocabulary."""
    if m == 0:
        return v
    cols = max(m * k // 2, floor // _VOCAB_BLOCK_DIVISOR) // m
    return v if cols >= v else max(_VOCAB_ALIGN, cols // _VOCAB_ALIGN * _VOCAB_ALIGN)


def _vocab_wgrad(x, weight, bias, target, lse, scale, ignore_index, eps, floor, backend):
    """The weight gradient in the weight's (16-bit) dtype, a block of vocabulary rows at a time:
    the block's logits for all tokens, their gradient from the rows' lse (scaled by `scale`, (1,)
    or (M,)), dW_block = dlogits^T @ x in one GEMM."""
    m, k = x.shape
    v = weight.shape[0]
    dw = torch.empty_like(weight)
    if m == 0:
        return dw.zero_()
    cols = vocab_block_cols(m, k, v, floor)
    buf = x.new_empty(m, padded_vocab(cols, x))
    for c0 in range(0, v, cols):
        c1 = min(c0 + cols, v)
        width = c1 - c0
        wp = padded_vocab(width, x)  # the last block of an odd vocabulary: a small padded copy
        w = _padded_param(weight[c0:c1], wp, x.dtype)
        b = None if bias is None else _padded_param(bias[c0:c1], wp, x.dtype)
        z = _logits(x, w, b, buf[:, :wp])[:, :width]
        grad_pass(z, target, lse, scale, c0, v, ignore_index, eps, backend)
        torch.mm(z.t(), x, out=dw[c0:c1])
    return dw


# ---------------------------------------------------------------- forward custom op

def fwd_impl(x, weight, bias, target, ignore_index, label_smoothing, reduction, need_dx, need_dw, need_db,
             chunk_floor, backend):
    """(loss, dx, dw, db, lse). The gradients (each an empty (0,) tensor unless asked for, and for
    reduction "none", whose backward recomputes them) are those of the SUM of the per-token
    losses: dx in x's dtype, dw and db in fp32 (fp64 for fp64 x). With 16-bit weights dw is left
    to the vocabulary pass in backward and lse (M,) fp32 is returned for it (else empty)."""
    if reduction == "none":
        need_dx = need_dw = need_db = False
    by_vocab = need_dw and wgrad_by_vocab(weight)
    with torch.autocast(x.device.type, enabled=False):  # out= GEMMs; x already in the compute dtype
        acc = _acc_dtype(x.dtype)
        losses = torch.empty(x.shape[0], dtype=acc, device=x.device)
        lse = torch.empty(x.shape[0], dtype=torch.float32, device=x.device) if by_vocab else _empty(x)
        dx, dw, db = _chunk_loop(x, weight, bias, target, losses, torch.ones(1, dtype=torch.float32, device=x.device),
                                 ignore_index, label_smoothing, (need_dx, need_dw and not by_vocab, need_db),
                                 chunk_floor, backend, lse if by_vocab else None)
        return _reduce(losses, target, ignore_index, reduction), dx, dw, db, lse


@torch.library.custom_op("ampkernels::linear_cross_entropy_fwd", mutates_args=())
def linear_cross_entropy_fwd(x: Tensor, weight: Tensor, bias: Optional[Tensor], target: Tensor, ignore_index: int,
                             label_smoothing: float, reduction: str, need_dx: bool, need_dw: bool, need_db: bool,
                             chunk_floor: int, backend: str) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(loss, dx, dweight, dbias, lse) for 2-D contiguous x (M, K), weight (V, K) in x's dtype or
    fp32 (cast inside), target (M,); the gradients are of the summed per-token losses (empty (0,)
    tensors when not needed, and for reduction "none": need_* then say what its backward
    computes); dweight and dbias in fp32 (fp64 for fp64 x); dweight of 16-bit weights is left
    to backward's vocabulary pass, which reads lse (M,) fp32. loss: fp32 (fp64), () or (M,)
    for reduction "none". chunk_floor: see chunk_rows."""
    return fwd_impl(x, weight, bias, target, ignore_index, label_smoothing, reduction, need_dx, need_dw, need_db,
                    chunk_floor, backend)


@linear_cross_entropy_fwd.register_fake
def _(x, weight, bias, target, ignore_index, label_smoothing, reduction, need_dx, need_dw, need_db, chunk_floor,
      backend):
    acc = _acc_dtype(x.dtype)
    m, k, v = x.shape[0], x.shape[1], weight.shape[0]
    loss = x.new_empty((m,) if reduction == "none" else (), dtype=acc)
    if reduction == "none":
        need_dx = need_dw = need_db = False
    by_vocab = need_dw and wgrad_by_vocab(weight)
    return (loss, x.new_empty((m, k)) if need_dx else x.new_empty(0),
            x.new_empty((v, k), dtype=acc) if need_dw and not by_vocab else x.new_empty(0),
            x.new_empty((v,), dtype=acc) if need_db else x.new_empty(0),
            x.new_empty((m,), dtype=torch.float32) if by_vocab else x.new_empty(0))


# ---------------------------------------------------------------- the vocabulary pass custom op

@torch.library.custom_op("ampkernels::linear_cross_entropy_wgrad", mutates_args=())
def linear_cross_entropy_wgrad(x: Tensor, weight: Tensor, bias: Optional[Tensor], target: Tensor, lse: Tensor,
                               scale: Tensor, ignore_index: int, label_smoothing: float, chunk_floor: int,
                               backend: str) -> Tensor:
    """d(sum of scale * per-token losses)/d weight in weight's (16-bit) dtype, the logits
    recomputed a block of vocabulary rows at a time from the rows' lse (M,) fp32; scale fp32
    (1,) or (M,)."""
    with torch.autocast(x.device.type, enabled=False):
        return _vocab_wgrad(x, weight, bias, target, lse, scale, ignore_index, label_smoothing, chunk_floor, backend)


@linear_cross_entropy_wgrad.register_fake
def _(x, weight, bias, target, lse, scale, ignore_index, label_smoothing, chunk_floor, backend):
    return torch.empty_like(weight)


# ---------------------------------------------------------------- backward custom op (recompute)

def _scale(dloss, target, ignore_index, reduction, dtype):
    """The factor each token's gradient (of the summed losses) is multiplied by: (M,) for
    "none", else (1,): grad_output, / n_valid for "mean" (all tokens ignored: the gradients are
    zeros, as torch's, not 0 * inf)."""
    if reduction == "none":
        return dloss.to(dtype).reshape(-1).contiguous()
    scale = dloss.detach().to(dtype).reshape(1)
    if reduction == "mean":
        scale = scale / _n_valid(target, ignore_index, dtype).clamp_min(1)
    return scale


def bwd_impl(dloss, x, weight, bias, target, ignore_index, label_smoothing, reduction, need_dx, need_dw, need_db,
             chunk_floor, backend):
    """(dx, dw, db) with the logits recomputed chunk by chunk; dloss: () for mean/sum, (M,) for
    "none". dw in fp32 (fp64 for fp64 x; the weight's dtype for 16-bit weights), db in fp32
    (fp64), dx in x's dtype."""
    with torch.autocast(x.device.type, enabled=False):
        m, k = x.shape
        v = weight.shape[0]
        acc = _acc_dtype(x.dtype)
        scale = _scale(dloss, target, ignore_index, reduction, torch.float64 if acc == torch.float64 else torch.float32)
        by_vocab = need_dw and wgrad_by_vocab(weight)
        lse = torch.empty(m, dtype=torch.float32, device=x.device) if by_vocab else None
        accumulate = need_dw and not by_vocab
        losses = torch.empty(min(chunk_rows(m, k, v, chunk_floor, accumulate), m), dtype=acc,
                             device=x.device)  # written, unused
        dx, dw, db = _chunk_loop(x, weight, bias, target, losses, scale, ignore_index, label_smoothing,
                                 (need_dx, accumulate, need_db), chunk_floor, backend, lse)
        if by_vocab:
            dw = _vocab_wgrad(x, weight, bias, target, lse, scale, ignore_index, label_smoothing, chunk_floor,
                              backend)
        return dx, dw, db


@torch.library.custom_op("ampkernels::linear_cross_entropy_bwd", mutates_args=())
def linear_cross_entropy_bwd(dloss: Tensor, x: Tensor, weight: Tensor, bias: Optional[Tensor], target: Tensor,
                             ignore_index: int, label_smoothing: float, reduction: str, need_dx: bool, need_dw: bool,
                             need_db: bool, chunk_floor: int, backend: str) -> tuple[Tensor, Tensor, Tensor]:
    """(dx, dweight, dbias) of reduction(losses) scaled by dloss, the logits recomputed;
    dweight in fp32 (fp64 for fp64 x; weight's dtype for 16-bit weights), dbias in fp32 (fp64);
    empty (0,) tensors when not needed."""
    return bwd_impl(dloss, x, weight, bias, target, ignore_index, label_smoothing, reduction, need_dx, need_dw,
                    need_db, chunk_floor, backend)


@linear_cross_entropy_bwd.register_fake
def _(dloss, x, weight, bias, target, ignore_index, label_smoothing, reduction, need_dx, need_dw, need_db, chunk_floor,
      backend):
    acc = _acc_dtype(x.dtype)
    m, k, v = x.shape[0], x.shape[1], weight.shape[0]
    return (x.new_empty((m, k)) if need_dx else x.new_empty(0),
            (torch.empty_like(weight) if wgrad_by_vocab(weight) else x.new_empty((v, k), dtype=acc)) if need_dw
            else x.new_empty(0),
            x.new_empty((v,), dtype=acc) if need_db else x.new_empty(0))


# ---------------------------------------------------------------- autograd

def _setup_context(ctx, inputs, output):
    """mean/sum: the forward computed the gradients too; they are saved (x-sized dx, fp32
    weight-sized dW, fp32 db) and backward scales them in place by grad_output (/ n_valid);
    with 16-bit weights x, the weight, the bias and each row's lse are saved for the vocabulary
    pass instead of dW. "none": saves x, weight, bias, target and recomputes."""
    x, weight, bias, target, ignore_index, label_smoothing, reduction, need_dx, need_dw, need_db, floor, backend = inputs
    _, dx, dw, db, lse = output
    ctx.mark_non_differentiable(dx, dw, db, lse)
    ctx.set_materialize_grads(False)  # no zero gradients for dx, dw, db (an fp32 weight-sized buffer)
    ctx.args = (ignore_index, label_smoothing, reduction, floor, backend)
    ctx.dtypes = (weight.dtype, None if bias is None else bias.dtype)
    ctx.need = (need_dx, need_dw, need_db)
    ctx.by_vocab = need_dw and reduction != "none" and wgrad_by_vocab(weight)
    if reduction == "none":
        ctx.save_for_backward(x, weight, bias, target)
    elif ctx.by_vocab:
        ctx.save_for_backward(target, dx, lse, db, x, weight, bias)
    else:
        ctx.save_for_backward(target, dx, dw, db)


def _backward(ctx, dloss, _ddx, _ddw, _ddb, _dlse):
    ignore_index, label_smoothing, reduction, floor, backend = ctx.args
    need_dx, need_dw, need_db = ctx.need
    wdt, bdt = ctx.dtypes
    if reduction == "none":
        x, weight, bias, target = ctx.saved_tensors
        dx, dw, db = torch.ops.ampkernels.linear_cross_entropy_bwd(
            dloss.contiguous(), x, weight, bias, target, ignore_index, label_smoothing, reduction, need_dx, need_dw,
            need_db, floor, backend)
    else:
        # in place on the saved gradients: no second weight-sized buffer while the model's
        # activations peak. A second backward through this node (retain_graph) gets torch's
        # "modified by an inplace operation" error from the version check.
        if ctx.by_vocab:
            target, dx, lse, db, x, weight, bias = ctx.saved_tensors
        else:
            target, dx, dw, db = ctx.saved_tensors
        factor = _scale(dloss, target, ignore_index, reduction,
                        torch.float64 if dx.dtype == torch.float64 else torch.float32)
        if ctx.by_vocab:
            dw = torch.ops.ampkernels.linear_cross_entropy_wgrad(x, weight, bias, target, lse, factor, ignore_index,
                                                                 label_smoothing, floor, backend)
        if need_dx:
            dx.mul_(factor)
        if need_dw and not ctx.by_vocab:  # the fp32 accumulator is the (fp32) gradient
            dw.mul_(factor)
        if need_db:
            db = db.mul_(factor) if bdt == db.dtype else torch.mul(db, factor, out=torch.empty_like(db, dtype=bdt))
    return (dx if need_dx else None, dw.to(wdt) if need_dw else None, db.to(bdt) if need_db else None,
            None, None, None, None, None, None, None, None, None)


linear_cross_entropy_fwd.register_autograd(_backward, setup_context=_setup_context)


# ---------------------------------------------------------------- "auto"

def preference(device, dtype):
    """Backends "auto" tries, fastest first, above the composite's size (below). Also under
    torch.compile: the op is opaque there either way (inductor would build the full logits), so
    the kernels are the better choice. The GEMMs dominate; the row pass has not been timed cuda
    vs triton yet (cuda first: less host time per launch)."""
    return ("cuda", "triton")


# "auto" on CUDA below this many logits (tokens x vocab) runs the definition itself,
# F.cross_entropy(F.linear(x, weight, bias).float(), ...): there the chunked op's launches (~20
# in its forward, its GEMMs and the target check) cost the host more than the whole composite
# costs the GPU (the host bench: 8 x 256 -> vocab 1024, forward 705 us against torch's 91 on an
# H200's host), and the logits the op saves are small: 2^22 of them, fp32 and their fp32 log-
# probabilities, are 32 MiB.
_COMPOSITE_MAX_LOGITS = 1 << 22


@backends.assume_constant_result
def _auto_requested(backend):
    return backends.requested(backend)[0] == "auto"  # a host-side decision, as _choose


def _runs_composite(backend, x, m, v):
    # guard_or_false: a row count known only at run time (masked-LM rows under torch.compile)
    # takes the op, which any size suits
    return x.is_cuda and guard_or_false(m * v <= _COMPOSITE_MAX_LOGITS) and _auto_requested(backend)


def _composite(x, weight, bias, target, cast_to, ignore_index, label_smoothing, reduction):
    """F.cross_entropy(F.linear(x, weight, bias).float(), target, ...) over 2-D x and 1-D target,
    with torch's autograd (its own device assert for a bad target). fp64 stays fp64."""
    weight, bias = torch_path_params((weight, bias), cast_to)
    logits = F.linear(x, weight, bias)
    logits = logits if logits.dtype == torch.float64 else logits.float()
    return F.cross_entropy(logits, target, ignore_index=ignore_index, label_smoothing=label_smoothing,
                           reduction=reduction)


@backends.assume_constant_result
def _choose(backend, device, dtype, unsupported):
    return backends.select("linear_cross_entropy", backend, device, preference(device, dtype), unsupported)


# ---------------------------------------------------------------- functional API

def _check_args(x, weight, target, bias, ignore_index, label_smoothing, reduction):
    op = "linear_cross_entropy"
    for name, t in (("x", x), ("weight", weight), ("target", target), ("bias", bias)):
        if t is not None and not isinstance(t, Tensor):
            raise TypeError(f"{op}: {name} must be a Tensor, got {type(t).__name__}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"{op}: reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if not isinstance(ignore_index, int) or isinstance(ignore_index, bool):
        raise TypeError(f"{op}: ignore_index must be an int, got {ignore_index!r}")
    if not isinstance(label_smoothing, (int, float)) or not 0.0 <= float(label_smoothing) <= 1.0:
        raise ValueError(f"{op}: label_smoothing must be a float in [0, 1], got {label_smoothing!r}")
    if weight.dim() != 2:
        raise ValueError(f"{op}: weight must be 2-D (vocab, hidden), got shape {tuple(weight.shape)}")
    if x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"{op}: x's last dim must equal weight's hidden = {weight.shape[1]} "
                         f"(weight shape {tuple(weight.shape)}), got x shape {tuple(x.shape)}")
    if weight.shape[0] == 0:
        raise ValueError(f"{op}: weight must have at least one row (class), got shape {tuple(weight.shape)}")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != weight.shape[0]):
        raise ValueError(f"{op}: bias must have shape ({weight.shape[0]},), got {tuple(bias.shape)}")
    for name, t in (("x", x), ("weight", weight), ("bias", bias)):
        if t is not None and not t.is_floating_point():
            raise TypeError(f"{op}: {name} must be a floating-point tensor, got {t.dtype}")
    if target.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"{op}: target must be an int64 tensor of class indices, got {target.dtype}")
    if tuple(target.shape) != tuple(x.shape[:-1]):
        raise ValueError(f"{op}: target must have x's leading shape {tuple(x.shape[:-1])}, "
                         f"got {tuple(target.shape)}")
    dev = x.device
    for name, t in (("weight", weight), ("target", target), ("bias", bias)):
        if t is not None and t.device != dev:
            raise ValueError(f"{op}: {name} is on {t.device} but x is on {dev}")


def _check_target_range(target, v, ignore_index):
    """Class indices in [0, V) or ignore_index. On CUDA a device-side assert queued behind the
    call, as F.cross_entropy's own: no host sync in a training step, and a bad index fails at
    the next sync with this message (ending the process's CUDA context, as torch's does). Elsewhere
    a ValueError naming the first bad index. Skipped while compiling or capturing a CUDA graph:
    the kernels then give a NaN loss for a bad index."""
    if torch.compiler.is_compiling() or (target.is_cuda and torch.cuda.is_current_stream_capturing()):
        return
    ok = ((target >= 0) & (target < v)) | (target == ignore_index)
    if target.is_cuda:
        torch._assert_async(ok.all(), f"linear_cross_entropy: a target is outside [0, {v}) (vocab = weight.shape[0]) "
                                      f"and not ignore_index = {ignore_index}")
    elif not bool(ok.all()):
        i = int((~ok).nonzero()[0, 0])
        raise ValueError(f"linear_cross_entropy: target holds {int(target[i])} at flat index {i}, outside "
                         f"[0, {v}) (vocab = weight.shape[0]) and not ignore_index = {ignore_index}")


def linear_cross_entropy(x, weight, target, bias=None, *, ignore_index=-100, label_smoothing=0.0, reduction="mean",
                         backend=None):
    """cross_entropy(x @ weight.T + bias, target) without materialising the logits.

    Equals F.cross_entropy(F.linear(x, weight, bias).float(), target, ignore_index=ignore_index,
    label_smoothing=label_smoothing, reduction=reduction): the 16-bit logits are rounded as
    F.linear rounds them, the softmax is fp32. x (..., hidden) fp16/bf16 (fp32 under autocast
    is cast as F.linear casts it); weight (vocab, hidden) in x's dtype or fp32 master weights
    under autocast (gradients returned in fp32); target (...) int64; the loss is fp32 (fp64 for
    fp64 inputs, which with fp32 run the torch path when autocast is off).
    backend: None/"auto" | "cuda" | "triton" | "torch" (see ampkernels.backends). "auto" on CUDA
    runs that composite itself when tokens x vocab is at most 2^22 (less host time there, small
    logits).
    """
    _check_args(x, weight, target, bias, ignore_index, label_smoothing, reduction)
    label_smoothing = float(label_smoothing)
    device = x.device
    x, cast_to = autocast_dtypes("linear_cross_entropy", x, (weight, bias), ("weight", "bias"))  # weights cast in the op
    k, v = x.shape[-1], weight.shape[0]
    x2, t2 = x.reshape(-1, k), target.reshape(-1).to(torch.int64)
    if _runs_composite(backend, x, x2.shape[0], v):
        loss = _composite(x2, weight, bias, t2, cast_to, ignore_index, label_smoothing, reduction)
        return loss.reshape(target.shape) if reduction == "none" else loss
    x2, t2 = x2.contiguous(), t2.contiguous()
    _check_target_range(t2, v, ignore_index)
    unsupported = None if x.dtype in _KERNEL_DTYPES else f"dtype {x.dtype} is not float16/bfloat16"
    name = _choose(backend, device, x.dtype, unsupported)
    weight = weight.contiguous()
    bias = None if bias is None else bias.contiguous()
    grad = torch.is_grad_enabled()
    need_dx, need_dw = grad and x2.requires_grad, grad and weight.requires_grad
    need_db = grad and bias is not None and bias.requires_grad
    loss = torch.ops.ampkernels.linear_cross_entropy_fwd(x2, weight, bias, t2, ignore_index, label_smoothing, reduction,
                                                         need_dx, need_dw, need_db, current_chunk_floor(), name)[0]
    return loss.reshape(target.shape) if reduction == "none" else loss
