"""Loading the compiled extension ampkernels._C.

Order: the prebuilt module from `pip install --no-build-isolation .`; else, on a machine
with a CUDA torch and nvcc, a first-use build of the same sources with
torch.utils.cpp_extension.load (ninja, cached under TORCH_EXTENSIONS_DIR); else none, and
the reason is kept for available_backends() and `ampkernels doctor`.
AMPKERNELS_NO_JIT=1 skips the first-use build.
"""
import logging
import os
import threading

import torch

from . import _build_env

log = logging.getLogger("ampkernels")
_lock = threading.Lock()
_state = {"loaded": None, "reason": "not loaded yet", "how": None}
_on_load = []


def _jit_build():
    os.environ.setdefault("CUDA_HOME", _build_env.cuda_home() or "")
    from torch.utils import cpp_extension

    cpp_extension.CUDA_HOME = os.environ["CUDA_HOME"]  # the module read it at import; our discovery is better
    flags = _build_env.compile_flags()
    log.warning("ampkernels: compiling the CUDA extension at first use (once; cached by torch.utils.cpp_extension)")
    cpp_extension.load(
        name="ampkernels_C_jit",
        sources=_build_env.sources(),
        extra_include_paths=flags["include_dirs"],
        extra_cflags=flags["cxx"],
        extra_cuda_cflags=flags["nvcc"],
        extra_ldflags=flags["ldflags"],
        is_python_module=False,  # registers torch.ops.ampkernels.* as a side effect of loading
        verbose=False,
    )


def load():
    """True when torch.ops.ampkernels.*_cuda ops are registered (loading them on first call)."""
    with _lock:
        if _state["loaded"] is not None:
            return _state["loaded"]
        try:
            from . import _C  # noqa: F401  (prebuilt by setup.py)
            _state.update(loaded=True, reason="prebuilt ampkernels._C", how="prebuilt")
        except ImportError as e:
            prebuilt_error = str(e)
            reason = _build_env.cannot_build_reason()
            if reason is None and not torch.cuda.is_available():
                reason = "no CUDA device, so no first-use build"
            if reason is None and os.environ.get("AMPKERNELS_NO_JIT") == "1":
                reason = "not prebuilt and AMPKERNELS_NO_JIT=1"
            if reason is None:
                try:
                    _jit_build()
                    _state.update(loaded=True, reason="compiled at first use", how="jit")
                except Exception as jit_error:  # a broken toolchain must not break the package
                    reason = f"first-use build failed: {type(jit_error).__name__}: {str(jit_error)[:400]}"
            if not _state["loaded"]:
                _state.update(loaded=False, reason=f"ampkernels._C not importable ({prebuilt_error}); {reason}")
        if _state["loaded"]:
            for fn in _on_load:
                fn()
        return _state["loaded"]


def loaded():
    """load(), answered without the lock once known (a per-call question of the ops)."""
    done = _state["loaded"]
    return load() if done is None else done


def on_load(fn):
    """Run fn() once the extension's ops exist: now if loaded, else when load() succeeds (the ops
    modules register the fakes of the extension's ops this way)."""
    with _lock:
        if not _state["loaded"]:
            _on_load.append(fn)
            return
    fn()


def status():
    """(loaded, reason, how) without triggering a first-use build."""
    return _state["loaded"], _state["reason"], _state["how"]


def build_info():
    """{'archs': [90, ...], 'cuda_runtime': 13000} of the loaded extension, or {}."""
    if not load():
        return {}
    fields = dict(kv.split("=", 1) for kv in torch.ops.ampkernels.build_info_cuda().split(";"))
    archs = [int(a) // 10 for a in fields["archs"].split(",") if a.isdigit()]
    return {"archs": archs, "cuda_runtime": int(fields["cuda_runtime"])}
