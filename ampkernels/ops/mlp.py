"""fused_mlp: out = act(x @ w1.T + b1) @ w2.T + b2, the MLP block behind nn.FusedMLP.

Memory is the point: backward keeps x, the weights and one hidden-sized tensor, the
pre-activation (compute dtype). The post-activation h is produced in forward for the
second GEMM and dropped; backward recomputes it from the pre-activation with one
elementwise pass. Eager Linear -> act -> Linear keeps both (two hidden-sized tensors).
Under autocast the weights are cast inside the op: w1 is kept as the fp32 parameter and cast
again late in backward; w2's cast is kept and freed once used.

One op, eager and compiled: `torch.ops.ampkernels.fused_mlp` (csrc/ops.cpp, FusedMLPTrain: its
autograd in C++), on linear_act's kernels of one backend. Forward: linear_act's fused GEMM +
bias + activation (cuBLASLt epilogue or Triton), storing the pre-activation, then a GEMM + bias.
Backward, ordered so that at most two hidden-sized tensors are alive (pre and one more): h
recomputed by the forward epilogue's formulas (the forward's bits), dw2 (+ db2) from it, h
freed; dh = dout W2 with act'(pre) applied to it in place (dh is the backward's own temporary);
pre freed there, with w2's cast, unless the graph is kept (retain_graph); then layer 1's GEMMs
(bias gradients accumulated in fp32). tests/memory.py measures this on CPU
(`python -m tests.memory`). The "torch" backend is the eager block under torch's autograd.

Tried and dropped (docs/performance.md): cuBLASLt's DGELU_BGRAD epilogue for dz1 and db1, which
ran as a separate kernel 5x slower than our elementwise pass.
"""
import math

import torch
import torch.nn.functional as F

from .. import _extension, backends, reference
from . import linear_act as la
from .shared import FUSED_MLP, gemm_entry, gemm_unsupported


def _fused_mlp_fake(x, w1, b1, w2, b2, activation, cast_to, backend):
    return x.new_empty(*x.shape[:-1], w2.shape[0])


_extension.on_load(lambda: torch.library.register_fake("ampkernels::fused_mlp")(_fused_mlp_fake))


def _eager_first(pref):
    return tuple(b for b in pref if b != "torch") or ("cuda", "triton")


def auto_preference(device, dtype, activation, bucket, training, compiling=False):
    """Backends "auto" tries for fused_mlp, fastest first: linear_act's measured order for the
    first GEMM's shape, never the unfused torch path in eager (FusedMLP is there for its memory).
    In the MLP benchmark (bf16) this picks what ran faster: Triton at T=8192 H=4096 (11.74-12.15 ms
    against cuda's 11.94-12.70), cuda at T=16384 H=1024 (2.02-2.07 against 2.27-2.54, host-bound
    there). Under torch.compile linear_act's decision: inductor gets the block."""
    pref = la.preference(device, dtype, activation, bucket, training, compiling)
    if compiling:
        return pref  # linear_act's decision under torch.compile (inductor gets the block)
    return _eager_first(pref)


_NOT_CUDA_FIRST = la.not_cuda_first(lambda pref: _eager_first(pref)[0])


@backends.assume_constant_result
def _choose(backend, device, dtype, activation, bucket, training, unsupported, compiling):
    # a host-side decision, a constant of the graph under torch.compile (as linear_act's _choose)
    return backends.select("fused_mlp", backend, device,
                           auto_preference(device, dtype, activation, bucket, training, compiling), unsupported)


def fused_mlp(x, w1, b1, w2, b2, activation="gelu_tanh", *, backend=None):
    """act(x @ w1.T + b1) @ w2.T + b2 over the last dim of x, keeping one hidden-sized
    tensor for backward. Under CUDA autocast, inputs are cast to the autocast dtype as
    F.linear casts them; fp32 without autocast, CPU tensors and other dtypes run eager torch."""
    act = reference.activation_id(activation)
    params = (w1, b1, w2, b2)
    out = gemm_entry(FUSED_MLP, x, params, act, backend, _NOT_CUDA_FIRST,
                     la.BUCKET_BOUNDS)  # the plain eager call, without the Python below
    if out is not NotImplemented:
        return out
    for name, t in (("x", x), ("w1", w1), ("b1", b1), ("w2", w2), ("b2", b2)):
        if t is not None and not t.is_floating_point():
            raise TypeError(f"fused_mlp: {name} must be a floating-point tensor, got {t.dtype}")
    if x.shape[-1] != w1.shape[1] or w2.shape[1] != w1.shape[0]:
        raise ValueError(f"shapes do not chain: x {tuple(x.shape)}, w1 {tuple(w1.shape)}, w2 {tuple(w2.shape)} "
                         "(need x[..., K], w1 (H, K), w2 (N, H))")
    cast_to = None  # under autocast the op casts the weights (it keeps no cast of w1)
    if x.is_cuda and torch.is_autocast_enabled("cuda"):
        x = x.to(torch.get_autocast_dtype("cuda"))
        if any(t is not None and t.dtype != x.dtype for t in params):
            cast_to = x.dtype
    unsupported = gemm_unsupported(x)
    if unsupported is None and cast_to is None and any(t is not None and t.dtype != x.dtype for t in params):
        unsupported = "weights and biases must share x's dtype"
    training = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, *params))
    k = x.shape[-1]
    m = x.numel() // k if k else math.prod(x.shape[:-1])
    compiling = torch.compiler.is_compiling()
    name = _choose(backend, x.device, x.dtype, activation, la.shape_bucket(m, w1.shape[0], w1.shape[1]), training,
                   unsupported, compiling)
    if name == "torch":  # the eager block, exactly what FusedMLP replaces (F.linear casts under autocast)
        return F.linear(reference.act_fwd(F.linear(x, w1, b1), activation), w2, b2)
    contiguous = lambda t: None if t is None else t.contiguous()  # noqa: E731  (the kernels' layout)
    xk = x if x.is_contiguous() and not compiling else x.reshape(m, k).contiguous()
    out = torch.ops.ampkernels.fused_mlp.default(xk, w1.contiguous(), contiguous(b1), w2.contiguous(), contiguous(b2),
                                                 act, cast_to, name)
    return out if xk is x else out.reshape(*x.shape[:-1], w2.shape[0])
