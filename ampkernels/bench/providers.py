"""Public kernels measured beside ampkernels in the same run; every one is optional.

One adapter per library. An adapter imports its library and returns a Provider, or None
when the library (or the compiled part it needs) does not import here; `discover()` lists
the ones that did. Rows of a provider carry provider=<name> and provider_version. An
adapter only puts the library's public API behind one calling convention per op:

  layer_norm, rms_norm   fn(x, weight, bias, eps) -> y over the last dim (bias None for rms_norm)
  linear_act             fn(x, weight, bias, activation) -> act(x @ weight.T + bias)
  linear_cross_entropy   fn(x, weight, target, bias) -> mean cross_entropy(x @ weight.T + bias, target)

Versions checked against the sources: liger-kernel 0.8.5 (torch>=2.1.2, triton>=2.3.1),
quack-kernels 0.6.5, apex (fused_layer_norm_cuda, fused_dense_cuda), flash-attn 2.x.
"""
import dataclasses
import functools
import importlib
import importlib.metadata
from collections.abc import Callable

import torch


@dataclasses.dataclass(frozen=True)
class Impl:
    fn: Callable
    bwd: bool = True           # has a backward to time
    fp32_params: bool = False  # takes fp32 weight/bias only: timed with the AMP-case params
    note: str = ""             # how it differs from the op measured for the others


@dataclasses.dataclass(frozen=True)
class Provider:
    name: str
    version: str
    ops: dict  # op name -> Impl

    def fields(self, op):
        """What each row of this provider's `op` carries besides the measurement."""
        impl = self.ops[op]
        extra = {"provider_version": self.version}
        if impl.fp32_params:
            extra["param_dtype"] = "float32"
        if impl.note:
            extra["note"] = impl.note
        return extra


ADAPTERS = {}  # name -> adapter, in the order rows are measured
why_not = {}   # name -> why the last discover() found no provider of that name


def _adapter(name):
    """Register an adapter; any exception while importing means "not here" (None): a
    missing package, a wheel built for another torch, a CUDA extension that was not built."""
    def register(make):
        @functools.wraps(make)
        def adapter():
            try:
                return make()
            except Exception as e:  # noqa: BLE001 -- whatever breaks the import, the provider is not here
                why_not[name] = f"{type(e).__name__}: {str(e)[:120]}"
                return None
        ADAPTERS[name] = adapter
        return adapter
    return register


def _version(module, *dists):
    """The module's own __version__, else its installed distribution's."""
    if getattr(module, "__version__", None):
        return str(module.__version__)
    for dist in dists:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    return "unknown"


@_adapter("liger")
def liger():
    import liger_kernel
    from liger_kernel.transformers.functional import liger_layer_norm, liger_rms_norm

    ops = {
        "layer_norm": Impl(lambda x, w, b, eps: liger_layer_norm(x, w, b, eps)),
        # in_place=False: by default its backward writes dx into dy, and a benchmark replays one dy
        "rms_norm": Impl(lambda x, w, b, eps: liger_rms_norm(x, w, eps, in_place=False)),
    }
    try:
        from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss
    except ImportError:
        pass
    else:
        flce = LigerFusedLinearCrossEntropyLoss()  # mean over non-ignored tokens, ignore_index -100

        def linear_cross_entropy(x, w, t, b):
            out = flce(w, x, t, b)  # its argument order: (lin_weight, input, target, bias)
            out = out[0] if isinstance(out, tuple) else getattr(out, "loss", out)
            return out

        ops["linear_cross_entropy"] = Impl(linear_cross_entropy)
    return Provider("liger", _version(liger_kernel, "liger_kernel", "liger-kernel"), ops)


@_adapter("quack")
def quack():
    import quack
    qr = importlib.import_module("quack.rmsnorm")  # `quack.rmsnorm` the attribute is the function

    ops = {"rms_norm": Impl(lambda x, w, b, eps: qr.rmsnorm(x, w, eps=eps))}
    if hasattr(qr, "layernorm_fwd"):
        ops["layer_norm"] = Impl(_quack_layer_norm(qr), bwd=hasattr(qr, "layernorm_bwd"), fp32_params=True)
    return Provider("quack", _version(quack, "quack-kernels"), ops)


def _quack_layer_norm(qr):
    """QuACK has LayerNorm as a forward and a backward function (fp32 weight and bias, 2-D
    x), not as an autograd op; joined here so that both can be timed like the others."""
    class LayerNorm(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w, b, eps):
            if not any(ctx.needs_input_grad[:3]):
                return qr.layernorm_fwd(x, w, b, eps)
            y, rstd, mean = qr.layernorm_fwd(x, w, b, eps, return_rstd=True, return_mean=True)
            ctx.save_for_backward(x, w, rstd, mean)
            ctx.has_bias = b is not None
            return y

        @staticmethod
        def backward(ctx, dy):
            x, w, rstd, mean = ctx.saved_tensors
            dx, dw, db = qr.layernorm_bwd(x, w, dy.contiguous(), rstd, mean, ctx.has_bias)
            return dx, dw, db, None

    return LayerNorm.apply


@_adapter("apex")
def apex():
    import apex

    ops = {}
    try:
        from apex.normalization import FusedLayerNorm
        from apex.normalization.fused_layer_norm import fused_layer_norm_affine, fused_rms_norm_affine

        FusedLayerNorm(8)  # imports fused_layer_norm_cuda: apex installs fine without its extensions
        ops["layer_norm"] = Impl(lambda x, w, b, eps: fused_layer_norm_affine(x, w, b, [x.shape[-1]], eps))
        ops["rms_norm"] = Impl(lambda x, w, b, eps: fused_rms_norm_affine(x, w, [x.shape[-1]], eps))
    except ImportError:
        pass
    try:
        from apex.fused_dense import FusedDenseFunc  # its module imports fused_dense_cuda

        from ampkernels.reference import act_fwd
        ops["linear_act"] = Impl(lambda x, w, b, activation: act_fwd(FusedDenseFunc.apply(x, w, b), activation),
                                 note="FusedDense (cuBLASLt bias epilogue), then the activation unfused")
    except ImportError:
        pass
    if not ops:
        raise ImportError("apex without its fused_layer_norm_cuda / fused_dense_cuda extensions")
    return Provider("apex", _version(apex, "apex"), ops)


@_adapter("flash_attn")
def flash_attn():
    import flash_attn  # imports its compiled attention extension too
    from flash_attn.ops.triton.layer_norm import layer_norm_fn, rms_norm_fn

    return Provider("flash_attn", _version(flash_attn, "flash_attn", "flash-attn"), {
        "layer_norm": Impl(lambda x, w, b, eps: layer_norm_fn(x, w, b, eps=eps)),
        "rms_norm": Impl(lambda x, w, b, eps: rms_norm_fn(x, w, None, eps=eps)),
    })


def discover(op=None):
    """The providers that import here (only those with `op`, if given), in ADAPTERS order."""
    why_not.clear()
    found = [p for p in (adapter() for adapter in ADAPTERS.values()) if p is not None]
    return [p for p in found if op is None or op in p.ops]


def describe(found):
    """One line for logs: which providers were found (with versions and ops) and why not the rest."""
    have = "; ".join(f"{p.name} {p.version} ({', '.join(p.ops)})" for p in found) or "none"
    missing = ", ".join(f"{name} ({why})" for name, why in why_not.items())
    return f"public providers: {have}" + (f"; not importable: {missing}" if missing else "")
