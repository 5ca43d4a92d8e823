"""gated_linear_act: h = act(x @ Wg^T + bg) * (x @ Wu^T + bu) (SwiGLU, GeGLU), fused.

Backends:
- "cuda": csrc/gated_linear_act.cu: cuBLAS GEMM(s) writing g and u side by side into one
  (M, 2H) buffer -- ONE GEMM with N = 2H when the two weights are adjacent in memory (two
  halves of one packed parameter, e.g. timm GluMlp's fc1, or our own packed cast under
  autocast) -- then one epilogue kernel: biases, h = act(g) * u (and the biased g, u kept for
  backward when training).
- "triton": ampkernels/triton/gated_linear_act.py, one matmul that loads each x tile once into
  two accumulators (gate and up), with the gated epilogue.
- "torch": the eager decomposition (two F.linear, act, mul; torch's own autograd), for fp32/fp64
  inputs without autocast, CPU tensors, and under torch.compile (inductor fuses it);
  recompute=True runs it under torch.utils.checkpoint.

Saved for backward: x, the weights (compute dtype) and ONE buffer of the gated GEMM's output
size, gu = [g | u] (M, 2H) in the compute dtype; never h. recompute=True saves no gu and
recomputes it in backward. Backward: one fused elementwise pass dg = dh * u * act'(g),
du = dh * act(g) (+ fp32 column sums for the biases), written over gu itself when nothing reads
it later (not when the graph is kept for another backward), then dx = dg Wg + du Wu (one GEMM
when packed), dWg = dg^T x and dWu = du^T x (fp32 straight from the GEMM for fp32 master
weights). Under autocast the op casts wg and wu into the two halves of one buffer (packed).

One op each, eager and compiled: `torch.ops.ampkernels.gated_linear_act` and `gated_mlp`
(csrc/ops.cpp: schemas and autograd in C++), reaching each backend's kernels as the ops
gated_{linear_act,act}_*_cuda (the extension) and the *_triton ops registered here, with their
fakes. The kernel backends need the extension.
"""
import math

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import _extension, backends, reference
from . import linear_act as la
from ..triton import device_index, device_properties
from .shared import (GATED_LINEAR_ACT, GATED_MLP, autocast_dtypes, gemm_entry, gemm_entry_key, gemm_unsupported,
                     kernel_op, torch_path_params)

ACTIVATIONS = reference.GATED_ACTIVATIONS


def _triton():
    from ..triton import gated_linear_act as tk  # imported on first use: triton is optional
    return tk


# ---------------------------------------------------------------- the kernel ops' fakes

def _fwd_fake(x, wg, wu, bg, bu, activation, store):
    m, h = x.shape[0], wg.shape[0]
    return x.new_empty(m, h), x.new_empty((m, 2 * h) if store else (0, 0))


def _act_fwd_fake(gu, activation):
    return gu.new_empty(gu.shape[0], gu.shape[1] // 2)


def _act_bwd_fake(dh, gu, dgu, activation, need_db):
    return dh.new_empty(2 * dh.shape[1] if need_db else 0, dtype=torch.float32)


def _gated_linear_act_fake(x, wg, wu, bg, bu, activation, cast_to, recompute, backend):
    return x.new_empty(*x.shape[:-1], wg.shape[0])


def _gated_mlp_fake(x, wg, wu, bg, bu, wd, bd, activation, cast_to, backend):
    return x.new_empty(*x.shape[:-1], wd.shape[0])


# ---------------------------------------------------------------- the Triton kernels, as ops

@kernel_op("gated_linear_act_fwd_triton(Tensor x, Tensor wg, Tensor wu, Tensor? bg, Tensor? bu, int activation, "
           "bool store) -> (Tensor h, Tensor gu)", _fwd_fake)
def gated_linear_act_fwd_triton(x, wg, wu, bg, bu, activation, store):
    """(h, gu) for 2-D contiguous x (M, K), wg and wu (H, K); gu = [g | u] (M, 2H) in x's dtype
    when store, else an empty (0, 0) tensor (as gated_linear_act_fwd_cuda)."""
    return _triton().gated_linear_act_fwd(x, wg, wu, bg, bu, activation, store)


@kernel_op("gated_act_fwd_triton(Tensor gu, int activation) -> Tensor h", _act_fwd_fake)
def gated_act_fwd_triton(gu, activation):
    """h = act(g) * u from gu = [g | u] by the forward epilogue's formulas: the forward's h bit for bit."""
    return _triton().gated_act_forward(gu, activation)


@kernel_op("gated_act_bwd_triton(Tensor dh, Tensor gu, Tensor(a!) dgu, int activation, bool need_db) -> Tensor dbias",
           _act_bwd_fake)
def gated_act_bwd_triton(dh, gu, dgu, activation, need_db):
    """dgu = [dh * u * act'(g) | dh * act(g)] (dgu may be gu: in place); the fp32 column sums of
    dgu (2H,), empty unless need_db (as gated_act_bwd_cuda)."""
    db = _triton().gated_act_backward(dh, gu, dgu, activation, need_db)
    return db if need_db else dh.new_empty(0, dtype=torch.float32)


def _register_extension_fakes():
    for name, fake in (("gated_linear_act_fwd_cuda", _fwd_fake), ("gated_act_fwd_cuda", _act_fwd_fake),
                       ("gated_act_bwd_cuda", _act_bwd_fake), ("gated_linear_act", _gated_linear_act_fake),
                       ("gated_mlp", _gated_mlp_fake)):
        torch.library.register_fake(f"ampkernels::{name}")(fake)


_extension.on_load(_register_extension_fakes)


# ---------------------------------------------------------------- the "torch" backend

def _eager_gated(x, wg, wu, bg, bu, activation):
    return reference.act_fwd(F.linear(x, wg, bg), activation) * F.linear(x, wu, bu)


def _torch_gated_linear_act(x, wg, wu, bg, bu, activation, cast_to, recompute):
    """The eager block with torch's own autograd nodes (F.linear casts under autocast), and what
    inductor fuses under torch.compile; recompute: under torch.utils.checkpoint."""
    wg, wu, bg, bu = torch_path_params((wg, wu, bg, bu), cast_to)
    if recompute:
        from torch.utils.checkpoint import checkpoint  # imported on first use: it is not light
        return checkpoint(_eager_gated, x, wg, wu, bg, bu, activation, use_reentrant=False, preserve_rng_state=False)
    return _eager_gated(x, wg, wu, bg, bu, activation)


# ---------------------------------------------------------------- "auto"

# cuda first, except Hopper inference in the medium bucket, where the Triton backend's ping-pong
# kernel (h straight from the GEMM's epilogue) runs first. ampkernels/bench/bench_gated_linear_act.py
# --dtype bfloat16 on an H100, ms, inference: 8192 x 1024 -> 2816 (medium) Triton 0.144 (SiLU and
# tanh GeGLU) against cuda 0.196, the packed matmul 0.133; 8192 x 4096 -> 11008 (large) Triton
# 2.56-2.60 against cuda 2.21-2.42. Training stays on cuda: 0.56 against 0.68 ms at the medium
# shape (the cuda backward); in the e2e benchmark the converted LLaMA-style step (bf16, eager) ran
# 39.4 ms on cuda against 52.4 triton-first, when Triton's autograd was still a Python Function.
_AUTO = ("cuda", "triton")
_TRITON_FIRST = {(9, "medium", False)}  # (compute capability major, bucket, training)


def preference(device, dtype, activation, bucket, training, compiling=False):
    """Backends "auto" tries, fastest first. compiling: as linear_act's preference."""
    if compiling:
        # inductor gets the eager decomposition (two GEMMs and one fused elementwise kernel), as
        # linear_act's preference does: opaque custom ops cost the compiled step host time
        return ("torch",)
    if torch.are_deterministic_algorithms_enabled():
        return ("cuda",)  # Triton's autotuner picks tiles by timing
    cc = device_properties(device_index(device)).major if device.type == "cuda" else 0
    return ("triton", "cuda") if (cc, bucket, bool(training)) in _TRITON_FIRST else _AUTO


# gemm_entry's table: the cells whose first preference is not cuda (the entry then declines and
# the Python path decides)
_NOT_CUDA_FIRST = {gemm_entry_key(la.ACT_ID[act], cc, dtype, bucket, training): False
                   for cc, bucket, training in _TRITON_FIRST for act in ACTIVATIONS
                   for dtype in (torch.float16, torch.bfloat16)}


@backends.assume_constant_result
def _choose(backend, device, dtype, activation, bucket, training, unsupported, compiling):
    # a host-side decision, a constant of the graph under torch.compile (as linear_act's _choose)
    return backends.select("gated_linear_act", backend, device,
                           preference(device, dtype, activation, bucket, training, compiling), unsupported)


# ---------------------------------------------------------------- functional API

_NAMES = ("x", "gate_weight", "up_weight", "gate_bias", "up_bias")


def _check_args(x, wg, wu, bg, bu):
    tensors = (x, wg, wu, bg, bu)
    for i, (name, t) in enumerate(zip(_NAMES, tensors)):
        if (t is None and i < 3) or (t is not None and not isinstance(t, Tensor)):
            raise TypeError(f"gated_linear_act: {name} must be a Tensor, got {type(t).__name__}")
    if wg.dim() != 2:
        raise ValueError(f"gated_linear_act: gate_weight must be 2-D (H, K), got shape {tuple(wg.shape)}")
    if wu.shape != wg.shape:
        raise ValueError(f"gated_linear_act: up_weight must have gate_weight's shape {tuple(wg.shape)}, "
                         f"got {tuple(wu.shape)}")
    if x.dim() < 1 or x.shape[-1] != wg.shape[1]:
        raise ValueError(f"gated_linear_act: x's last dim must equal the weights' K = {wg.shape[1]} "
                         f"(gate_weight shape {tuple(wg.shape)}), got x shape {tuple(x.shape)}")
    for name, b in (("gate_bias", bg), ("up_bias", bu)):
        if b is not None and (b.dim() != 1 or b.shape[0] != wg.shape[0]):
            raise ValueError(f"gated_linear_act: {name} must have shape ({wg.shape[0]},), got {tuple(b.shape)}")
    for name, t in zip(_NAMES, tensors):
        if t is not None and not t.is_floating_point():
            raise TypeError(f"gated_linear_act: {name} must be a floating-point tensor, got {t.dtype}")
        if t is not None and t.device != x.device:
            raise ValueError(f"gated_linear_act: {name} is on {t.device} but x is on {x.device}")


def _prepare(op, x, params, activation, backend):
    """The shared preamble of the functional APIs: (x, xk, params, cast_to, backend name, training):
    x in the compute dtype; for a kernel backend xk is x when it is made of contiguous rows (the op
    views them below autograd), else a contiguous (rows, K) copy, and the params are contiguous
    (a chunk of a packed weight stays a view)."""
    x, cast_to = autocast_dtypes(op, x, params, _NAMES[1:] + ("down_weight", "down_bias"),
                                 "x, the weights and the biases")
    k, hidden = x.shape[-1], params[0].shape[0]
    m = x.numel() // k if k else math.prod(x.shape[:-1])
    training = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, *params))
    compiling = torch.compiler.is_compiling()
    name = _choose(backend, x.device, x.dtype, activation, la.shape_bucket(m, 2 * hidden, k), training,
                   gemm_unsupported(x), compiling)
    xk = x
    if name != "torch":
        xk = x if x.is_contiguous() and not compiling else x.reshape(m, k).contiguous()
        params = tuple(None if t is None else t.contiguous() for t in params)
    return x, xk, params, cast_to, name, training


def gated_linear_act(x, gate_weight, up_weight, gate_bias=None, up_bias=None, activation="silu", *, backend=None,
                     recompute=False):
    """act(x @ gate_weight.T + gate_bias) * (x @ up_weight.T + up_bias) in one fused GEMM.

    x (..., K); gate_weight, up_weight (H, K); biases (H,) or None. activation: "silu" (SwiGLU),
    "gelu" (erf GeGLU) or "gelu_tanh" (tanh GeGLU). Dtypes as linear_act: fp16/bf16 run the
    kernels; under autocast, floating inputs are cast to the autocast dtype as F.linear casts
    them; other dtypes (autocast off) and CPU tensors take the torch path. recompute=True saves
    memory: backward recomputes g and u (the GEMMs) instead of keeping them.
    backend: None/"auto" | "cuda" | "triton" | "torch" (see ampkernels.backends).
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"gated_linear_act: activation must be one of {ACTIVATIONS}, got {activation!r}")
    if not recompute:  # the plain eager call, without the Python below (ops/shared.py gemm_entry)
        out = gemm_entry(GATED_LINEAR_ACT, x, (gate_weight, up_weight, gate_bias, up_bias),
                         la.ACT_ID[activation], backend, _NOT_CUDA_FIRST, la.BUCKET_BOUNDS)
        if out is not NotImplemented:
            return out
    _check_args(x, gate_weight, up_weight, gate_bias, up_bias)
    x, xk, (wg, wu, bg, bu), cast_to, name, training = _prepare(
        "gated_linear_act", x, (gate_weight, up_weight, gate_bias, up_bias), activation, backend)
    recompute = bool(recompute) and training and not torch.compiler.is_exporting()
    if name == "torch":
        return _torch_gated_linear_act(x, wg, wu, bg, bu, activation, cast_to, recompute)
    h = torch.ops.ampkernels.gated_linear_act.default(xk, wg, wu, bg, bu, reference.activation_id(activation),
                                                      cast_to, recompute, name)
    return h if xk is x else h.reshape(*x.shape[:-1], wg.shape[0])


def gated_mlp(x, gate_weight, up_weight, gate_bias, up_bias, down_weight, down_bias, activation="silu", *,
              backend=None):
    """F.linear(gated_linear_act(x, ...), down_weight, down_bias), keeping for backward only x, the
    weights and the (M, 2H) buffer of g and u: the down projection's input h is recomputed from
    them (training on the kernels). On the torch backend, the eager block."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"gated_mlp: activation must be one of {ACTIVATIONS}, got {activation!r}")
    out = gemm_entry(GATED_MLP, x, (gate_weight, up_weight, gate_bias, up_bias, down_weight, down_bias),
                     la.ACT_ID[activation], backend, _NOT_CUDA_FIRST, la.BUCKET_BOUNDS)
    if out is not NotImplemented:  # the plain eager call, without the Python below
        return out
    _check_args(x, gate_weight, up_weight, gate_bias, up_bias)
    if down_weight.dim() != 2 or down_weight.shape[1] != gate_weight.shape[0]:
        raise ValueError(f"gated_mlp: down_weight must be (N, {gate_weight.shape[0]}), got {tuple(down_weight.shape)}")
    if down_bias is not None and tuple(down_bias.shape) != (down_weight.shape[0],):
        raise ValueError(f"gated_mlp: down_bias must have shape ({down_weight.shape[0]},), got "
                         f"{tuple(down_bias.shape)}")
    params = (gate_weight, up_weight, gate_bias, up_bias, down_weight, down_bias)
    x, xk, params, cast_to, name, training = _prepare("gated_mlp", x, params, activation, backend)
    if name == "torch":
        wd, bd = torch_path_params(params[4:], cast_to)
        return F.linear(_torch_gated_linear_act(x, *params[:4], activation, cast_to, False), wd, bd)
    out = torch.ops.ampkernels.gated_mlp.default(xk, *params, reference.activation_id(activation), cast_to, name)
    return out if xk is x else out.reshape(*x.shape[:-1], down_weight.shape[0])
