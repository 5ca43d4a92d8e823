"""linear_act: y = act(x @ weight.T + bias), forward and backward, fused.

Backends:
- "cuda": cuBLASLt with fused epilogues (csrc/linear_act.cu, section linear_act of
  csrc/ops.cpp): bias, ReLU and GELU(tanh) (+ the pre-activation as aux output) in the GEMM
  epilogue; backward: dz = dy*act'(pre) and dbias in one pass (bias_act_backward), then the
  two GEMMs (identity: dbias fused into the weight-gradient GEMM, BGRADB). Activations
  cuBLASLt has no epilogue for (erf GELU, SiLU, squared ReLU) run GEMM+bias, then the fused
  bias_act kernel in place. Inputs cuBLASLt cannot take fused (pointers not 16-byte aligned,
  N or K not multiples of 8) run the explicit fallback: at::mm + the bias_act kernel.
- "triton": ampkernels/triton/linear_act.py, a persistent matmul with bias + activation in
  the epilogue for every activation; backward: one fused dz = dy*act'(pre) + dbias pass, then
  the two GEMMs on cuBLAS.
- "torch": eager F.linear + activation in the compute dtype (the unfused baseline, trained
  with torch's own autograd, so it saves what eager saves); for fp32/fp64 inputs (autocast
  off), CPU tensors, and where "auto" measured it fastest. recompute=True runs it through the
  Function below.

Saved for backward by the kernels: x, weight and one hidden-sized tensor in the compute dtype: the
pre-activation, or for ReLU its output (y > 0 exactly where pre > 0), or nothing for identity;
never both pre- and post-activation. recompute=True saves no hidden-sized tensor and recomputes
the pre-activation (one GEMM) in backward. dbias is accumulated in fp32.

Pieces, in the order data meets them: custom ops (forward, backward) with fake
implementations -> autograd Function (custom_fwd/custom_bwd) -> "auto" table -> functional API.
"""
import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import backends, reference
from .shared import autocast_dtypes, eager_call
from ..triton import device_index, device_properties

_KERNEL_DTYPES = (torch.float16, torch.bfloat16)
_ACT_SET = frozenset(reference.ACTIVATIONS)


def _eager(x, weight, bias, activation):
    """(pre, y) the unfused way: F.linear then the activation, both in x's dtype."""
    z = F.linear(x, weight, bias)
    return z, reference.act_fwd(z, activation)


# ---------------------------------------------------------------- forward custom op

def fwd_impl(x, weight, bias, activation, store_pre, backend):
    act = reference.activation_id(activation)
    if backend == "cuda":
        return torch.ops.ampkernels.linear_act_fwd_cuda(x, weight, bias, act, store_pre, True)
    if backend == "triton":
        from ..triton import linear_act as tk
        return tk.linear_act_fwd(x, weight, bias, act, store_pre)
    if torch.is_autocast_enabled(x.device.type):
        with torch.autocast(x.device.type, enabled=False):
            z, y = _eager(x, weight, bias, activation)
    else:
        z, y = _eager(x, weight, bias, activation)
    pre = z.clone() if store_pre and activation == "identity" else z  # outputs must not alias
    return y.contiguous(), (pre.contiguous() if store_pre else x.new_empty(0, 0))


@torch.library.custom_op("ampkernels::linear_act_fwd", mutates_args=())
def linear_act_fwd(x: Tensor, weight: Tensor, bias: Optional[Tensor], activation: str, store_pre: bool,
                   backend: str) -> tuple[Tensor, Tensor]:
    """(y, pre) for 2-D contiguous x (M, K), weight (N, K); pre = x W^T + b in x's dtype when
    store_pre, else an empty (0, 0) tensor."""
    return fwd_impl(x, weight, bias, activation, store_pre, backend)


@linear_act_fwd.register_fake
def _(x, weight, bias, activation, store_pre, backend):
    m, n = x.shape[0], weight.shape[0]
    return x.new_empty(m, n), x.new_empty((m, n) if store_pre else (0, 0))


# ---------------------------------------------------------------- backward custom op

_MM_OUT_DTYPE = hasattr(torch.ops.aten.mm, "dtype")  # torch >= 2.8 on CUDA: fp16/bf16 GEMM writing fp32


def weight_grad(dz, inp, dtype):
    """dz.T @ inp: in `dtype` straight from the GEMM where torch can write it (fp32 master
    weights under autocast: the accumulator itself, no fp16/bf16 copy and no cast kernel, which
    took ~0.2 ms for a 4096x16384 weight on the H200); else in dz's dtype, for the caller to
    cast (fused_mlp: once dz is freed)."""
    if dtype == torch.float32 and dz.dtype != dtype and dz.is_cuda and _MM_OUT_DTYPE:
        return torch.mm(dz.t(), inp, out_dtype=dtype)
    return dz.t().mm(inp)


def bwd_impl(dy, x, weight, saved, activation, need_dx, need_dw, need_db, backend, grad_dtype=None):
    act = reference.activation_id(activation)
    # identity with master weights takes the generic path below on every backend: dweight in
    # fp32 from torch's GEMM saves more than cuBLASLt's fused bias gradient (a 20 us sum)
    if backend == "cuda" and (grad_dtype is None or activation != "identity"):
        s = saved if saved is not None else dy.new_empty(0)
        dx, dw, db = torch.ops.ampkernels.linear_act_bwd_cuda(dy, x, weight, s, act, need_dx, need_dw, need_db, True)
        if grad_dtype is not None:
            dw, db = (dw.to(grad_dtype) if need_dw else dw), (db.to(grad_dtype) if need_db else db)
        return dx, dw, db
    if backend == "triton":
        from ..triton import linear_act as tk
        if activation != "identity":
            dz, db32 = tk.linear_act_dz(dy, saved, act, need_db)
        else:
            dz, db32 = dy, (tk.column_sums(dy) if need_db else None)
    else:
        ct = torch.float32 if dy.dtype in _KERNEL_DTYPES else dy.dtype
        # dy is autograd's gradient, which other nodes may read: dz gets its own tensor
        dz = dy if activation == "identity" else reference.act_backward_into(dy, saved, activation,
                                                                             torch.empty_like(dy))
        db32 = dz.sum(0, dtype=ct) if need_db else None
    empty = dy.new_empty(0)
    grad_dtype = grad_dtype or dy.dtype
    # no autocast guard needed: dz, weight and x share the compute dtype, which the functional
    # API made the autocast dtype, so autocast would not cast them
    dx = dz.mm(weight) if need_dx else empty
    dw = weight_grad(dz, x, grad_dtype).to(grad_dtype) if need_dw else empty.clone()
    db = db32.to(grad_dtype) if need_db else empty.clone()
    return dx, dw, db


def act_backward_(dy, saved, activation, need_db, backend):
    """dy *= act'(saved), IN PLACE, and the fp32 column sums of the result (None unless need_db).

    For callers that own dy (fused_mlp's backward, on its dh temporary): the act' pass then
    needs no second hidden-sized buffer. linear_act's own backward never calls it: there dy is
    autograd's gradient, which the user or other nodes may still read."""
    if backend == "cuda":
        db = torch.ops.ampkernels.act_backward_cuda_(dy, saved, reference.activation_id(activation), need_db)
        return db if need_db else None
    if backend == "triton":
        from ..triton import linear_act as tk
        return tk.linear_act_dz(dy, saved, reference.activation_id(activation), need_db, out=dy)[1]
    reference.act_backward_into(dy, saved, activation, dy)
    return dy.sum(0, dtype=torch.float32) if need_db else None


@torch.library.custom_op("ampkernels::linear_act_bwd", mutates_args=())
def linear_act_bwd(dy: Tensor, x: Tensor, weight: Tensor, saved: Optional[Tensor], activation: str, need_dx: bool,
                   need_dw: bool, need_db: bool, backend: str,
                   grad_dtype: Optional[torch.dtype] = None) -> tuple[Tensor, Tensor, Tensor]:
    """(dx, dweight, dbias), each an empty (0,) tensor when not needed.

    saved: the pre-activation (or ReLU's output; None for identity). dbias accumulated in fp32.
    dweight and dbias in grad_dtype (the master weights' dtype under autocast), else x's."""
    return bwd_impl(dy, x, weight, saved, activation, need_dx, need_dw, need_db, backend, grad_dtype)


@linear_act_bwd.register_fake
def _(dy, x, weight, saved, activation, need_dx, need_dw, need_db, backend, grad_dtype=None):
    m, k, n = x.shape[0], x.shape[1], weight.shape[0]
    gd = grad_dtype or x.dtype
    return (x.new_empty((m, k) if need_dx else (0,)), x.new_empty((n, k), dtype=gd) if need_dw else x.new_empty(0),
            x.new_empty((n,), dtype=gd) if need_db else x.new_empty(0))


def _fwd(x, weight, bias, activation, store_pre, backend):
    if eager_call(x, weight, bias):
        return fwd_impl(x, weight, bias, activation, store_pre, backend)
    return torch.ops.ampkernels.linear_act_fwd(x, weight, bias, activation, store_pre, backend)


def _bwd(dy, x, weight, saved, activation, need_dx, need_dw, need_db, backend, grad_dtype):
    if eager_call(dy, x, weight, saved):
        return bwd_impl(dy, x, weight, saved, activation, need_dx, need_dw, need_db, backend, grad_dtype)
    return torch.ops.ampkernels.linear_act_bwd(dy, x, weight, saved, activation, need_dx, need_dw, need_db, backend,
                                               grad_dtype)


# ---------------------------------------------------------------- autograd

class LinearActFunction(torch.autograd.Function):
    """Saves x, weight (in the compute dtype) and one hidden-sized tensor (see the module
    docstring). cast_to: the compute dtype when weight and bias are fp32 master weights
    (autocast); they are cast here, and their gradients come back in the weight's dtype."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    def forward(ctx, x, weight, bias, activation, backend, recompute, cast_to=None):
        grad_dtype = None
        if cast_to is not None:
            grad_dtype = weight.dtype
            weight, bias = weight.to(cast_to), None if bias is None else bias.to(cast_to)
        saves_hidden = activation != "identity" and not recompute
        store_pre = saves_hidden and activation != "relu"
        y, pre = _fwd(x, weight, bias, activation, store_pre, backend)
        saved = (pre if store_pre else y) if saves_hidden else None
        ctx.save_for_backward(x, weight, bias if recompute else None, saved)
        ctx.activation, ctx.backend, ctx.recompute, ctx.has_bias = activation, backend, recompute, bias is not None
        ctx.grad_dtype = grad_dtype
        return y

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, dy):
        x, weight, bias, saved = ctx.saved_tensors
        if ctx.recompute and ctx.activation != "identity":
            saved, _ = _fwd(x, weight, bias, "identity", False, ctx.backend)
        need_dx, need_dw, need_db = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        dx, dw, db = _bwd(dy.contiguous(), x, weight, saved, ctx.activation, need_dx, need_dw,
                          need_db and ctx.has_bias, ctx.backend, ctx.grad_dtype)
        return (dx if need_dx else None, dw if need_dw else None, db if need_db and ctx.has_bias else None,
                None, None, None, None)


# ---------------------------------------------------------------- "auto"

# "auto": backends to try, fastest first, per (compute capability major, dtype, activation,
# shape bucket, training). Filled from one full H200 run of ampkernels/bench/bench_linear_act.py
# (benchmarks/results/h200-2026-12-01-9836fa4-linear-act.jsonl): per cell the fastest of cuda /
# triton / torch (eager F.linear + activation) over the bucket's shapes, times summed; a fused
# kernel within 1% of eager counts as a tie and is kept. `python -m ampkernels.bench.bench_linear_act
# --auto-table FILE [FILE ...]` prints the rows below from a run; tests/test_cli.py checks them.
# Buckets by M*N*K: "small" < 2^34 (4096x768x3072), "medium" < 2^37 (8192x1024x4096), "large"
# (8192x4096x{4096,16384}).
# Not measured (identity, squared_relu, other GPUs): the default, cuBLASLt first -- its fused
# epilogues cost nothing for bias/relu/gelu_tanh, and its unfused path (GEMM+bias, then the
# activation in place) does the same work as eager.
# Why "torch" wins some cells: small shapes are host-bound (a fwd+bwd of linear_act costs the
# host 310-440 us, eager 260-290), and for erf-GELU/SiLU the cuda path is GEMM + activation pass,
# like eager. Host-bound training cells can flip between runs with the host's jitter; the GPU
# time alone (CUDA-graph replay) favours cuda.
_AUTO_DEFAULT = ("cuda", "triton")
_C, _T, _E = ("cuda", "triton"), ("triton", "cuda"), ("torch",)
_ACT_COLUMNS = ("gelu_tanh", "relu", "gelu", "silu")
_MEASURED = {  # (dtype, bucket, training): preferences for _ACT_COLUMNS
    (torch.bfloat16, "small", False): (_C, _C, _C, _E),
    (torch.bfloat16, "medium", False): (_C, _C, _T, _E),
    (torch.bfloat16, "large", False): (_T, _T, _T, _T),
    (torch.bfloat16, "small", True): (_E, _E, _C, _E),
    (torch.bfloat16, "medium", True): (_C, _C, _E, _E),
    (torch.bfloat16, "large", True): (_T, _T, _T, _T),
    (torch.float16, "small", False): (_C, _C, _C, _C),
    (torch.float16, "medium", False): (_C, _C, _T, _E),
    (torch.float16, "large", False): (_C, _C, _T, _T),
    (torch.float16, "small", True): (_E, _E, _C, _E),
    (torch.float16, "medium", True): (_C, _C, _C, _E),
    (torch.float16, "large", True): (_T, _T, _T, _T),
}
_AUTO_TABLE: dict = {(9, dtype, act, bucket, training): pref
                     for (dtype, bucket, training), prefs in _MEASURED.items()
                     for act, pref in zip(_ACT_COLUMNS, prefs)}


def shape_bucket(m, n, k):
    work = m * n * k
    return "small" if work < (1 << 34) else "medium" if work < (1 << 37) else "large"


def auto_preference(device, dtype, activation, m, n, k, training=False):
    """Backends "auto" tries for this call, fastest first (measured where _AUTO_TABLE has it)."""
    return preference(device, dtype, activation, shape_bucket(m, n, k), training)


def preference(device, dtype, activation, bucket, training, compiling=False):
    """compiling: torch.compiler.is_compiling() as the traced caller sees it (see _choose)."""
    if compiling:
        # inductor gets F.linear + the activation: as opaque custom ops our kernels cost the
        # compiled step 200-400 us of host each (docs/performance.md)
        return ("torch",)
    cc = device_properties(device_index(device)).major if device.type == "cuda" else 0
    pref = _AUTO_TABLE.get((cc, dtype, activation, bucket, training), _AUTO_DEFAULT)
    if torch.are_deterministic_algorithms_enabled():
        # Triton's autotuner picks tiles by timing, so the bits may differ between processes;
        # the cuda backend then keeps cuBLASLt's first heuristic pick (csrc/linear_act.cu)
        pref = tuple(b for b in pref if b != "triton") or ("cuda",)
    return pref


@backends.assume_constant_result
def _choose(backend, device, dtype, activation, bucket, training, unsupported, compiling):
    # A host-side decision (environment, availability probes, the table): under torch.compile
    # it runs once at trace time and the name is baked into the graph, never traced. Dynamo
    # runs it as plain Python, where torch before 2.14 says is_compiling() is False: the traced
    # caller passes `compiling` in.
    return backends.select("linear_act", backend, device,
                           preference(device, dtype, activation, bucket, training, compiling), unsupported)


# ---------------------------------------------------------------- functional API

def _check_args(x, weight, bias):
    # kept cheap: it runs on every call, and small GEMMs take less GPU time than a Python call
    if not isinstance(x, Tensor) or not isinstance(weight, Tensor) or not (bias is None or isinstance(bias, Tensor)):
        name, t = next((n, t) for n, t in (("x", x), ("weight", weight), ("bias", bias))
                       if t is not None and not isinstance(t, Tensor))
        raise TypeError(f"linear_act: {name} must be a Tensor, got {type(t).__name__}")
    if weight.dim() != 2:
        raise ValueError(f"linear_act: weight must be 2-D (N, K), got shape {tuple(weight.shape)}")
    if x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"linear_act: x's last dim must equal weight's K = {weight.shape[1]} "
                         f"(weight shape {tuple(weight.shape)}), got x shape {tuple(x.shape)}")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != weight.shape[0]):
        raise ValueError(f"linear_act: bias must have shape ({weight.shape[0]},), got {tuple(bias.shape)}")
    if not (x.is_floating_point() and weight.is_floating_point() and (bias is None or bias.is_floating_point())):
        name, t = next((n, t) for n, t in (("x", x), ("weight", weight), ("bias", bias))
                       if t is not None and not t.is_floating_point())
        raise TypeError(f"linear_act: {name} must be a floating-point tensor, got {t.dtype}")
    dev = x.device
    if weight.device != dev:
        raise ValueError(f"linear_act: weight is on {weight.device} but x is on {dev}")
    if bias is not None and bias.device != dev:
        raise ValueError(f"linear_act: bias is on {bias.device} but x is on {dev}")


def linear_act(x, weight, bias=None, activation="gelu_tanh", *, backend=None, recompute=False):
    """act(x @ weight.T + bias) with the activation fused into the matmul.

    x (..., K); weight (N, K); bias (N,) or None. activation: one of reference.ACTIVATIONS.
    fp16/bf16 run the kernels; under autocast, floating inputs are cast to the autocast dtype
    exactly as F.linear casts them; other dtypes (autocast off) take the torch path.
    recompute=True saves memory: backward recomputes the pre-activation instead of keeping it.
    backend: None/"auto" | "cuda" | "triton" | "torch" (see ampkernels.backends).
    """
    if activation not in _ACT_SET:
        reference.activation_id(activation)  # raises, naming the choices
    _check_args(x, weight, bias)
    device = x.device
    x, cast_to = autocast_dtypes("linear_act", x, (weight, bias), ("weight", "bias"))
    k, n = x.shape[-1], weight.shape[0]
    m = x.shape[0] if x.dim() == 2 else x.numel() // k if k else math.prod(x.shape[:-1])
    unsupported = None if x.dtype in _KERNEL_DTYPES else f"dtype {x.dtype} is not float16/bfloat16"
    training = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad or
                                            (bias is not None and bias.requires_grad))
    compiling = torch.compiler.is_compiling()
    name = _choose(backend, device, x.dtype, activation, shape_bucket(m, n, k), training, unsupported, compiling)
    if recompute and torch.compiler.is_exporting():
        recompute = False  # a memory option of training; the exported graph gets F.linear + the activation
    if name != "torch" or recompute:  # the kernels take contiguous tensors; F.linear any strides
        weight = weight.contiguous()
        bias = None if bias is None else bias.contiguous()
    if training and name == "cuda" and not recompute and (cast_to is None or activation != "identity") \
            and eager_call(x, weight, bias):
        # autograd in C++ (csrc/ops.cpp), x of any rank: neither pass runs Python per call, and no
        # reshape adds autograd nodes around it
        return torch.ops.ampkernels.linear_act_train_cuda.default(x.contiguous(), weight, bias,
                                                                  reference.activation_id(activation), cast_to)
    x2 = x if x.dim() == 2 else x.reshape(-1, k)
    if name != "torch" or recompute:
        x2 = x2.contiguous()
    if training and (name != "torch" or recompute):
        # the Function casts master weights itself, so that their gradients come back in their
        # own dtype straight from the GEMM
        y = LinearActFunction.apply(x2, weight, bias, activation, name, recompute, cast_to)
    else:
        if cast_to is not None:
            weight, bias = weight.to(cast_to), None if bias is None else bias.to(cast_to)
        if training or name == "torch":
            # the unfused baseline as eager runs it, with torch's own autograd nodes (a C++ GELU
            # backward, not a Python one), and what inductor fuses under torch.compile
            y = reference.act_fwd(F.linear(x2, weight, bias), activation)
        else:  # inference: nothing saved, no autograd node
            y, _ = _fwd(x2, weight, bias, activation, False, name)
    return y if x.dim() == 2 else y.reshape(*x.shape[:-1], n)
