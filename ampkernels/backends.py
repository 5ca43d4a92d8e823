"""Backend selection: "auto" | "cuda" | "triton" | "torch".

The choice comes from, in order: the call's `backend=` argument (or a module's), the
AMPKERNELS_BACKEND environment variable, then "auto". An explicitly requested backend that
cannot run the call is an error that says why; "auto" and the environment variable skip an
unavailable backend with one log line (once per reason) and take the next one.
"""
import functools
import logging
import os

import torch

from . import _extension

log = logging.getLogger("ampkernels")
BACKENDS = ("cuda", "triton", "torch")
CHOICES = ("auto",) + BACKENDS
_logged = set()


def triton_interpret():
    """TRITON_INTERPRET=1: Triton kernels run on CPU tensors (the CPU test tier)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


@functools.lru_cache(None)
def _triton_status():
    try:
        import triton  # noqa: F401
    except Exception as e:
        return False, f"triton not importable: {e}"
    if triton_interpret():
        return True, f"triton {triton.__version__} (TRITON_INTERPRET=1: kernels run on CPU tensors)"
    if not torch.cuda.is_available():
        return False, "no CUDA device"
    major, minor = torch.cuda.get_device_capability()
    if major < 8:
        return False, f"compute capability {major}.{minor} < 8.0 (kernels use bf16 and Ampere+ features)"
    return True, f"triton {triton.__version__}"


def _cuda_status():
    if not torch.cuda.is_available():
        # no device: report the extension without building it
        loaded, reason, _ = _extension.status()
        if loaded is None:
            reason = "no CUDA device" if torch.version.cuda else f"torch {torch.__version__} is CPU-only"
        return False, reason if not loaded else "extension loaded, but no CUDA device"
    if not _extension.load():
        return False, _extension.status()[1]
    probe = torch.ops.ampkernels.probe_device_cuda()
    if probe:
        archs = _extension.build_info().get("archs")
        return False, f"extension built for sm_{archs} does not run on this GPU: {probe}"
    return True, f"ampkernels._C ({_extension.status()[2]}), archs {_extension.build_info().get('archs')}"


def available_backends():
    """{name: (available, reason)} for 'cuda', 'triton' and 'torch'."""
    return {"cuda": _cuda_status(), "triton": _triton_status(), "torch": (True, "PyTorch reference, any device")}


@functools.lru_cache(None)
def _available(name):
    return available_backends()[name]


def _log_once(msg):
    if msg not in _logged:
        _logged.add(msg)
        log.warning(msg)


def requested(backend=None):
    """The requested backend name and whether it was explicit (argument, not env/auto)."""
    if backend is not None:
        name, explicit = backend, backend != "auto"
    else:
        name, explicit = os.environ.get("AMPKERNELS_BACKEND", "auto") or "auto", False
    if name not in CHOICES:
        source = "backend" if backend is not None else "AMPKERNELS_BACKEND"
        raise ValueError(f"{source} must be one of {CHOICES}, got {name!r}")
    return name, explicit


def _can_run(name, device):
    """None if backend `name` can run on tensors of `device`, else why not (the tensors' device
    first: it is what the caller can change)."""
    ok, reason = _available(name)
    on_cpu_interpreter = name == "triton" and triton_interpret() and device.type == "cpu"
    if device.type != "cuda" and not on_cpu_interpreter:
        why = f"backend {name!r} needs CUDA tensors, got tensors on {device}"
        return why if ok else f"{why} (and it is unavailable here: {reason})"
    if not ok:
        return f"backend {name!r} is unavailable: {reason}"
    return None


def assume_constant_result(fn):
    """torch.compiler.assume_constant_result without its import of torch._dynamo (~0.7 s, most
    of `import ampkernels` beyond torch's own): the decorator only sets this attribute, which
    dynamo reads when it traces a call (tests/test_backends.py checks that it still does)."""
    fn._dynamo_marked_constant = True
    return fn


@assume_constant_result
def select(op, backend, device, preference, unsupported=None):
    """The backend to run `op` with.

    preference: backends "auto" tries, fastest first (the op decides per shape and dtype).
    unsupported: why the kernels cannot take this input (e.g. a dtype), or None; then the
    torch reference runs, and an explicit kernel request is an error naming the reason.
    A host-side decision: under torch.compile it runs once at trace time and its result
    is a constant of the graph.
    Under torch.export every op takes the torch path, whatever was requested: an exported
    program (and the ONNX made of it) holds plain aten ops that any runtime can run, not
    custom ops that only this package's kernels implement.
    """
    if torch.compiler.is_exporting():
        return "torch"
    name, explicit = requested(backend)
    if name == "torch":
        return "torch"
    if name != "auto":
        # the backend's own limits (device, availability) before the input's (dtype): a CPU
        # tensor is the reason to name even when its dtype would not do either
        why_not = _can_run(name, device) or unsupported
        if why_not is None:
            return name
        if explicit:
            raise RuntimeError(f"ampkernels.{op}: {why_not}")
        _log_once(f"ampkernels.{op}: AMPKERNELS_BACKEND={name} cannot run here ({why_not}); using 'auto'")
    if unsupported or device.type != "cuda":
        return "torch"
    for candidate in preference:
        why_not = _can_run(candidate, device)
        if why_not is None:
            return candidate
        _log_once(f"ampkernels: skipping {why_not}")
    return "torch"
