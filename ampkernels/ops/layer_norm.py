"""layer_norm and rms_norm: FP32-accumulating LayerNorm / RMSNorm, forward and backward.

One implementation serves both norms (is_rms: no mean, no bias). Backends: "cuda"
(csrc/layer_norm.cu through torch.ops.ampkernels.norm_{fwd,bwd}_cuda), "triton"
(ampkernels/triton/layer_norm.py) and "torch" (ampkernels/reference.py).

Contract (docs/design.md): statistics and normalisation in fp32; mean/rstd saved in
fp32; output in x.dtype unless out_dtype says otherwise; weight/bias in x.dtype or fp32 (the
AMP case), their grads accumulated in fp32 with a fixed-order reduction (bitwise repeatable)
and returned in their own dtype; with a residual, the unrounded sum x + residual is
normalised and returned too (fp32 if residual_in_fp32 else x.dtype), and gradients flow to
both inputs. Under autocast the op keeps the activation dtype (custom_fwd, no cast).

Pieces, in the order data meets them: custom ops (forward, backward) with fake
implementations -> autograd Function (custom_fwd/custom_bwd) -> functional API.
"""
import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import backends, reference
from .shared import eager_call

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _triton():
    from ..triton import layer_norm as triton_layer_norm  # imported on first use: triton is optional
    return triton_layer_norm


def _stat_dtype(x):
    return torch.float64 if x.dtype == torch.float64 else torch.float32  # float64: reference only


def _fwd_impl(x, weight, bias, residual, eps, is_rms, out_dtype, residual_in_fp32, want_stats, backend):
    if backend == "cuda":
        return torch.ops.ampkernels.norm_fwd_cuda(x, weight, bias, residual, eps, is_rms, out_dtype, residual_in_fp32,
                                                  want_stats)
    if backend == "triton":
        return _triton().norm_fwd(x, weight, bias, residual, eps, is_rms, out_dtype, residual_in_fp32, want_stats)
    out, res_out, mean, rstd = reference.norm_forward(x, weight, bias, eps, residual=residual,
                                                      residual_in_fp32=residual_in_fp32, out_dtype=out_dtype,
                                                      is_rms=is_rms)
    def stat(t):  # a tensor of its own each (custom-op outputs must not alias)
        return t.contiguous() if t is not None and want_stats else x.new_empty(0, dtype=_stat_dtype(x))
    return out, x.new_empty(0) if res_out is None else res_out, stat(mean), stat(rstd)


@torch.library.custom_op("ampkernels::norm_fwd", mutates_args=())
def norm_fwd(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], residual: Optional[Tensor], eps: float,
             is_rms: bool, out_dtype: Optional[torch.dtype], residual_in_fp32: bool, want_stats: bool,
             backend: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(out, residual_out, mean, rstd) for a 2-D contiguous x; absent outputs are empty (mean
    and rstd without want_stats: the kernels then write neither)."""
    return _fwd_impl(x, weight, bias, residual, eps, is_rms, out_dtype, residual_in_fp32, want_stats, backend)


@norm_fwd.register_fake
def _(x, weight, bias, residual, eps, is_rms, out_dtype, residual_in_fp32, want_stats, backend):
    rows = x.shape[0]
    stat = _stat_dtype(x)
    if residual is None:
        res_out = x.new_empty(0)
    else:
        res_out = x.new_empty(x.shape, dtype=torch.float32 if residual_in_fp32 and stat == torch.float32 else x.dtype)
    return (x.new_empty(x.shape, dtype=out_dtype or x.dtype), res_out,
            x.new_empty(0 if is_rms or not want_stats else rows, dtype=stat),
            x.new_empty(rows if want_stats else 0, dtype=stat))


def _bwd_impl(dy, x, weight, mean, rstd, dresidual_out, is_rms, want_dweight, want_dbias, dx_dtype,
              dresidual_dtype, param_dtype, backend):
    if backend == "cuda":
        return torch.ops.ampkernels.norm_bwd_cuda(dy, x, weight, mean, rstd, dresidual_out, is_rms, want_dweight,
                                                  want_dbias, dx_dtype, dresidual_dtype, param_dtype)
    if backend == "triton":
        return _triton().norm_bwd(dy, x, weight, mean, rstd, dresidual_out, is_rms, want_dweight, want_dbias,
                                  dx_dtype, dresidual_dtype, param_dtype)
    ct = _stat_dtype(x)
    dx, dw, db = reference.norm_backward(dy, x, weight, None if is_rms else mean, rstd, dresidual_out=dresidual_out,
                                         is_rms=is_rms, want_dweight=want_dweight, want_dbias=want_dbias,
                                         dx_dtype=ct, param_dtype=param_dtype)
    dres = x.new_empty(0)
    if dresidual_dtype is not None and dresidual_dtype != dx_dtype:
        dres = dx.to(dresidual_dtype, copy=True)
    pd = param_dtype or (weight.dtype if weight is not None else x.dtype)
    return (dx.to(dx_dtype, copy=True), dres, x.new_empty(0, dtype=pd) if dw is None else dw,
            x.new_empty(0, dtype=pd) if db is None else db)


@torch.library.custom_op("ampkernels::norm_bwd", mutates_args=())
def norm_bwd(dy: Tensor, x: Tensor, weight: Optional[Tensor], mean: Tensor, rstd: Tensor,
             dresidual_out: Optional[Tensor], is_rms: bool, want_dweight: bool, want_dbias: bool,
             dx_dtype: torch.dtype, dresidual_dtype: Optional[torch.dtype], param_dtype: Optional[torch.dtype],
             backend: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dx, dresidual, dweight, dbias). x is what the forward normalised (x or the residual
    sum). dresidual is empty unless its dtype differs from dx's (then dx serves for both);
    dweight/dbias are empty unless asked for."""
    return _bwd_impl(dy, x, weight, mean, rstd, dresidual_out, is_rms, want_dweight, want_dbias, dx_dtype,
                     dresidual_dtype, param_dtype, backend)


@norm_bwd.register_fake
def _(dy, x, weight, mean, rstd, dresidual_out, is_rms, want_dweight, want_dbias, dx_dtype, dresidual_dtype,
      param_dtype, backend):
    n = x.shape[1]
    pd = param_dtype or (weight.dtype if weight is not None else x.dtype)
    dres = x.new_empty(0)
    if dresidual_dtype is not None and dresidual_dtype != dx_dtype:
        dres = x.new_empty(x.shape, dtype=dresidual_dtype)
    return (x.new_empty(x.shape, dtype=dx_dtype), dres, x.new_empty(n if want_dweight else 0, dtype=pd),
            x.new_empty(n if want_dbias else 0, dtype=pd))


# Eager calls skip the custom-op dispatcher (tens of microseconds of host time per call, as
# much as a 2^27-element kernel takes); torch.compile and opcheck see the custom ops.
def _fwd_op():
    return torch.ops.ampkernels.norm_fwd if torch.compiler.is_compiling() else _fwd_impl


def _bwd_op():
    return torch.ops.ampkernels.norm_bwd if torch.compiler.is_compiling() else _bwd_impl


class NormFunction(torch.autograd.Function):
    """out = norm(x [+ residual]) over the last dim of 2-D contiguous tensors; returns out, or
    (out, residual_out) when a residual is given. backend runs the forward, bwd_backend the
    backward (the same one unless "auto" chose per pass)."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    def forward(ctx, x, weight, bias, residual, eps, is_rms, out_dtype, residual_in_fp32, backend, bwd_backend):
        bias_k = bias
        if bias is not None and weight is not None and bias.dtype != weight.dtype:
            bias_k = bias.to(weight.dtype)  # the kernels take one param dtype; dbias goes back to bias.dtype
        out, res_out, mean, rstd = _fwd_op()(x, weight, bias_k, residual, eps, is_rms, out_dtype, residual_in_fp32,
                                             True, backend)
        # backward re-reads what was normalised: x, or the stored residual sum
        ctx.save_for_backward(res_out if residual is not None else x, weight, mean, rstd)
        ctx.set_materialize_grads(False)
        ctx.is_rms, ctx.backend, ctx.x_dtype, ctx.out_dtype = is_rms, bwd_backend, x.dtype, out.dtype
        ctx.has_residual = residual is not None
        ctx.residual_dtype = residual.dtype if residual is not None else None
        ctx.bias_dtype = bias.dtype if bias is not None else None
        ctx.param_dtype = weight.dtype if weight is not None else ctx.bias_dtype
        if residual is not None:
            return out, res_out
        return out

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, dout, dres_out=None):
        x, weight, mean, rstd = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros(x.shape, dtype=ctx.out_dtype, device=x.device)  # only residual_out was used
        want_dw = weight is not None and ctx.needs_input_grad[1]
        want_db = ctx.bias_dtype is not None and ctx.needs_input_grad[2]
        dx, dres, dw, db = _bwd_op()(
            dout.contiguous(), x, weight, mean, rstd, None if dres_out is None else dres_out.contiguous(),
            ctx.is_rms, want_dw, want_db, ctx.x_dtype, ctx.residual_dtype, ctx.param_dtype, ctx.backend)
        grad_res = None
        if ctx.has_residual and ctx.needs_input_grad[3]:
            grad_res = dres if ctx.residual_dtype != ctx.x_dtype else dx
        return (dx if ctx.needs_input_grad[0] else None, dw if want_dw else None,
                db.to(ctx.bias_dtype) if want_db else None, grad_res, None, None, None, None, None, None)


_HOST_BOUND_ELEMENTS = 1 << 25
_TORCH, _CUDA_FIRST, _TRITON_FIRST = ("torch",), ("cuda", "triton"), ("triton", "cuda")


def _preferences(x, param_dtype, compiling):
    """(forward, backward): the backends "auto" tries for each pass, fastest first.

    Both backends save the same tensors (fp32 mean/rstd, the normalised input), so "auto" may run
    the forward on one and the backward on the other. From the H200 norm benchmark
    (ampkernels/bench/bench_layer_norm.py, fp16/bf16, M*N = 2^27, N = 768..16384; the numbers are
    in docs/performance.md and benchmarks/results/h200-2026-12-01-8adf50d-norms.jsonl):
    - forward, params in x's dtype: Triton (3.98-4.18 TB/s against CUDA's 3.78-4.09);
    - forward of 16-bit x with fp32 params (the AMP case): CUDA, ahead at every N for LayerNorm;
    - backward: CUDA. Triton's kernels are as fast from a CUDA graph, but a Triton call costs the
      host 100-160 us against 35-55 us for the extension, so as called they follow host jitter;
    - below 2^25 elements CUDA whatever the pass: there a kernel takes less GPU time than
      Triton's Python launcher costs the host;
    - under torch.compile: "torch", which hands the op to inductor (_traced_norm): as opaque
      custom ops our kernels lost whole compiled training steps to it.
    """
    if compiling:
        return _TORCH, _TORCH
    if x.numel() < _HOST_BOUND_ELEMENTS or (param_dtype == torch.float32 and x.dtype != torch.float32):
        return _CUDA_FIRST, _CUDA_FIRST
    return _TRITON_FIRST, _CUDA_FIRST


def _traced_norm(x, shape, weight, bias, eps, residual, residual_in_fp32, out_dtype, is_rms):
    """The op as torch's own norms compute it, for inductor to trace: the same kernels, forward
    and backward, that it makes of the unconverted model, with the contract's dtypes."""
    ct = _stat_dtype(x)
    s = x.to(ct) if residual is None else x.to(ct) + residual.to(ct)
    w, b = (None if p is None else p.to(ct) for p in (weight, bias))
    if is_rms:  # the formula Hugging Face's RMSNorms compile to
        dims = tuple(range(-len(shape), 0))
        y = s * torch.rsqrt(s.square().mean(dims, keepdim=True) + eps)
        y = y if w is None else y * w
    else:
        with torch.autocast(x.device.type, enabled=False):
            y = F.layer_norm(s, shape, w, b, eps)
    out = y.to(out_dtype or x.dtype)
    if residual is None:
        return out
    return out, s.to(torch.float32 if residual_in_fp32 and ct == torch.float32 else x.dtype)


def _check_param(op, name, p, shape, device):
    if not isinstance(p, Tensor):
        raise TypeError(f"{op}: {name} must be a Tensor or None, got {type(p).__name__}")
    if p.shape != shape:
        raise ValueError(f"{op}: {name} must have shape {shape} (normalized_shape), got {tuple(p.shape)}")
    if p.device != device:
        raise ValueError(f"{op}: {name} is on {p.device} but x is on {device}")


def _unsupported(x, n, out_dtype, residual, weight, bias):
    """Why the kernels cannot take this call (the torch reference then runs), or None."""
    if x.dtype not in _DTYPES:
        return f"x dtype {x.dtype} is not one of {_DTYPES}"
    if n == 0:
        return "normalized_shape has no elements"
    if out_dtype is not None and out_dtype not in _DTYPES:
        return f"out_dtype {out_dtype} is not one of {_DTYPES}"
    if residual is not None and residual.dtype not in _DTYPES:
        return f"residual dtype {residual.dtype} is not one of {_DTYPES}"
    for name, p in (("weight", weight), ("bias", bias)):
        if p is not None and p.dtype not in (x.dtype, torch.float32):
            return f"{name} dtype {p.dtype} is neither x's ({x.dtype}) nor float32"
    return None


def _norm(x, normalized_shape, weight, bias, eps, residual, residual_in_fp32, out_dtype, backend, is_rms):
    # Runs once per norm per step, on the host's critical path: straight-line checks, no closures
    # or generators, each torch query asked once.
    op = "rms_norm" if is_rms else "layer_norm"
    if not isinstance(x, Tensor):
        raise TypeError(f"{op}: x must be a Tensor, got {type(x).__name__}")
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    nd = len(shape)
    if nd == 0 or nd > x.dim() or x.shape[x.dim() - nd:] != shape:
        raise ValueError(f"{op}: normalized_shape {shape} does not match the last dims of x, shape {tuple(x.shape)}")
    device = x.device
    if weight is not None:
        _check_param(op, "weight", weight, shape, device)
    if bias is not None:
        _check_param(op, "bias", bias, shape, device)
    if residual is not None:
        if not isinstance(residual, Tensor) or residual.shape != x.shape:
            got = tuple(residual.shape) if isinstance(residual, Tensor) else type(residual).__name__
            raise ValueError(f"{op}: residual must have x's shape {tuple(x.shape)}, got {got}")
        if residual.device != device:
            raise ValueError(f"{op}: residual is on {residual.device} but x is on {device}")
    if out_dtype is not None and not (isinstance(out_dtype, torch.dtype) and out_dtype.is_floating_point):
        raise ValueError(f"{op}: out_dtype must be a floating-point torch.dtype or None, got {out_dtype!r}")
    if not x.is_floating_point():
        raise TypeError(f"{op}: x must be a floating-point tensor, got {x.dtype}")
    n = shape[0] if nd == 1 else math.prod(shape)

    unsupported = _unsupported(x, n, out_dtype, residual, weight, bias)
    compiling = torch.compiler.is_compiling()
    fwd_pref, bwd_pref = _preferences(x, None if weight is None else weight.dtype, compiling)
    name = backends.select(op, backend, device, fwd_pref, unsupported)
    bwd_name = name if bwd_pref == fwd_pref else backends.select(op, backend, device, bwd_pref, unsupported)

    if compiling and name == bwd_name == "torch":
        return _traced_norm(x, shape, weight, bias, eps, residual, residual_in_fp32, out_dtype, is_rms)

    w2 = weight if weight is None or (nd == 1 and weight.is_contiguous()) else weight.reshape(-1).contiguous()
    b2 = bias if bias is None or (nd == 1 and bias.is_contiguous()) else bias.reshape(-1).contiguous()
    eps, residual_in_fp32 = float(eps), bool(residual_in_fp32)
    training = torch.is_grad_enabled() and (x.requires_grad or (w2 is not None and w2.requires_grad) or
                                            (b2 is not None and b2.requires_grad) or
                                            (residual is not None and residual.requires_grad))
    # the kernels read contiguous rows: x as it is when it is made of them (of any rank for the C++
    # autograd), else a contiguous (rows, n) copy (strided views are copied, never read wrongly)
    rows_ok = nd == 1 and x.is_contiguous() and (residual is None or residual.is_contiguous())
    xk = x if rows_ok else x.reshape(-1, n).contiguous()
    resk = residual if rows_ok or residual is None else residual.reshape(-1, n).contiguous()
    if training and name == bwd_name == "cuda" and eager_call(xk, w2, b2, resk):
        # autograd in C++ (csrc/ops.cpp): neither pass runs Python per call, and no reshape adds
        # autograd nodes around it
        out, res_out = torch.ops.ampkernels.norm_train_cuda.default(xk, w2, b2, resk, eps, is_rms, out_dtype,
                                                                    residual_in_fp32)
    else:
        if xk.dim() != 2:  # the custom ops and the Function take 2-D rows
            xk, resk = xk.view(-1, n), None if resk is None else resk.view(-1, n)
        if training:
            result = NormFunction.apply(xk, w2, b2, resk, eps, is_rms, out_dtype, residual_in_fp32, name, bwd_name)
            out, res_out = (result, None) if resk is None else result
        else:  # inference: the forward alone, nothing saved (no mean/rstd written: 8 bytes a row)
            if b2 is not None and w2 is not None and b2.dtype != w2.dtype:
                b2 = b2.to(w2.dtype)
            out, res_out, _, _ = _fwd_op()(xk, w2, b2, resk, eps, is_rms, out_dtype, residual_in_fp32, False, name)
    if xk is not x:  # only then: a view would add an autograd node per call
        out = out.reshape(x.shape)
        res_out = None if residual is None else res_out.reshape(x.shape)
    return out if residual is None else (out, res_out)


def layer_norm(x, normalized_shape, weight=None, bias=None, eps=1e-5, *, residual=None, residual_in_fp32=False,
               out_dtype=None, backend=None):
    """LayerNorm over the trailing `normalized_shape` dims of x (fp16/bf16/fp32, any leading dims).

    weight/bias: shape normalized_shape, in x.dtype or float32. Statistics in fp32; output in
    out_dtype or x.dtype. residual: same shape as x; then returns (out, x + residual), the sum in
    float32 if residual_in_fp32 else x.dtype, and out normalises the unrounded sum.
    backend: None/"auto" | "cuda" | "triton" | "torch" (see ampkernels.backends).
    """
    return _norm(x, normalized_shape, weight, bias, eps, residual, residual_in_fp32, out_dtype, backend,
                 is_rms=False)


def rms_norm(x, normalized_shape, weight=None, eps=None, *, residual=None, residual_in_fp32=False, out_dtype=None,
             backend=None):
    """RMSNorm over the trailing dims: x / sqrt(mean(x^2) + eps) * weight; eps=None means
    reference.default_rms_eps(x.dtype) (fp32's epsilon for 16-bit inputs), as torch.nn.RMSNorm
    computes it. Otherwise as layer_norm (no bias)."""
    eps = reference.default_rms_eps(x.dtype) if eps is None and isinstance(x, Tensor) and x.is_floating_point() \
        else eps
    return _norm(x, normalized_shape, weight, None, 1e-6 if eps is None else eps, residual, residual_in_fp32,
                 out_dtype, backend, is_rms=True)
