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
  inputs without autocast, CPU tensors, and under torch.compile (inductor fuses it).
  recompute=True runs it through the Function below.

Saved for backward: x, the weights (compute dtype) and ONE buffer of the gated GEMM's output
size, gu = [g | u] (M, 2H) in the compute dtype; never h. recompute=True saves no gu and
recomputes it in backward. Backward: one fused elementwise pass dg = dh * u * act'(g),
du = dh * act(g) (+ fp32 column sums for the biases), written over gu itself when the Function
owns it (not when the graph is kept for another backward), then dx = dg Wg + du Wu (one GEMM
when packed), dWg = dg^T x and dWu = du^T x (fp32 straight from the GEMM for fp32 master
weights, linear_act.weight_grad).

Pieces, in the order data meets them: custom ops (forward, backward) with fake
implementations -> autograd Function (custom_fwd/custom_bwd) -> "auto" -> functional API.
"""
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import backends, reference
from . import linear_act as la
from .shared import autocast_dtypes, dies_with_this_backward, eager_call

_KERNEL_DTYPES = (torch.float16, torch.bfloat16)
ACTIVATIONS = reference.GATED_ACTIVATIONS


def packed_weights(wg, wu):
    """The (2H, K) matrix [wg; wu] as a view, when wu's memory begins where wg's ends (same
    shape, dtype, contiguous), else None: then one GEMM computes both products."""
    if (wg.shape != wu.shape or wg.dtype != wu.dtype or wg.device != wu.device or wg.numel() == 0
            or not wg.is_contiguous() or not wu.is_contiguous()):
        return None
    if (wu.untyped_storage().data_ptr() != wg.untyped_storage().data_ptr()
            or wu.storage_offset() != wg.storage_offset() + wg.numel()):
        return None
    h, k = wg.shape
    return wg.as_strided((2 * h, k), (k, 1))


def _gemms(x, wg, wu, bg, bu):
    """gu = [x Wg^T + bg | x Wu^T + bu] (M, 2H) in x's dtype, each half written by its GEMM."""
    m, h = x.shape[0], wg.shape[0]
    w = packed_weights(wg, wu)
    if w is not None and bg is None and bu is None:
        return x.mm(w.t())
    gu = x.new_empty(m, 2 * h)
    for i, (wt, b) in enumerate(((wg, bg), (wu, bu))):
        half = gu[:, i * h:(i + 1) * h]
        if b is None:
            torch.mm(x, wt.t(), out=half)
        else:
            torch.addmm(b, x, wt.t(), out=half)
    return gu


# ---------------------------------------------------------------- forward custom op

def fwd_impl(x, wg, wu, bg, bu, activation, store, backend):
    if backend == "cuda":
        return torch.ops.ampkernels.gated_linear_act_fwd_cuda(x, wg, wu, bg, bu, reference.activation_id(activation),
                                                              store)
    if backend == "triton":
        from ..triton import gated_linear_act as tk
        return tk.gated_linear_act_fwd(x, wg, wu, bg, bu, reference.activation_id(activation), store)
    with torch.autocast(x.device.type, enabled=False):
        gu = _gemms(x, wg, wu, bg, bu)
    h = reference.gated_act_into(gu, activation, x.new_empty(x.shape[0], wg.shape[0]))
    return h, (gu if store else x.new_empty(0, 0))


@torch.library.custom_op("ampkernels::gated_linear_act_fwd", mutates_args=())
def gated_linear_act_fwd(x: Tensor, wg: Tensor, wu: Tensor, bg: Optional[Tensor], bu: Optional[Tensor],
                         activation: str, store: bool, backend: str) -> tuple[Tensor, Tensor]:
    """(h, gu) for 2-D contiguous x (M, K), wg and wu (H, K); gu = [g | u] (M, 2H) in x's dtype
    when store, else an empty (0, 0) tensor."""
    return fwd_impl(x, wg, wu, bg, bu, activation, store, backend)


@gated_linear_act_fwd.register_fake
def _(x, wg, wu, bg, bu, activation, store, backend):
    m, h = x.shape[0], wg.shape[0]
    return x.new_empty(m, h), x.new_empty((m, 2 * h) if store else (0, 0))


# ---------------------------------------------------------------- backward custom op

def gated_act_backward_(dh, gu, out, activation, need_db, backend):
    """out = [dh * u * act'(g) | dh * act(g)] (out may be gu: in place); the fp32 column sums of
    out (2H,) when need_db, else None."""
    if backend == "cuda":
        db = torch.ops.ampkernels.gated_act_bwd_cuda(dh, gu, out, reference.activation_id(activation), need_db)
        return db if need_db else None
    if backend == "triton":
        from ..triton import gated_linear_act as tk
        return tk.gated_act_backward(dh, gu, out, reference.activation_id(activation), need_db)
    reference.gated_act_backward_into(dh, gu, activation, out)
    return out.sum(0, dtype=torch.float32) if need_db else None


def bwd_impl(dh, x, wg, wu, gu, activation, need_dx, wg_dtype, wu_dtype, bg_dtype, bu_dtype, backend,
             inplace=False):
    """(dx, dwg, dwu, dbg, dbu); a weight or bias gradient is an empty tensor when its dtype is
    None, dx when not need_dx. inplace: dg, du overwrite gu (the caller owns it)."""
    hidden = dh.shape[1]
    need_db = bg_dtype is not None or bu_dtype is not None
    dgu = gu if inplace else torch.empty_like(gu)
    db32 = gated_act_backward_(dh, gu, dgu, activation, need_db, backend)
    dg, du = dgu[:, :hidden], dgu[:, hidden:]
    empty = dh.new_empty(0)
    dx = empty
    if need_dx:
        w = packed_weights(wg, wu)
        if w is not None:
            dx = dgu.mm(w)
        else:
            dx = dg.mm(wg)
            dx.addmm_(du, wu)
    dwg = la.weight_grad(dg, x, wg_dtype).to(wg_dtype) if wg_dtype is not None else empty.clone()
    dwu = la.weight_grad(du, x, wu_dtype).to(wu_dtype) if wu_dtype is not None else empty.clone()
    # copies: outputs of a custom op may not share memory with each other
    dbg = db32[:hidden].to(bg_dtype, copy=True) if bg_dtype is not None else empty.clone()
    dbu = db32[hidden:].to(bu_dtype, copy=True) if bu_dtype is not None else empty.clone()
    return dx, dwg, dwu, dbg, dbu


@torch.library.custom_op("ampkernels::gated_linear_act_bwd", mutates_args=())
def gated_linear_act_bwd(dh: Tensor, x: Tensor, wg: Tensor, wu: Tensor, gu: Tensor, activation: str, need_dx: bool,
                         wg_dtype: Optional[torch.dtype], wu_dtype: Optional[torch.dtype],
                         bg_dtype: Optional[torch.dtype], bu_dtype: Optional[torch.dtype],
                         backend: str) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(dx, dwg, dwu, dbg, dbu) from dh (M, H) and gu = [g | u]; each gradient in the dtype
    given for it (empty when None; dx empty unless need_dx). Bias gradients summed in fp32."""
    return bwd_impl(dh, x, wg, wu, gu, activation, need_dx, wg_dtype, wu_dtype, bg_dtype, bu_dtype, backend)


@gated_linear_act_bwd.register_fake
def _(dh, x, wg, wu, gu, activation, need_dx, wg_dtype, wu_dtype, bg_dtype, bu_dtype, backend):
    def grad(shape, dt):
        return dh.new_empty(0) if dt is None else dh.new_empty(shape, dtype=dt)
    hidden = wg.shape[0]
    return (torch.empty_like(x) if need_dx else dh.new_empty(0), grad(wg.shape, wg_dtype), grad(wu.shape, wu_dtype),
            grad((hidden,), bg_dtype), grad((hidden,), bu_dtype))


def _fwd(x, wg, wu, bg, bu, activation, store, backend):
    if eager_call(x, wg, wu, bg, bu):
        return fwd_impl(x, wg, wu, bg, bu, activation, store, backend)
    return torch.ops.ampkernels.gated_linear_act_fwd(x, wg, wu, bg, bu, activation, store, backend)


# ---------------------------------------------------------------- autograd

def _cast_weights(wg, wu, dtype):
    """wg and wu cast to dtype as the two halves of ONE (2H, K) buffer: what two casts cost, and
    the GEMMs then see packed weights (one GEMM each way)."""
    h = wg.shape[0]
    w = torch.empty((2 * h, wg.shape[1]), dtype=dtype, device=wg.device)
    w[:h].copy_(wg)
    w[h:].copy_(wu)
    return w[:h], w[h:]


class GatedLinearActFunction(torch.autograd.Function):
    """Saves x, the weights (compute dtype) and gu (see the module docstring). cast_to: the
    compute dtype when the weights and biases are fp32 master weights (autocast); gradients come
    back in each parameter's own dtype."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    def forward(ctx, x, wg, wu, bg, bu, activation, backend, recompute, cast_to=None):
        ctx.dtypes = tuple(None if t is None else t.dtype for t in (wg, wu, bg, bu))
        if cast_to is not None:
            wg, wu = _cast_weights(wg, wu, cast_to)
            bg, bu = (None if b is None else b.to(cast_to) for b in (bg, bu))
        h, gu = _fwd(x, wg, wu, bg, bu, activation, not recompute, backend)
        ctx.save_for_backward(x, wg, wu, bg if recompute else None, bu if recompute else None,
                              None if recompute else gu)
        ctx.activation, ctx.backend, ctx.recompute = activation, backend, recompute
        return h

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, dh):
        x, wg, wu, bg, bu, gu = ctx.saved_tensors
        if ctx.recompute:
            _, gu = _fwd(x, wg, wu, bg, bu, ctx.activation, True, ctx.backend)
        need = ctx.needs_input_grad
        dtypes = [dt if need[i + 1] else None for i, dt in enumerate(ctx.dtypes)]
        args = (dh.contiguous(), x, wg, wu, gu, ctx.activation, need[0], *dtypes, ctx.backend)
        if eager_call(dh, x, wg, wu, gu):
            # dg, du over gu itself when nothing reads gu after this backward
            dx, dwg, dwu, dbg, dbu = bwd_impl(*args, inplace=ctx.recompute or dies_with_this_backward(gu))
        else:
            dx, dwg, dwu, dbg, dbu = torch.ops.ampkernels.gated_linear_act_bwd(*args)
        grads = [g if dt is not None else None for g, dt in zip((dwg, dwu, dbg, dbu), dtypes)]
        return (dx if need[0] else None, *grads, None, None, None, None)


# ---------------------------------------------------------------- "auto"

# cuda first, inference and training. Inference, from one H200 run of
# ampkernels/bench/bench_gated_linear_act.py --quick (bf16, SwiGLU, 8192 x 1024 -> 2816): packed
# cuBLAS 0.176 ms, two GEMMs 0.184, Triton 0.180, eager 0.203. Training: the cuda backend's
# autograd runs in C++ (gated_mlp_train_cuda); in the e2e benchmark the converted LLaMA-style
# step (bf16, eager) ran 39.4 ms on cuda against 52.4 triton-first (docs/performance.md), where
# the op alone was within noise of Triton.
_AUTO = ("cuda", "triton")


def preference(device, dtype, activation, bucket, training, compiling=False):
    """Backends "auto" tries, fastest first. compiling: as linear_act's preference."""
    if compiling:
        # inductor gets the eager decomposition (two GEMMs and one fused elementwise kernel), as
        # linear_act's preference does: opaque custom ops cost the compiled step host time
        return ("torch",)
    if torch.are_deterministic_algorithms_enabled():
        return ("cuda",)  # Triton's autotuner picks tiles by timing
    return _AUTO


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


def _prepare(op, x, params, activation, backend, recompute):
    """The shared preamble of the functional APIs: (x, x2, params, cast_to, backend name, training):
    x in the compute dtype, x2 its 2-D rows. params: (wg, wu, bg, bu[, more]); made contiguous
    when a kernel (or recompute) takes them."""
    device = x.device
    x, cast_to = autocast_dtypes(op, x, params, _NAMES[1:] + ("down_weight", "down_bias"),
                                 "x, the weights and the biases")
    k, hidden = x.shape[-1], params[0].shape[0]
    x2 = x if x.dim() == 2 else x.reshape(-1, k)
    unsupported = None if x.dtype in _KERNEL_DTYPES else f"dtype {x.dtype} is not float16/bfloat16"
    training = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x2, *params))
    name = _choose(backend, device, x.dtype, activation, la.shape_bucket(x2.shape[0], 2 * hidden, k),
                   training, unsupported, torch.compiler.is_compiling())
    if name != "torch" or recompute:  # the kernels' layout; a chunk of a packed weight stays a view
        x2 = x2.contiguous()
        params = tuple(None if t is None else t.contiguous() for t in params)
    return x, x2, params, cast_to, name, training


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
    _check_args(x, gate_weight, up_weight, gate_bias, up_bias)
    hidden = gate_weight.shape[0]
    _, x2, (wg, wu, bg, bu), cast_to, name, training = _prepare(
        "gated_linear_act", x, (gate_weight, up_weight, gate_bias, up_bias), activation, backend, recompute)
    if training and (name != "torch" or recompute):
        h = GatedLinearActFunction.apply(x2, wg, wu, bg, bu, activation, name, recompute, cast_to)
    elif training or name == "torch":
        # the eager block, with torch's own autograd nodes (F.linear casts under autocast), and
        # what inductor fuses under torch.compile
        h = reference.act_fwd(F.linear(x2, wg, bg), activation) * F.linear(x2, wu, bu)
    else:  # inference: nothing saved, no autograd node
        if cast_to is not None:
            wg, wu = _cast_weights(wg, wu, cast_to)
            bg, bu = (None if b is None else b.to(cast_to) for b in (bg, bu))
        h, _ = _fwd(x2, wg, wu, bg, bu, activation, False, name)
    return h if x.dim() == 2 else h.reshape(*x.shape[:-1], hidden)


# ---------------------------------------------------------------- the gated MLP block

def gated_act(gu, activation, backend):
    """h = act(g) * u from gu = [g | u] (M, 2H): the forward epilogue's formulas on the values it
    stored, so h is the forward's h bit for bit (cuda, Triton)."""
    hidden = gu.shape[1] // 2
    if backend == "cuda":
        return torch.ops.ampkernels.gated_act_fwd_cuda(gu, reference.activation_id(activation))
    if backend == "triton":
        from ..triton import gated_linear_act as tk
        return tk.gated_act_forward(gu, reference.activation_id(activation))
    return reference.gated_act_into(gu, activation, gu.new_empty(gu.shape[0], hidden))


class GatedMLPFunction(torch.autograd.Function):
    """down(act(x Wg^T + bg) * (x Wu^T + bu)) keeping x, the weights and gu only: h, the down
    projection's input, is recomputed from gu in backward (one elementwise pass) and freed before
    dh exists. Eager only (gated_mlp runs the unfused block under torch.compile)."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    def forward(ctx, x, wg, wu, bg, bu, wd, bd, activation, backend, cast_to=None):
        ctx.dtypes = tuple(None if t is None else t.dtype for t in (wg, wu, bg, bu, wd, bd))
        if cast_to is not None:
            wg, wu = _cast_weights(wg, wu, cast_to)
            bg, bu, wd, bd = (None if t is None else t.to(cast_to) for t in (bg, bu, wd, bd))
        h, gu = fwd_impl(x, wg, wu, bg, bu, activation, True, backend)
        out = F.linear(h, wd, bd)
        ctx.save_for_backward(x, wg, wu, wd, gu)
        ctx.activation, ctx.backend = activation, backend
        return out

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, dout):
        x, wg, wu, wd, gu = ctx.saved_tensors
        need = ctx.needs_input_grad
        dtypes = [dt if need[i + 1] else None for i, dt in enumerate(ctx.dtypes)]
        dout = dout.contiguous()
        # down projection: dWd from the recomputed h, freed before dh exists
        h = gated_act(gu, ctx.activation, ctx.backend)
        dwd = la.weight_grad(dout, h, dtypes[4]).to(dtypes[4]) if dtypes[4] is not None else None
        del h
        dbd = dout.sum(0, dtype=torch.float32).to(dtypes[5]) if dtypes[5] is not None else None
        dh = dout.mm(wd)
        dx, dwg, dwu, dbg, dbu = bwd_impl(dh, x, wg, wu, gu, ctx.activation, need[0], *dtypes[:4], ctx.backend,
                                          inplace=dies_with_this_backward(gu))
        grads = [g if dt is not None else None for g, dt in zip((dwg, dwu, dbg, dbu), dtypes)]
        return (dx if need[0] else None, *grads, dwd, dbd, None, None, None)


def gated_mlp(x, gate_weight, up_weight, gate_bias, up_bias, down_weight, down_bias, activation="silu", *,
              backend=None):
    """F.linear(gated_linear_act(x, ...), down_weight, down_bias), keeping for backward only x, the
    weights and the (M, 2H) buffer of g and u: the down projection's input h is recomputed from
    them (eager training on the kernels). Otherwise -- inference, the torch path, torch.compile --
    it is gated_linear_act followed by F.linear."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"gated_mlp: activation must be one of {ACTIVATIONS}, got {activation!r}")
    _check_args(x, gate_weight, up_weight, gate_bias, up_bias)
    if down_weight.dim() != 2 or down_weight.shape[1] != gate_weight.shape[0]:
        raise ValueError(f"gated_mlp: down_weight must be (N, {gate_weight.shape[0]}), got {tuple(down_weight.shape)}")
    if down_bias is not None and tuple(down_bias.shape) != (down_weight.shape[0],):
        raise ValueError(f"gated_mlp: down_bias must have shape ({down_weight.shape[0]},), got "
                         f"{tuple(down_bias.shape)}")
    if torch.compiler.is_compiling() or not torch.is_grad_enabled():
        h = gated_linear_act(x, gate_weight, up_weight, gate_bias, up_bias, activation, backend=backend)
        return F.linear(h, down_weight, down_bias)
    params = (gate_weight, up_weight, gate_bias, up_bias, down_weight, down_bias)
    xc, x2, params, cast_to, name, training = _prepare("gated_mlp", x, params, activation, backend, False)
    if name == "torch" or not training or not eager_call(x2, *params):
        h = gated_linear_act(x, gate_weight, up_weight, gate_bias, up_bias, activation, backend=backend)
        return F.linear(h, down_weight, down_bias)
    if name == "cuda":
        # autograd in C++ (csrc/ops.cpp), x of any rank: neither pass runs Python per call, and no
        # reshape adds autograd nodes around it
        return torch.ops.ampkernels.gated_mlp_train_cuda.default(xc.contiguous(), *params,
                                                                 reference.activation_id(activation), cast_to)
    out = GatedMLPFunction.apply(x2, *params, activation, name, cast_to)
    # no reshape of 2-D x: a view would add an autograd node per call
    return out if x.dim() == 2 else out.reshape(*x.shape[:-1], down_weight.shape[0])
