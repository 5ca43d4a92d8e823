"""rotary_embedding: the rotary position embedding of q and k in its rotate-half form (GPT-NeoX,
LLaMA and the Hugging Face models built like them), forward and backward.

    q_out, k_out = ampkernels.rotary_embedding(q, k, cos, sin, unsqueeze_dim=1)

is Hugging Face's apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim): for x in (q, k)
    x * cos.unsqueeze(unsqueeze_dim) + rotate_half(x) * sin.unsqueeze(unsqueeze_dim),
rotate_half(x) = cat(-x[..., h:], x[..., :h]), h = head_dim / 2. Outputs in torch's promotion of
x's, cos's and sin's dtypes (fp32 for 16-bit q under autocast with fp32 cos/sin, as there)
unless out_dtype names one; fp32 math with one rounding per output (torch rounds each product
and the sum). cos and sin get no gradient on the kernel backends.

Backends: "cuda" (csrc/rotary.cu), "triton" (ampkernels/triton/rotary.py) and "torch" (the
formula above with torch's autograd: what inductor traces under torch.compile). One op,
torch.ops.ampkernels.rotary_embedding (csrc/ops.cpp: its autograd in C++), with each backend's
kernel as the op rotary_<backend>; their fakes are here. Why: in an eager LLaMA-style step the
formula is ~16 small ops forward and ~20 autograd nodes backward per layer, host time that a
host-bound step waits on (docs/performance.md).
"""
import torch
from torch import Tensor

from .. import _extension, backends, reference
from .shared import kernel_op

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_PREFERENCE = ("cuda", "triton")  # the extension's call costs the host less than a Triton launch


def _triton():
    from ..triton import rotary as triton_rotary  # imported on first use: triton is optional
    return triton_rotary


def _fake(x, cos, sin, unsqueeze_dim, out_dtype, backward):
    # the kernels' output layout: x's where x is dense with a contiguous last dim, else contiguous
    out = torch.empty_like(x, dtype=out_dtype)
    return out if x.stride(-1) == 1 and out.stride(-1) == 1 else x.new_empty(x.shape, dtype=out_dtype)


def _rotary_embedding_fake(q, k, cos, sin, unsqueeze_dim, q_dtype, k_dtype, backend):
    return _fake(q, cos, sin, unsqueeze_dim, q_dtype, False), _fake(k, cos, sin, unsqueeze_dim, k_dtype, False)


@kernel_op("rotary_triton(Tensor x, Tensor cos, Tensor sin, int unsqueeze_dim, ScalarType out_dtype, bool backward) "
           "-> Tensor", _fake)
def rotary_triton(x, cos, sin, unsqueeze_dim, out_dtype, backward):
    return _triton().rotary(x, cos, sin, unsqueeze_dim, out_dtype, backward)


def _register_extension_fakes():
    torch.library.register_fake("ampkernels::rotary_cuda")(_fake)
    torch.library.register_fake("ampkernels::rotary_embedding")(_rotary_embedding_fake)


_extension.on_load(_register_extension_fakes)


def _torch_rotary(q, k, cos, sin, unsqueeze_dim, q_dtype, k_dtype):
    """The "torch" backend: Hugging Face's formula (reference.rotary_embedding), then out_dtype."""
    q_out, k_out = reference.rotary_embedding(q, k, cos, sin, unsqueeze_dim)
    return q_out.to(q_dtype), k_out.to(k_dtype)


def _validate(q, k, cos, sin, unsqueeze_dim, out_dtype):
    for name, t in (("q", q), ("k", k), ("cos", cos), ("sin", sin)):
        if not isinstance(t, Tensor):
            raise TypeError(f"rotary_embedding: {name} must be a Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(f"rotary_embedding: {name} must be a floating-point tensor, got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"rotary_embedding: {name} is on {t.device} but q is on {q.device}")
    if cos.shape != sin.shape:
        raise ValueError(f"rotary_embedding: cos and sin must have one shape, got {tuple(cos.shape)} and "
                         f"{tuple(sin.shape)}")
    d = q.shape[-1] if q.dim() else 0
    if q.dim() == 0 or k.dim() == 0 or cos.dim() == 0 or k.shape[-1] != d or cos.shape[-1] != d or d % 2:
        raise ValueError(f"rotary_embedding: q, k, cos and sin must share an even last dim (the head dim), got "
                         f"{tuple(q.shape)}, {tuple(k.shape)} and {tuple(cos.shape)}")
    if not isinstance(unsqueeze_dim, int) or isinstance(unsqueeze_dim, bool):
        raise TypeError(f"rotary_embedding: unsqueeze_dim must be an int, got {unsqueeze_dim!r}")
    if out_dtype is not None and not (isinstance(out_dtype, torch.dtype) and out_dtype.is_floating_point):
        raise ValueError(f"rotary_embedding: out_dtype must be a floating-point torch.dtype or None, got {out_dtype!r}")


def _unsupported(q, k, cos, sin, unsqueeze_dim, q_dtype, k_dtype):
    """Why the kernels cannot take this call (the torch backend then runs), or None."""
    if q.dim() != 4 or k.dim() != 4 or cos.dim() != 3:
        return f"the kernels take 4-D q and k and 3-D cos and sin, got {q.dim()}-D, {k.dim()}-D and {cos.dim()}-D"
    for name, dt in (("q", q.dtype), ("k", k.dtype), ("cos", cos.dtype), ("out", q_dtype), ("out", k_dtype)):
        if dt not in _DTYPES:
            return f"{name} dtype {dt} is not one of {_DTYPES}"
    if cos.dtype != sin.dtype:
        return f"cos and sin dtypes differ ({cos.dtype}, {sin.dtype})"
    if torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad):
        return "cos or sin requires grad, which the kernels do not give"
    if not -4 <= unsqueeze_dim <= 3:
        return f"unsqueeze_dim {unsqueeze_dim} is not a dim of 4-D cos"
    if not _extension.loaded():
        return f"the rotary op runs through ampkernels._C, which is not loaded ({_extension.status()[1]})"
    return None


def rotary_embedding(q, k, cos, sin, unsqueeze_dim=1, *, out_dtype=None, backend=None):
    """Rotary position embedding of q and k (see the module docstring): (q_out, k_out).

    q, k: (batch, heads, seq, head_dim) with unsqueeze_dim=1, (batch, seq, heads, head_dim) with
    unsqueeze_dim=2 (any strides; k may have fewer heads); cos, sin: (batch or 1, seq, head_dim).
    out_dtype: the outputs' dtype (None: torch's promotion of x, cos and sin).
    backend: None/"auto" | "cuda" | "triton" | "torch" (see ampkernels.backends).
    """
    _validate(q, k, cos, sin, unsqueeze_dim, out_dtype)
    cs = torch.promote_types(cos.dtype, sin.dtype)
    q_dtype = out_dtype or torch.promote_types(q.dtype, cs)
    k_dtype = out_dtype or torch.promote_types(k.dtype, cs)
    # under torch.compile "auto" hands the formula to inductor, which fuses it with its neighbours
    name = backends.select("rotary_embedding", backend, q.device,
                           ("torch",) if torch.compiler.is_compiling() else _PREFERENCE,
                           _unsupported(q, k, cos, sin, unsqueeze_dim, q_dtype, k_dtype))
    if name == "torch":
        return _torch_rotary(q, k, cos, sin, unsqueeze_dim, q_dtype, k_dtype)
    return torch.ops.ampkernels.rotary_embedding.default(q, k, cos, sin, unsqueeze_dim, q_dtype, k_dtype, name)
