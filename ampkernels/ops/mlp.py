"""fused_mlp: out = act(x @ w1.T + b1) @ w2.T + b2, the MLP block behind nn.FusedMLP.

Memory is the point: backward keeps x, the weights and one hidden-sized tensor, the
pre-activation (compute dtype). The post-activation h is produced in forward for the
second GEMM and dropped; backward recomputes it from the pre-activation with one
elementwise pass. Eager Linear -> act -> Linear keeps both (two hidden-sized tensors).
Under autocast the weights are cast inside (FusedMLPFunction): w1 is kept as the fp32
parameter and cast again late in backward; w2's cast is kept and freed once used.

Eager calls run the implementations directly; torch.compile and opcheck see the custom ops
(shared.eager_call says why); eager training on the cuda backend takes fused_mlp_train_cuda, the
same Function with its autograd in C++ (csrc/ops.cpp). Forward: linear_act's fused GEMM + bias + activation (cuBLASLt epilogue or Triton),
storing the pre-activation, then a GEMM + bias. Backward, ordered so that at most two
hidden-sized tensors are alive (pre and one more): h recomputed by the bias_act kernel (Triton:
act_forward, the forward epilogue's formulas: the forward's bits), dw2 (+ db2) from it, h freed;
dh = dout W2 with act'(pre) applied to it in place (dh is the backward's own temporary); pre
freed there, with w2's cast, unless the graph is kept (retain_graph); then layer 1's GEMMs
(bias gradients accumulated in fp32).
tests/memory.py measures this on CPU (`python -m tests.memory`). Pieces in data order:
custom ops (forward, backward) with fakes -> autograd Function -> functional API.

Tried and dropped (docs/performance.md): cuBLASLt's DGELU_BGRAD epilogue for dz1 and db1, which
ran as a separate kernel 5x slower than our elementwise pass.
"""
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import backends, reference
from . import bias_act, linear_act as la
from .shared import dies_with_this_backward, eager_call

_DTYPES = (torch.float16, torch.bfloat16)


def _fwd_impl(x, w1, b1, w2, b2, activation, backend):
    # first GEMM with bias + activation in its epilogue, also storing the pre-activation
    h, pre = la.fwd_impl(x, w1, b1, activation, True, backend)
    return F.linear(h, w2, b2), pre


def _bwd_impl(dout, x, w1, w2, pre, activation, b1_dtype, b2_dtype, backend, release_pre=False, release_w2=False):
    # At most two hidden-sized tensors alive: pre (saved) and one of h, dh/dz, in this order.
    # w1 may be the fp32 master weight (FusedMLPFunction keeps no cast of it): it is cast here,
    # after pre is freed, and dw1 is returned in w1's dtype. w2 is in x's dtype.
    # release_pre / release_w2: free pre's memory once act' has read it and w2's (our own
    # cast) once dh is formed, before layer 1's gradients exist (FusedMLPFunction.backward
    # says when that is safe).
    # 1. layer 2's weight (and bias) gradient from the recomputed post-activation h, which is
    #    freed before dh exists (cuda: the bias gradient fused into the weight-gradient GEMM)
    if backend == "triton":  # the forward epilogue's formulas on the same pre: h bit for bit
        from ..triton import linear_act as tk
        h = tk.act_forward(pre, reference.activation_id(activation))
    else:
        h, _ = bias_act.fwd_impl(pre, None, activation, False, "cuda" if backend == "cuda" else "torch")
    _, dw2, db2 = la.bwd_impl(dout, h, w2, None, "identity", False, True, b2_dtype is not None, backend)
    del h
    # 2. dh = dout W2, then dz = dh * act'(pre) IN PLACE: dh is this function's own temporary
    #    (never visible outside), so the act' pass needs no third hidden-sized buffer. cuda and
    #    Triton sum db1 in the same pass; torch sums dz after it.
    need_db1 = b1_dtype is not None
    dh = dout.mm(w2)
    db1_32 = la.act_backward_(dh, pre, activation, need_db1, backend)
    if release_pre:
        pre.untyped_storage().resize_(0)
    if release_w2:
        w2.untyped_storage().resize_(0)
    # 3. layer 1 with act' already applied (dz = dh). dx first, so that w1's cast is gone before
    #    dw1 exists; dw1 in w1's dtype straight from the GEMM where torch can (no cast kernel).
    dx = dh.mm(w1.to(x.dtype))
    dw1 = la.weight_grad(dh, x, w1.dtype)
    del dh
    db1 = db1_32.to(x.dtype) if need_db1 else dx.new_empty(0)
    return dx, dw1.to(w1.dtype), db1, dw2, db2


@torch.library.custom_op("ampkernels::fused_mlp_fwd", mutates_args=())
def fused_mlp_fwd(x: Tensor, w1: Tensor, b1: Optional[Tensor], w2: Tensor, b2: Optional[Tensor], activation: str,
                  backend: str) -> tuple[Tensor, Tensor]:
    """(out, pre) for 2-D x; pre = x @ w1.T + b1 in x.dtype."""
    return _fwd_impl(x, w1, b1, w2, b2, activation, backend)


@fused_mlp_fwd.register_fake
def _(x, w1, b1, w2, b2, activation, backend):
    return x.new_empty(x.shape[0], w2.shape[0]), x.new_empty(x.shape[0], w1.shape[0])


@torch.library.custom_op("ampkernels::fused_mlp_bwd", mutates_args=())
def fused_mlp_bwd(dout: Tensor, x: Tensor, w1: Tensor, w2: Tensor, pre: Tensor, activation: str,
                  b1_dtype: Optional[torch.dtype], b2_dtype: Optional[torch.dtype],
                  backend: str) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(dx, dw1, db1, dw2, db2); dw1 in w1's dtype (w1 may be fp32: cast inside); a bias
    gradient is empty when its dtype is None."""
    return _bwd_impl(dout, x, w1, w2, pre, activation, b1_dtype, b2_dtype, backend)


@fused_mlp_bwd.register_fake
def _(dout, x, w1, w2, pre, activation, b1_dtype, b2_dtype, backend):
    bias_grad = lambda dt, n: dout.new_empty(0) if dt is None else dout.new_empty(n, dtype=dt)  # noqa: E731
    return (torch.empty_like(x), torch.empty_like(w1), bias_grad(b1_dtype, w1.shape[0]), torch.empty_like(w2),
            bias_grad(b2_dtype, w2.shape[0]))


class FusedMLPFunction(torch.autograd.Function):
    """dtype: the compute dtype the weights and biases are cast to (autocast's), or None when
    they are in x's dtype already. w1 is saved as given: under autocast that is the fp32
    parameter, which exists anyway, and backward casts it again once pre is freed, instead of
    keeping a cast of it alive through the step's peak (T=8192, H=4096: 128 MiB for ~0.1 ms)."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    def forward(ctx, x, w1, b1, w2, b2, activation, backend, dtype=None):
        w1c, b1c, w2c, b2c = (t if t is None or dtype is None else t.to(dtype) for t in (w1, b1, w2, b2))
        op = _fwd_impl if eager_call(x, w1c, b1c, w2c, b2c) else torch.ops.ampkernels.fused_mlp_fwd
        out, pre = op(x, w1c, b1c, w2c, b2c, activation, backend)
        ctx.save_for_backward(x, w1, w2c, pre)
        ctx.activation, ctx.backend = activation, backend
        ctx.w2_is_own_cast = w2c is not w2
        ctx.bias_dtypes = (None if b1 is None else b1c.dtype, None if b2 is None else b2c.dtype)
        return out

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, dout):
        x, w1, w2, pre = ctx.saved_tensors
        args = (dout.contiguous(), x, w1, w2, pre, ctx.activation, *ctx.bias_dtypes, ctx.backend)
        if eager_call(dout, x, w1, w2, pre):
            release = dies_with_this_backward(pre)
            dx, dw1, db1, dw2, db2 = _bwd_impl(*args, release_pre=release,
                                               release_w2=release and ctx.w2_is_own_cast and dies_with_this_backward(w2))
        else:
            dx, dw1, db1, dw2, db2 = torch.ops.ampkernels.fused_mlp_bwd(*args)
        none_if_empty = lambda g, dt: None if dt is None else g  # noqa: E731
        return (dx, dw1, none_if_empty(db1, ctx.bias_dtypes[0]), dw2, none_if_empty(db2, ctx.bias_dtypes[1]),
                None, None, None)


def auto_preference(device, dtype, activation, bucket, training, compiling=False):
    """Backends "auto" tries for fused_mlp, fastest first: linear_act's measured order for the
    first GEMM's shape, never the unfused torch path in eager (FusedMLP is there for its memory).
    In the MLP benchmark (bf16) this picks what ran faster: Triton at T=8192 H=4096 (11.74-12.15 ms
    against cuda's 11.94-12.70), cuda at T=16384 H=1024 (2.02-2.07 against 2.27-2.54, host-bound
    there). Under torch.compile linear_act's decision: inductor gets the block."""
    pref = la.preference(device, dtype, activation, bucket, training, compiling)
    if compiling:
        return pref  # linear_act's decision under torch.compile (inductor gets the block)
    return tuple(b for b in pref if b != "torch") or ("cuda", "triton")


@backends.assume_constant_result
def _choose(backend, device, dtype, activation, bucket, training, unsupported, compiling):
    # a host-side decision, a constant of the graph under torch.compile (as linear_act's _choose)
    return backends.select("fused_mlp", backend, device,
                           auto_preference(device, dtype, activation, bucket, training, compiling), unsupported)


def fused_mlp(x, w1, b1, w2, b2, activation="gelu_tanh", *, backend=None):
    """act(x @ w1.T + b1) @ w2.T + b2 over the last dim of x, keeping one hidden-sized
    tensor for backward. Under CUDA autocast, inputs are cast to the autocast dtype as
    F.linear casts them; fp32 without autocast, CPU tensors and other dtypes run eager torch."""
    reference.activation_id(activation)
    for name, t in (("x", x), ("w1", w1), ("b1", b1), ("w2", w2), ("b2", b2)):
        if t is not None and not t.is_floating_point():
            raise TypeError(f"fused_mlp: {name} must be a floating-point tensor, got {t.dtype}")
    if x.shape[-1] != w1.shape[1] or w2.shape[1] != w1.shape[0]:
        raise ValueError(f"shapes do not chain: x {tuple(x.shape)}, w1 {tuple(w1.shape)}, w2 {tuple(w2.shape)} "
                         "(need x[..., K], w1 (H, K), w2 (N, H))")
    params = (w1, b1, w2, b2)
    cast_to = None  # under autocast the weights are cast inside FusedMLPFunction (it keeps no cast of w1)
    if x.is_cuda and torch.is_autocast_enabled("cuda"):
        x = x.to(torch.get_autocast_dtype("cuda"))
        if any(t is not None and t.dtype != x.dtype for t in params):
            cast_to = x.dtype
    unsupported = None
    if x.dtype not in _DTYPES:
        unsupported = f"x dtype {x.dtype} is not float16/bfloat16"
    elif cast_to is None and any(t is not None and t.dtype != x.dtype for t in params):
        unsupported = "weights and biases must share x's dtype"
    elif cast_to is not None and not all(t is None or t.is_floating_point() for t in params):
        unsupported = "weights and biases must be floating point"
    training = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, *params))
    m = x.numel() // x.shape[-1] if x.shape[-1] else 0
    name = _choose(backend, x.device, x.dtype, activation, la.shape_bucket(m, w1.shape[0], w1.shape[1]), training,
                   unsupported, torch.compiler.is_compiling())
    if name == "torch":  # the eager block, exactly what FusedMLP replaces (F.linear casts under autocast)
        return F.linear(reference.act_fwd(F.linear(x, w1, b1), activation), w2, b2)
    contiguous = lambda t: None if t is None else t.contiguous()  # noqa: E731  (the kernels' layout)
    w1, b1, w2, b2 = w1.contiguous(), contiguous(b1), w2.contiguous(), contiguous(b2)
    if training and name == "cuda" and eager_call(x, w1, b1, w2, b2):
        # autograd in C++ (csrc/ops.cpp), x of any rank: neither pass runs Python per call
        return torch.ops.ampkernels.fused_mlp_train_cuda.default(x.contiguous(), w1, b1, w2, b2,
                                                                 reference.activation_id(activation), cast_to)
    out = FusedMLPFunction.apply(x.reshape(-1, x.shape[-1]).contiguous(), w1, b1, w2, b2, activation, name, cast_to)
    return out.reshape(*x.shape[:-1], w2.shape[0])
