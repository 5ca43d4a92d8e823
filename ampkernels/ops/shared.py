"""Helpers several ops share: the registration of the Triton kernels as ops, whether the GEMM
ops' kernels take an input, F.linear's autocast dtype rule for the ops built on GEMMs, and those
ops' eager entry."""
import torch

from .. import _extension, backends

try:  # a size decision on a count known only at run time (under torch.compile): False, no guard
    from torch.fx.experimental.symbolic_shapes import guard_or_false
except ImportError:  # torch < 2.8: False unless provable
    from torch.fx.experimental.symbolic_shapes import statically_known_true as guard_or_false

_LIB = torch.library.Library("ampkernels", "FRAGMENT")


def kernel_op(schema, fake):
    """Decorator: the function becomes the op `ampkernels::<schema>` for every device, with its
    fake. For the Triton backend's kernels, which the ops' C++ autograd calls through the
    dispatcher: a plain kernel, below autograd, costs a call less host than
    torch.library.custom_op's layers (3.7 against 10 us on a CPU)."""
    def register(fn):
        name = schema.split("(", 1)[0]
        _LIB.define(schema)
        _LIB.impl(name, fn, "CompositeExplicitAutograd")
        torch.library.register_fake(f"ampkernels::{name}", lib=_LIB)(fake)
        return getattr(torch.ops.ampkernels, name).default
    return register

_KERNEL_DTYPES = (torch.float16, torch.bfloat16)


def gemm_unsupported(x):
    """Why the GEMM ops' kernels (linear_act, fused_mlp, gated) cannot take x (the torch backend
    then runs), or None."""
    if x.dtype not in _KERNEL_DTYPES:
        return f"dtype {x.dtype} is not float16/bfloat16"
    if not _extension.loaded():
        return f"the GEMM kernels run through ampkernels._C, which is not loaded ({_extension.status()[1]})"
    return None


def autocast_dtypes(op, x, params, names, what="x, weight and bias"):
    """F.linear's dtype rule, for the ops built on GEMMs: under autocast x is cast to the autocast
    dtype, and cast_to is that dtype when a parameter differs from it (fp32 master weights, cast
    inside the op); without autocast x and the parameters must share a dtype
    (TypeError naming each). Returns (x, cast_to)."""
    device = x.device.type
    if torch.is_autocast_enabled(device) and x.is_floating_point():
        dtype = torch.get_autocast_dtype(device)
        if x.dtype != dtype:
            x = x.to(dtype)
        for t in params:
            if t is not None and t.dtype != x.dtype:
                return x, x.dtype
        return x, None
    if any(t is not None and t.dtype != x.dtype for t in params):
        got = ", ".join(f"{n} {None if t is None else t.dtype}" for n, t in zip(("x", *names), (x, *params)))
        raise TypeError(f"{op}: {what} must share a dtype (as for F.linear), got {got}")
    return x, None


def torch_path_params(params, cast_to):
    """The parameters for F.linear on the torch backend. cast_to is set under autocast only, where
    F.linear casts fp32/fp16/bf16 parameters itself (in C++, cached for the autocast region): the
    same bits as a cast here, with a Python call less each; fp64, which autocast leaves alone, is
    cast here."""
    if cast_to is None:
        return params
    return tuple(t.to(cast_to) if t is not None and t.dtype == torch.float64 else t for t in params)


# ---------------------------------------------------------------- the GEMM ops' eager entry

# the ops' ids in gemm_entry
LINEAR_ACT, FUSED_MLP, GATED_LINEAR_ACT, GATED_MLP = range(4)
BUCKETS = ("tiny", "small", "medium", "large")  # linear_act.shape_bucket's names, in gemm_entry's order


def gemm_entry_key(activation_id, cc_major, dtype, bucket, training):
    """The key under which the extension's gemm_entry (csrc/ops.cpp) finds a call's "auto" cell:
    an op passes a dict of the keys whose first preference is not the cuda kernels (the value:
    whether it is torch)."""
    return (((activation_id * 32 + cc_major) * 2 + (dtype == torch.bfloat16)) * len(BUCKETS) + BUCKETS.index(bucket)) \
        * 2 + int(training)


def _declined(*args):
    return NotImplemented


def extension_gemm_entry():
    """The extension's gemm_entry (csrc/ops.cpp), or where the cuda backend does not run a
    stand-in that always declines."""
    if not backends.available_backends()["cuda"][0]:
        return _declined
    from .. import _C
    return _C.gemm_entry


def _gemm_entry(*args):
    # the first call binds the entry in its place
    global _gemm_entry
    _gemm_entry = extension_gemm_entry()
    return _gemm_entry(*args)


def gemm_entry(op_id, x, params, activation_id, backend, not_cuda_first, buckets):
    """The plain eager call of a GEMM op (CUDA tensors, the cuda kernels chosen) run by the
    extension without the op's Python: its output, or NotImplemented for any other call (the
    caller then validates and decides in full). Not under torch.compile: dynamo traces the
    Python path."""
    if torch.compiler.is_compiling():
        return NotImplemented
    return _gemm_entry(op_id, x, params, activation_id, backend, not_cuda_first, buckets)
