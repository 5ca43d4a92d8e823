"""bias_act: y = act(z + bias) over the last dim, forward and backward.

The elementwise half of linear_act's unfused path (a GEMM, then this kernel), exposed
for reuse and tests. Backends: "cuda" (csrc/bias_act.cu) and "torch" (reference).

One op, eager and compiled: the custom op `ampkernels::bias_act_fwd` with its fake and its
autograd registered on it (torch.library: setup_context saves pre, the backward calls the custom
op `ampkernels::bias_act_bwd`). Autocast does not cast it; its backward runs at autocast off.
"""
from typing import Optional

import torch
from torch import Tensor

from .. import _extension, backends, reference

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def fwd_impl(z, bias, activation, store_pre, backend):
    if backend == "cuda":
        return torch.ops.ampkernels.bias_act_fwd_cuda(z, bias, reference.activation_id(activation), store_pre)
    # block-wise: allocates y (and pre) only, as the kernel does (fused_mlp's backward recomputes
    # its hidden activation here, beside the saved pre-activation)
    y, pre = torch.empty_like(z), torch.empty_like(z) if store_pre else z.new_empty(0)
    reference.bias_act_into(z, bias, activation, y, pre if store_pre else None)
    return y, pre


@torch.library.custom_op("ampkernels::bias_act_fwd", mutates_args=())
def bias_act_fwd(z: Tensor, bias: Optional[Tensor], activation: str, store_pre: bool,
                 backend: str) -> tuple[Tensor, Tensor]:
    """(y, pre) for a 2-D contiguous z; pre = z + bias in z.dtype (what backward reads),
    or an empty tensor when store_pre is False."""
    return fwd_impl(z, bias, activation, store_pre, backend)


def _fwd_fake(z, bias, activation, store_pre, backend=None):
    return torch.empty_like(z), torch.empty_like(z) if store_pre else z.new_empty(0)


bias_act_fwd.register_fake(_fwd_fake)
# the extension's kernel op is traced too: fused_mlp's op recomputes its hidden activation with it
_extension.on_load(lambda: torch.library.register_fake("ampkernels::bias_act_fwd_cuda")(_fwd_fake))


@torch.library.custom_op("ampkernels::bias_act_bwd", mutates_args=())
def bias_act_bwd(dy: Tensor, pre: Tensor, activation: str, dbias_dtype: Optional[torch.dtype],
                 backend: str) -> tuple[Tensor, Tensor]:
    """(dz, dbias); dbias is empty when dbias_dtype is None."""
    if backend == "cuda":
        return torch.ops.ampkernels.bias_act_bwd_cuda(dy, pre, reference.activation_id(activation), dbias_dtype)
    dz, dbias = reference.bias_act_backward(dy, pre, activation, dbias_dtype)
    return dz, dy.new_empty(0) if dbias is None else dbias


@bias_act_bwd.register_fake
def _(dy, pre, activation, dbias_dtype, backend):
    dbias = dy.new_empty(0) if dbias_dtype is None else dy.new_empty(dy.shape[-1], dtype=dbias_dtype)
    return torch.empty_like(dy), dbias


def _setup_context(ctx, inputs, output):
    z, bias, activation, store_pre, backend = inputs
    ctx.save_for_backward(output[1])
    ctx.activation, ctx.backend = activation, backend
    ctx.dbias_dtype = None if bias is None else bias.dtype


def _backward(ctx, dy, _dpre):
    (pre,) = ctx.saved_tensors
    want_dbias = ctx.needs_input_grad[1]
    dz, dbias = torch.ops.ampkernels.bias_act_bwd(dy.contiguous(), pre, ctx.activation,
                                                  ctx.dbias_dtype if want_dbias else None, ctx.backend)
    return dz, (dbias if want_dbias else None), None, None, None


bias_act_fwd.register_autograd(_backward, setup_context=_setup_context)


def bias_act(z, bias=None, activation="gelu_tanh", *, backend=None):
    """act(z + bias) over the last dim of z (any leading dims); output in z.dtype.

    bias: (z.shape[-1],) in z.dtype or float32. Math in fp32; dbias accumulated in fp32.
    """
    reference.activation_id(activation)
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != z.shape[-1]):
        raise ValueError(f"bias must have shape ({z.shape[-1]},), got {tuple(bias.shape)}")
    unsupported = None
    if z.dtype not in _DTYPES:
        unsupported = f"z dtype {z.dtype} is not one of {_DTYPES}"
    elif bias is not None and bias.dtype not in (z.dtype, torch.float32):
        unsupported = f"bias dtype {bias.dtype} is neither z's ({z.dtype}) nor float32"
    name = backends.select("bias_act", backend, z.device, ("cuda",), unsupported)
    z2 = z.reshape(-1, z.shape[-1]).contiguous()
    training = torch.is_grad_enabled() and (z.requires_grad or (bias is not None and bias.requires_grad))
    # pre (what backward reads) is kept only when a backward may come
    y, _ = torch.ops.ampkernels.bias_act_fwd(z2, bias, activation, training, name)
    return y.reshape(z.shape)
