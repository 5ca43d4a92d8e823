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
- "torch": F.linear + the activation in the compute dtype under torch's autograd (the unfused
  baseline, what eager saves, and what inductor fuses under torch.compile); recompute=True runs
  it under torch.utils.checkpoint. For fp32/fp64 inputs (autocast off), CPU tensors, and where
  "auto" measured it fastest.

Saved for backward by the kernels: x, weight and one hidden-sized tensor in the compute dtype: the
pre-activation, or for ReLU its output (y > 0 exactly where pre > 0), or nothing for identity;
never both pre- and post-activation. recompute=True saves no hidden-sized tensor and recomputes
the pre-activation (one GEMM) in backward. dbias is accumulated in fp32.

One op, eager and compiled: `torch.ops.ampkernels.linear_act` (csrc/ops.cpp: its schema and its
autograd, in C++ so that neither pass runs Python per call), reaching each backend's kernels as
the ops linear_act_{fwd,bwd}_cuda and act_backward_cuda_ (the extension) and the *_triton ops
registered here. Their fakes are here. The kernel backends need the extension.
"""
import math
import torch
import torch.nn.functional as F
from torch import Tensor

from .. import _extension, backends, reference
from .shared import (BUCKETS, LINEAR_ACT, autocast_dtypes, gemm_entry, gemm_entry_key, gemm_unsupported,
                     guard_or_false, kernel_op, torch_path_params)
from ..triton import device_index, device_properties

ACT_ID = {name: i for i, name in enumerate(reference.ACTIVATIONS)}


def _triton():
    from ..triton import linear_act as tk  # imported on first use: triton is optional
    return tk


def _fp32_empty(t):
    return t.new_empty(0, dtype=torch.float32)


# ---------------------------------------------------------------- the kernel ops' fakes

def _fwd_fake(x, weight, bias, activation, store_pre, fuse=True):
    m, n = x.shape[0], weight.shape[0]
    return x.new_empty(m, n), x.new_empty((m, n) if store_pre else (0, 0))


def _bwd_fake(dy, x, weight, saved, activation, need_dx, need_dw, need_db, fuse):
    m, k, n = x.shape[0], x.shape[1], weight.shape[0]
    return (x.new_empty((m, k) if need_dx else (0,)), x.new_empty((n, k) if need_dw else (0,)),
            x.new_empty((n,) if need_db else (0,)))


def _dz_fake(dy, saved, activation, need_db):
    db = dy.new_empty(dy.shape[1] if need_db else 0, dtype=torch.float32)
    return (dy.new_empty(0) if activation == 0 else torch.empty_like(dy)), db


def _act_bwd_fake(dy, saved, activation, need_db):
    return dy.new_empty(dy.shape[1] if need_db else 0, dtype=torch.float32)


def _linear_act_fake(x, weight, bias, activation, cast_to, recompute, backend):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


# ---------------------------------------------------------------- the Triton kernels, as ops

@kernel_op("linear_act_fwd_triton(Tensor x, Tensor weight, Tensor? bias, int activation, bool store_pre) "
           "-> (Tensor y, Tensor pre)", _fwd_fake)
def linear_act_fwd_triton(x, weight, bias, activation, store_pre):
    """(y, pre) for 2-D contiguous x (M, K), weight (N, K); pre = x W^T + b in x's dtype when
    store_pre, else an empty (0, 0) tensor (as linear_act_fwd_cuda)."""
    return _triton().linear_act_fwd(x, weight, bias, activation, store_pre)


@kernel_op("linear_act_dz_triton(Tensor dy, Tensor saved, int activation, bool need_db) -> (Tensor dz, Tensor dbias)",
           _dz_fake)
def linear_act_dz_triton(dy, saved, activation, need_db):
    """(dz, dbias): dz = dy * act'(saved) in dy's dtype, empty for identity (dz is dy itself);
    dbias the fp32 column sums of dz in a fixed order, empty unless need_db."""
    tk = _triton()
    if activation == 0:
        return dy.new_empty(0), tk.column_sums(dy) if need_db else _fp32_empty(dy)
    dz, db = tk.linear_act_dz(dy, saved, activation, need_db)
    return dz, db if need_db else _fp32_empty(dy)


@kernel_op("act_fwd_triton(Tensor pre, int activation) -> Tensor", lambda pre, activation: torch.empty_like(pre))
def act_fwd_triton(pre, activation):
    """act(pre) by the forward epilogue's formulas: the forward's output bit for bit."""
    return _triton().act_forward(pre, activation)


@kernel_op("act_backward_triton_(Tensor(a!) dy, Tensor saved, int activation, bool need_db) -> Tensor dbias",
           _act_bwd_fake)
def act_backward_triton_(dy, saved, activation, need_db):
    """dy *= act'(saved) IN PLACE; the fp32 column sums of the result, empty unless need_db
    (as act_backward_cuda_)."""
    db = _triton().linear_act_dz(dy, saved, activation, need_db, out=dy)[1]
    return db if need_db else _fp32_empty(dy)


def _register_extension_fakes():
    torch.library.register_fake("ampkernels::linear_act_fwd_cuda")(_fwd_fake)
    torch.library.register_fake("ampkernels::linear_act_bwd_cuda")(_bwd_fake)
    torch.library.register_fake("ampkernels::act_backward_cuda_")(_act_bwd_fake)
    torch.library.register_fake("ampkernels::linear_act")(_linear_act_fake)


_extension.on_load(_register_extension_fakes)


# ---------------------------------------------------------------- the "torch" backend

def _linear_then_act(x, weight, bias, activation):
    return reference.act_fwd(F.linear(x, weight, bias), activation)


def _torch_linear_act(x, weight, bias, activation, cast_to, recompute):
    """F.linear + the activation with torch's own autograd nodes (a C++ GELU backward, not a
    Python one); recompute: under torch.utils.checkpoint, which keeps x and the weights only and
    recomputes the rest in backward."""
    weight, bias = torch_path_params((weight, bias), cast_to)
    if recompute:
        from torch.utils.checkpoint import checkpoint  # imported on first use: it is not light
        return checkpoint(_linear_then_act, x, weight, bias, activation, use_reentrant=False,
                          preserve_rng_state=False)
    return _linear_then_act(x, weight, bias, activation)


# ---------------------------------------------------------------- "auto"

# "auto": backends to try, fastest first, per (compute capability major, dtype, activation,
# shape bucket, training). Filled from one full H200 run of ampkernels/bench/bench_linear_act.py
# (its rows: docs/performance.md, linear_act section) and, for the tiny bucket, a run of its two
# tiny shapes on an H100 (sm_90 as well): per cell the fastest of cuda /
# triton / torch (eager F.linear + activation) over the bucket's shapes, times summed; a fused
# kernel within 1% of eager counts as a tie and is kept. `python -m ampkernels.bench.bench_linear_act
# --auto-table FILE [FILE ...]` prints the rows below from a run; tests/test_cli.py checks them.
# Buckets by M*N*K: "tiny" < 2^32 (128x768x3072, 1024x480x1024: less GPU work than a call's
# host time), "small" < 2^34 (4096x768x3072), "medium" < 2^37 (8192x1024x4096), "large"
# (8192x4096x{4096,16384}).
# Not measured (identity, squared_relu, other GPUs, a bucket the run lacks): the default,
# cuBLASLt first -- its fused epilogues cost nothing for bias/relu/gelu_tanh, its unfused path
# (GEMM+bias, then the activation in place) does the same work as eager, and its call costs the
# host less than F.linear + the activation (`ampkernels bench --op host`), which is what decides
# a tiny call.
# Why "torch" wins some cells: for erf-GELU/SiLU the cuda path is GEMM + activation pass, like
# eager, and small training cells sit near the host bound, where they flip between runs with the
# host's jitter; the GPU time alone (CUDA-graph replay) favours cuda.
_AUTO_DEFAULT = ("cuda", "triton")
_C, _T, _E = ("cuda", "triton"), ("triton", "cuda"), ("torch",)
_ACT_COLUMNS = ("gelu_tanh", "relu", "gelu", "silu")
_MEASURED = {  # (dtype, bucket, training): preferences for _ACT_COLUMNS
    (torch.bfloat16, "tiny", False): (_C, _C, _E, _E),
    (torch.bfloat16, "tiny", True): (_C, _C, _C, _C),
    (torch.float16, "tiny", False): (_C, _C, _E, _E),
    (torch.float16, "tiny", True): (_C, _E, _C, _C),
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


BUCKET_BOUNDS = (1 << 32, 1 << 34, 1 << 37)  # M*N*K below which a call is "tiny", "small", "medium"


def shape_bucket(m, n, k):
    # traced by dynamo (bisect is not); a row count known only at run time (masked-LM rows under
    # torch.compile, where the bucket decides nothing) counts as below every bound
    work = m * n * k
    return BUCKETS[sum(guard_or_false(work >= bound) for bound in BUCKET_BOUNDS)]


def not_cuda_first(first):
    """gemm_entry's table (ops/shared.py): the keys of the cells where first(preference) is not
    "cuda", each mapped to whether it is "torch". linear_act's entry runs a torch-first cell
    itself (F.linear + the activation); other cells there, and the other ops, decline and the
    Python path decides. Cells outside the table take _AUTO_DEFAULT, cuda first."""
    return {gemm_entry_key(reference.activation_id(act), cc, dtype, bucket, training): first(pref) == "torch"
            for (cc, dtype, act, bucket, training), pref in _AUTO_TABLE.items() if first(pref) != "cuda"}


_NOT_CUDA_FIRST = not_cuda_first(lambda pref: pref[0])


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
    if activation not in ACT_ID:
        reference.activation_id(activation)  # raises, naming the choices
    if not recompute:  # the plain eager call, without the Python below (ops/shared.py gemm_entry)
        out = gemm_entry(LINEAR_ACT, x, (weight, bias), ACT_ID[activation], backend, _NOT_CUDA_FIRST,
                         BUCKET_BOUNDS)
        if out is not NotImplemented:
            return out
    _check_args(x, weight, bias)
    device = x.device
    x, cast_to = autocast_dtypes("linear_act", x, (weight, bias), ("weight", "bias"))
    k, n = x.shape[-1], weight.shape[0]
    m = x.shape[0] if x.dim() == 2 else x.numel() // k if k else math.prod(x.shape[:-1])
    training = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad or
                                            (bias is not None and bias.requires_grad))
    compiling = torch.compiler.is_compiling()
    name = _choose(backend, device, x.dtype, activation, shape_bucket(m, n, k), training, gemm_unsupported(x),
                   compiling)
    # a memory option of training; an exported graph gets F.linear + the activation
    recompute = bool(recompute) and training and not torch.compiler.is_exporting()
    if name == "torch":
        return _torch_linear_act(x, weight, bias, activation, cast_to, recompute)
    # the kernels read contiguous rows: x as it is when it is made of them (of any rank: the op
    # views its rows below autograd, adding no nodes), else a contiguous (rows, K) copy; rows
    # under torch.compile, where the op's output is traced as a fresh tensor
    xk = x if x.is_contiguous() and not compiling else x.reshape(m, k).contiguous()
    y = torch.ops.ampkernels.linear_act.default(xk, weight.contiguous(), None if bias is None else bias.contiguous(),
                                                reference.activation_id(activation), cast_to, recompute, name)
    return y if xk is x else y.reshape(*x.shape[:-1], n)
