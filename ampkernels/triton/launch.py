"""launch(kernel, grid, *args, **kwargs): kernel[grid](*args, **kwargs) with less host time.

Triton's `kernel[grid](...)` binds the arguments, specializes each one, hashes a cache key and
builds launch metadata on every call. Host time is what small and medium calls wait on (a Triton
norm backward costs the H200 machine's host about as much as its kernels take the GPU). launch()
makes a specialization's first call the normal way and keeps the compiled kernel Triton returns;
later calls with the same specialization hand the arguments straight to that kernel's launcher
(the call JITFunction.run itself ends in): about a tenth of a Triton norm backward call's host
time (two launches).

The key is at least as fine as Triton's specialization (tests/test_triton_launch.py checks it
against Triton's own): per tensor its dtype and whether its address is 16-byte aligned; per int
whether it is 1, whether it is a multiple of 16 and which of i32/i64/u64 holds it; per TMA
descriptor its class, dtype, block shape, layout and padding; floats, bools and None by type;
every keyword value (constexprs, num_warps, ...); the current device. Any other
argument type, a grid function, launch hooks (profilers) or the interpreter take Triton's path.

launch() returns the launch it kept (a Kept; None where Triton's path ran the call). A caller
that can tell cheaply that its next call keys the same (same shapes, dtypes and flags; inputs
16-byte aligned as before) runs Kept.run(*args) and skips the per-argument key: the Triton
norm backward keeps its two launches per such key of its own.
"""
import os

import torch

try:
    from triton import knobs
except ImportError:  # a Triton before 3.4: launches take Triton's path
    knobs = None

# the interpreter runs kernels itself; probes and the compile check set it to time or intercept Triton's path
_TRITON_PATH_ONLY = os.environ.get("TRITON_INTERPRET") == "1" or knobs is None
_COMPILED = {}  # launch key -> Triton's CompiledKernel
_PARAMS = {}    # kernel -> (parameter names, defaults), in signature order
_NO_DEFAULT = object()
_I32, _I64 = 1 << 31, 1 << 63


def _descriptor_classes():
    classes = []
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor
        classes.append(TensorDescriptor)
    except ImportError:
        pass
    try:
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
        classes.append(TensorDescriptor)
    except ImportError:
        pass
    return tuple(classes)


_DESCRIPTORS = _descriptor_classes()  # Triton's and Gluon's TMA descriptors, where this Triton has them


class _Unkeyed(Exception):
    """An argument launch() cannot key: the call takes Triton's path."""


def _arg_key(a):
    if isinstance(a, torch.Tensor):
        return a.dtype, a.data_ptr() % 16 == 0
    if isinstance(a, bool):  # before int: a bool is an int
        return bool
    if isinstance(a, int):
        return a == 1, a % 16 == 0, 0 if -_I32 <= a < _I32 else 1 if -_I64 <= a < _I64 else 2
    if isinstance(a, float):
        return float
    if a is None:
        return None
    if isinstance(a, _DESCRIPTORS):  # Triton specializes on its type: dtype, block shape, layout
        return (type(a), a.base.dtype, tuple(a.block_shape), getattr(a, "layout", None), a.padding,
                getattr(a, "round_f32_to_tf32", False))
    raise _Unkeyed


def launch_key(kernel, device, args, kwargs):
    """The key under which launch() keeps the compiled kernel of kernel[grid](*args, **kwargs)."""
    return kernel, device, tuple(map(_arg_key, args)), tuple(kwargs.items())


def _params(kernel):
    p = _PARAMS.get(kernel)
    if p is None:
        p = _PARAMS[kernel] = (tuple(q.name for q in kernel.params),
                               tuple(q.default if q.has_default else _NO_DEFAULT for q in kernel.params))
    return p


def _hooked():
    """Launch hooks (profilers) are set: a HookChain's calls since Triton 3.5, before that a callable."""
    enter, leave = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
    return bool(getattr(enter, "calls", enter) or getattr(leave, "calls", leave))


class Kept:
    """One specialization's launch: run(*args) launches its compiled kernel on its grid with new
    positional arguments (keywords as kept). Only for arguments whose launch_key is the kept
    call's; with launch hooks set (or _TRITON_PATH_ONLY, for the probes) it takes Triton's path."""
    __slots__ = ("compiled", "device", "grid", "grid3", "kernel", "kwargs", "tail")

    def __init__(self, kernel, grid, kwargs, compiled, device, n_args):
        self.kernel, self.grid, self.kwargs, self.compiled, self.device = kernel, grid, kwargs, compiled, device
        self.grid3 = tuple(grid) + (1,) * (3 - len(grid))
        names, defaults = _params(kernel)  # the parameters after the positional ones, in signature order
        self.tail = tuple(kwargs.get(name, default) for name, default in zip(names[n_args:], defaults[n_args:]))

    def run(self, *args):
        if _TRITON_PATH_ONLY or _hooked():
            self.kernel[self.grid](*args, **self.kwargs)
            return
        c, (g0, g1, g2) = self.compiled, self.grid3
        c.run(g0, g1, g2, torch._C._cuda_getCurrentRawStream(self.device), c.function, c.packed_metadata, None, None,
              None, *args, *self.tail)


def launch(kernel, grid, *args, **kwargs):
    """kernel[grid](*args, **kwargs) for a @triton.jit or @gluon.jit kernel (not an autotuned one)
    and a tuple grid; constexprs and launch options as keywords, the other parameters positional.
    Returns the Kept launch that ran it, or None where Triton's path did."""
    if _TRITON_PATH_ONLY or _hooked():
        kernel[grid](*args, **kwargs)
        return None
    device = torch.cuda.current_device()
    try:
        key = launch_key(kernel, device, args, kwargs)
    except _Unkeyed:
        kernel[grid](*args, **kwargs)
        return None
    compiled = _COMPILED.get(key)
    if compiled is None:
        compiled = kernel[grid](*args, **kwargs)
        # keyed by value only: a keyword tensor (keyed by identity) would add a key a call
        if not (isinstance(grid, tuple) and all(v is None or isinstance(v, (int, float, str))
                                                for v in kwargs.values())):
            return None
        _COMPILED[key] = compiled
        return Kept(kernel, grid, kwargs, compiled, device, len(args))
    kept = Kept(kernel, grid, kwargs, compiled, device, len(args))
    kept.run(*args)
    return kept
