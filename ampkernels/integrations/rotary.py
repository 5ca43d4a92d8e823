"""fuse_rotary(model): attention modules whose forward calls their modeling file's
apply_rotary_pos_emb(q, k, cos, sin[, position_ids][, unsqueeze_dim]) (Hugging Face's LLaMA,
Mistral, Qwen2/3, Gemma, GPT-NeoX, ...) run ampkernels.rotary_embedding there instead: one op
forward and one autograd node backward per layer, in place of ~16 small ops and ~20 nodes.

How: the modeling module's global apply_rotary_pos_emb is replaced, once, by a dispatcher that
runs the fused op only inside the forward of a module fuse_rotary() marked (a forward pre-hook
and an always-called forward hook on each keep a thread-local stack of the marked modules'
backends), and the original everywhere else. So unconverted models in the same process are untouched, and activation
checkpointing's recomputation, which re-enters the marked module's forward, runs what the
forward ran. Under torch.compile the original runs (inductor fuses it with its neighbours).

Before a module's function is replaced it is checked against the rotate-half formula on a small
fp64 probe; a function that differs (GPT-J's interleaved pairs, a partial or multimodal rotary)
or takes other arguments is left alone, and the module is reported as skipped with the reason.
Calls the kernels cannot take (another rank, a head dim that cos does not cover) run the
original.

While autocast is on, q and k come out in the autocast dtype, where Hugging Face's formula
promotes 16-bit q with fp32 cos to fp32: every attention that follows (sdpa, eager matmuls,
flash-attention) casts them to the autocast dtype first, so this writes half the bytes and drops
two casts forward and two backward, for the same values.
"""
import inspect
import threading
import types

import torch

from .. import reference
from ..ops.rotary import rotary_embedding

_NAME = "apply_rotary_pos_emb"
_STATE = threading.local()  # .stack: the backends of the marked forwards entered and not left, this thread
_EXTRA_PARAMS = ("position_ids", "unsqueeze_dim")


def _stack():
    stack = getattr(_STATE, "stack", None)
    if stack is None:
        stack = _STATE.stack = []
    return stack


def _enter(module, args):
    if not torch.compiler.is_compiling():
        _stack().append(module._ampkernels_rotary_backend)


def _leave(module, args, output):
    if not torch.compiler.is_compiling():
        _stack().pop()


def _parameters(fn):
    """The parameter names of the function fn is or wraps: the `kernels` package (Hugging Face's
    hub kernels), when installed, turns apply_rotary_pos_emb into a module whose forward(*args,
    **kwargs) calls the function it closes over."""
    if isinstance(fn, torch.nn.Module):
        cells = getattr(type(fn).forward, "__closure__", None) or ()
        inner = [c.cell_contents for c in cells if isinstance(c.cell_contents, types.FunctionType)]
        fn = inner[0] if len(inner) == 1 else fn
    try:
        return tuple(inspect.signature(inspect.unwrap(fn)).parameters)
    except (TypeError, ValueError):
        return ()


def _probe_mismatch(fn, params):
    """Why fn is not the rotate-half rotary embedding (a reason), or None."""
    if list(params[:4]) != ["q", "k", "cos", "sin"] or any(p not in _EXTRA_PARAMS for p in params[4:]):
        return f"{_NAME}{tuple(params)}: not the (q, k, cos, sin[, position_ids][, unsqueeze_dim]) signature"
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 2, 3, 8, generator=g, dtype=torch.float64), torch.randn(1, 1, 3, 8, generator=g,
                                                                                    dtype=torch.float64)
    angle = torch.randn(1, 3, 8, generator=g, dtype=torch.float64)
    try:
        with torch.no_grad():
            got = fn(q, k, angle.cos(), angle.sin())
    except Exception as e:  # noqa: BLE001 - any failure means: not this function
        return f"{_NAME} failed on a probe input ({type(e).__name__}: {e})"
    want = reference.rotary_embedding(q, k, angle.cos(), angle.sin())
    if not (isinstance(got, tuple) and len(got) == 2 and all(
            isinstance(a, torch.Tensor) and a.shape == b.shape and torch.allclose(a, b, atol=1e-12)
            for a, b in zip(got, want))):
        return f"{_NAME} is not the rotate-half rotary embedding (probe output differs)"
    return None


def _dispatcher(original, params):
    extra = params[4:]

    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        stack = getattr(_STATE, "stack", None)
        if not stack or torch.compiler.is_compiling():
            return original(q, k, cos, sin, *args, **kwargs)
        named = dict(zip(extra, args), **kwargs)
        unsqueeze_dim = named.pop("unsqueeze_dim", 1)
        if len(args) > len(extra) or set(named) - {"position_ids"} or named.get("position_ids") is not None \
                or not (q.dim() == k.dim() == 4 and cos.dim() == 3 and cos.shape == sin.shape
                        and q.shape[-1] == k.shape[-1] == cos.shape[-1]):
            return original(q, k, cos, sin, *args, **kwargs)
        device = q.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
        return rotary_embedding(q, k, cos, sin, unsqueeze_dim, out_dtype=dtype, backend=stack[-1])

    apply_rotary_pos_emb.ampkernels_original = original
    apply_rotary_pos_emb.__doc__ = original.__doc__
    return apply_rotary_pos_emb


def _rotary_globals(module):
    """The globals of module's forward when that forward calls apply_rotary_pos_emb, else None."""
    forward = inspect.unwrap(type(module).forward)
    code = getattr(forward, "__code__", None)
    if code is None or _NAME not in code.co_names:
        return None
    g = forward.__globals__
    return g if callable(g.get(_NAME)) else None


def fuse_rotary(model, report=None, backend=None):
    """Mark every module of `model` whose forward calls apply_rotary_pos_emb (see the module
    docstring); returns how many were marked. report: a ConvertReport to list the ones left alone.
    backend: the op's (None: "auto" / AMPKERNELS_BACKEND)."""
    marked, checked = 0, {}  # checked: id of a file's function -> (its parameters, why not), probed once
    for path, module in model.named_modules():
        g = _rotary_globals(module)
        if g is None or getattr(module, "_ampkernels_rotary", False):
            continue
        fn = g[_NAME]
        original = getattr(fn, "ampkernels_original", fn)
        if id(original) not in checked:
            params = _parameters(original)
            checked[id(original)] = params, _probe_mismatch(original, params)
        params, why = checked[id(original)]
        if why is not None:
            if report is not None:
                report.skip(path, module, why)
            continue
        if fn is original:
            g[_NAME] = _dispatcher(original, params)
        module.register_forward_pre_hook(_enter)
        module.register_forward_hook(_leave, always_call=True)
        module._ampkernels_rotary, module._ampkernels_rotary_backend = True, backend
        marked += 1
    return marked
