"""layer_norm and rms_norm: FP32-accumulating LayerNorm / RMSNorm, forward and backward.

One implementation serves both norms (is_rms: no mean, no bias). Backends: "cuda"
(csrc/layer_norm.cu), "triton" (ampkernels/triton/layer_norm.py) and "torch" (torch's own ops,
with torch's autograd: what inductor traces under torch.compile).

Contract (docs/design.md): statistics and normalisation in fp32; mean/rstd saved in
fp32; output in x.dtype unless out_dtype says otherwise; weight/bias in x.dtype or fp32 (the
AMP case), their grads accumulated in fp32 with a fixed-order reduction (bitwise repeatable)
and returned in their own dtype; with a residual, the unrounded sum x + residual is
normalised and returned too (fp32 if residual_in_fp32 else x.dtype), and gradients flow to
both inputs. Under autocast the op keeps the activation dtype (autocast does not cast it).

One op, eager and compiled: `torch.ops.ampkernels.norm` (csrc/ops.cpp: its schema and its
autograd, in C++ so that neither pass runs Python per call) with the kernels of each pass
as the ops norm_{fwd,bwd}_cuda (the extension) and norm_{fwd,bwd}_triton (registered here).
Their fakes are here, one per pass for every backend. The kernel backends need the extension.
"""
import math

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import _extension, backends, reference
from .shared import kernel_op

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _triton():
    from ..triton import layer_norm as triton_layer_norm  # imported on first use: triton is optional
    return triton_layer_norm


def _stat_dtype(x):
    return torch.float64 if x.dtype == torch.float64 else torch.float32  # float64: the torch backend only


# ---------------------------------------------------------------- the kernels of one pass, per backend

def _fwd_fake(x, weight, bias, residual, eps, is_rms, out_dtype, residual_in_fp32, want_stats=True):
    """(out, residual_out, mean, rstd) of 2-D x; absent outputs are empty (mean and rstd without
    want_stats: the kernels then write neither)."""
    rows = x.shape[0]
    res_out = x.new_empty(0) if residual is None else \
        x.new_empty(x.shape, dtype=torch.float32 if residual_in_fp32 else x.dtype)
    return (x.new_empty(x.shape, dtype=out_dtype or x.dtype), res_out,
            x.new_empty(0 if is_rms or not want_stats else rows, dtype=torch.float32),
            x.new_empty(rows if want_stats else 0, dtype=torch.float32))


def _bwd_fake(dy, x, weight, mean, rstd, dresidual_out, is_rms, want_dweight, want_dbias, dx_dtype, dresidual_dtype,
              param_dtype):
    """(dx, dresidual, dweight, dbias). x is what the forward normalised (x or the residual sum).
    dresidual is empty unless its dtype differs from dx's (then dx serves for both);
    dweight/dbias are empty unless asked for."""
    n = x.shape[1]
    pd = param_dtype or (weight.dtype if weight is not None else x.dtype)
    dres = x.new_empty(0)
    if dresidual_dtype is not None and dresidual_dtype != dx_dtype:
        dres = x.new_empty(x.shape, dtype=dresidual_dtype)
    return (x.new_empty(x.shape, dtype=dx_dtype), dres, x.new_empty(n if want_dweight else 0, dtype=pd),
            x.new_empty(n if want_dbias else 0, dtype=pd))


@kernel_op("norm_fwd_triton(Tensor x, Tensor? weight, Tensor? bias, Tensor? residual, float eps, bool is_rms, "
           "ScalarType? out_dtype, bool residual_in_fp32, bool want_stats=True) -> "
           "(Tensor out, Tensor residual_out, Tensor mean, Tensor rstd)", _fwd_fake)
def norm_fwd_triton(x, weight, bias, residual, eps, is_rms, out_dtype, residual_in_fp32, want_stats=True):
    return _triton().norm_fwd(x, weight, bias, residual, eps, is_rms, out_dtype, residual_in_fp32, want_stats)


@kernel_op("norm_bwd_triton(Tensor dy, Tensor x, Tensor? weight, Tensor mean, Tensor rstd, Tensor? dresidual_out, "
           "bool is_rms, bool want_dweight, bool want_dbias, ScalarType dx_dtype, ScalarType? dresidual_dtype, "
           "ScalarType? param_dtype) -> (Tensor dx, Tensor dresidual, Tensor dweight, Tensor dbias)", _bwd_fake)
def norm_bwd_triton(dy, x, weight, mean, rstd, dresidual_out, is_rms, want_dweight, want_dbias, dx_dtype,
                    dresidual_dtype, param_dtype):
    return _triton().norm_bwd(dy, x, weight, mean, rstd, dresidual_out, is_rms, want_dweight, want_dbias, dx_dtype,
                              dresidual_dtype, param_dtype)


def _norm_fake(x, weight, bias, residual, eps, is_rms, out_dtype, residual_in_fp32, fwd_backend, bwd_backend):
    # out and residual_out keep x's shape (any rank); no stats asked for, so no row count
    return _fwd_fake(x, weight, bias, residual, eps, is_rms, out_dtype, residual_in_fp32, False)[:2]


def _register_extension_fakes():
    torch.library.register_fake("ampkernels::norm_fwd_cuda")(_fwd_fake)
    torch.library.register_fake("ampkernels::norm_bwd_cuda")(_bwd_fake)
    torch.library.register_fake("ampkernels::norm")(_norm_fake)


_extension.on_load(_register_extension_fakes)


_HOST_BOUND_ELEMENTS = 1 << 25
_TORCH, _CUDA_FIRST, _TRITON_FIRST = ("torch",), ("cuda", "triton"), ("triton", "cuda")


def _preferences(x, param_dtype, compiling):
    """(forward, backward): the backends "auto" tries for each pass, fastest first.

    Both backends save the same tensors (fp32 mean/rstd, the normalised input), so "auto" may run
    the forward on one and the backward on the other. From the H200 norm benchmark
    (ampkernels/bench/bench_layer_norm.py, fp16/bf16, M*N = 2^27, N = 768..16384; the numbers are
    in docs/performance.md, which names the rows' file):
    - forward, params in x's dtype: Triton (3.98-4.18 TB/s against CUDA's 3.78-4.09);
    - forward of 16-bit x with fp32 params (the AMP case): CUDA, ahead at every N for LayerNorm;
    - backward: CUDA. Triton's kernels are as fast from a CUDA graph, but a Triton call costs the
      host 100-160 us against 35-55 us for the extension, so as called they follow host jitter;
    - below 2^25 elements CUDA whatever the pass: there a kernel takes less GPU time than
      Triton's Python launcher costs the host;
    - under torch.compile: "torch", which hands the op to inductor (_torch_norm): as opaque
      custom ops our kernels lost whole compiled training steps to it.
    """
    if compiling:
        return _TORCH, _TORCH
    # the norm modules' eager entry (csrc/ops.cpp norm_module) takes the calls of this first rule
    if x.numel() < _HOST_BOUND_ELEMENTS or (param_dtype == torch.float32 and x.dtype != torch.float32):
        return _CUDA_FIRST, _CUDA_FIRST
    return _TRITON_FIRST, _CUDA_FIRST


def _torch_norm(x, shape, weight, bias, eps, residual, residual_in_fp32, out_dtype, is_rms, compiling):
    """The "torch" backend: torch ops with torch's autograd, in the contract's dtypes. Eager, the
    reference's math (exact where it can be: a row of one element normalises to 0); under
    torch.compile, the op as torch's own norms compute it, which inductor traces into the kernels,
    forward and backward, that it makes of the unconverted model."""
    if not compiling:
        n = math.prod(shape)
        w, b = (None if p is None else p.reshape(n) for p in (weight, bias))
        out, s, _, _ = reference.norm_forward(x.reshape(-1, n), w, b, eps,
                                              residual=None if residual is None else residual.reshape(-1, n),
                                              residual_in_fp32=residual_in_fp32, out_dtype=out_dtype, is_rms=is_rms)
        out = out.reshape(x.shape)
        return out if residual is None else (out, s.reshape(x.shape))
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


def _validate(op, x, shape, weight, bias, residual, out_dtype):
    """Raises, naming the argument, unless the call is well formed; returns the row length."""
    if not isinstance(x, Tensor):
        raise TypeError(f"{op}: x must be a Tensor, got {type(x).__name__}")
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
    return shape[0] if nd == 1 else math.prod(shape)


def _unsupported(x, n, out_dtype, residual, weight, bias):
    """Why the kernels cannot take this call (the torch backend then runs), or None."""
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
    if not _extension.loaded():
        return f"the norm kernels run through ampkernels._C, which is not loaded ({_extension.status()[1]})"
    return None


def _norm(x, normalized_shape, weight, bias, eps, residual, residual_in_fp32, out_dtype, backend, is_rms):
    # Runs once per norm per step, on the host's critical path, where each us counts against
    # torch's own norm (the host bench): the common call (one normalised dim, the parameters
    # and residual as expected, dtypes the kernels take) is recognised by one condition;
    # any other goes through _validate and _unsupported, which say what is wrong.
    op = "rms_norm" if is_rms else "layer_norm"
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    if (isinstance(x, Tensor) and len(shape) == 1 and x.dim() > 0 and x.shape[-1] == shape[0] > 0
            and x.dtype in _DTYPES and (out_dtype is None or out_dtype in _DTYPES)
            and (weight is None or (isinstance(weight, Tensor) and weight.shape == shape))
            and (bias is None or (isinstance(bias, Tensor) and bias.shape == shape))
            and (residual is None or (isinstance(residual, Tensor) and residual.shape == x.shape
                                      and residual.dtype in _DTYPES))):
        device, n, nd, xdt = x.device, shape[0], 1, x.dtype
        for t in (weight, bias, residual):
            if t is not None and t.device != device:
                _validate(op, x, shape, weight, bias, residual, out_dtype)  # raises, naming it
        unsupported = None
        f32 = torch.float32
        if not _extension.loaded() or (weight is not None and weight.dtype is not xdt and weight.dtype is not f32) \
                or (bias is not None and bias.dtype is not xdt and bias.dtype is not f32):
            unsupported = _unsupported(x, n, out_dtype, residual, weight, bias)
    else:
        n = _validate(op, x, shape, weight, bias, residual, out_dtype)
        device, nd = x.device, len(shape)
        unsupported = _unsupported(x, n, out_dtype, residual, weight, bias)
    compiling = torch.compiler.is_compiling()
    fwd_pref, bwd_pref = _preferences(x, None if weight is None else weight.dtype, compiling)
    name = backends.select(op, backend, device, fwd_pref, unsupported)
    bwd_name = name if bwd_pref == fwd_pref else backends.select(op, backend, device, bwd_pref, unsupported)

    if name == "torch" or bwd_name == "torch":  # both, as the preferences are made
        return _torch_norm(x, shape, weight, bias, eps, residual, residual_in_fp32, out_dtype, is_rms, compiling)

    w2 = weight if weight is None or (nd == 1 and weight.is_contiguous()) else weight.reshape(-1).contiguous()
    b2 = bias if bias is None or (nd == 1 and bias.is_contiguous()) else bias.reshape(-1).contiguous()
    # the kernels read contiguous rows: x as it is when it is made of them (of any rank: the op
    # views its rows below autograd, adding no nodes), else a contiguous (rows, n) copy (strided
    # views are copied, never read wrongly); rows under torch.compile, where the op's outputs
    # are traced as fresh tensors
    rows_ok = nd == 1 and x.is_contiguous() and (residual is None or residual.is_contiguous())
    xk = x if rows_ok and not compiling else x.reshape(-1, n).contiguous()
    resk = residual if residual is None or xk is x else residual.reshape(-1, n).contiguous()
    out, res_out = torch.ops.ampkernels.norm.default(xk, w2, b2, resk, float(eps), is_rms, out_dtype,
                                                     bool(residual_in_fp32), name, bwd_name)
    if xk is not x:  # only then: a view would add an autograd node per call
        out = out.reshape(x.shape)
        res_out = None if residual is None else res_out.reshape(x.shape)
    return out if residual is None else (out, res_out)


def _declined(*args):
    return NotImplemented


def module_entry():
    """The norm modules' eager entry: the extension's norm_module (csrc/ops.cpp), which runs the
    plain call of a module (CUDA x, the cuda kernels chosen) without this module's Python and
    declines (NotImplemented) any other, where the caller runs layer_norm() / rms_norm(). Where
    the cuda backend does not run, a stand-in that always declines."""
    if not backends.available_backends()["cuda"][0]:
        return _declined
    from .. import _C
    return _C.norm_module


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
