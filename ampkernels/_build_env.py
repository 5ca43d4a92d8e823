"""Toolchain discovery for building ampkernels._C (used by setup.py and the first-use build).

Kept free of ampkernels imports so that setup.py can load it without the package.
Facts it handles: `which nvcc` may be a wrapper outside the toolkit, so torch's own
CUDA_HOME guess can be wrong; the toolkit may lack the cuBLAS/cuSPARSE headers that
torch's headers need, which the nvidia pip wheels carry; cuBLASLt may ship only as a
versioned libcublasLt.so.N; a build machine may have nvcc but no GPU, where torch's
cpp_extension cannot guess the architectures (it fails on an empty list).
"""
import glob
import os
import shutil
import sysconfig

# Built when no GPU is visible and TORCH_CUDA_ARCH_LIST is unset: sm_80 code runs on every
# Ampere/Ada GPU (8.x), sm_90 on Hopper (where the kernels are tuned), and sm_90 PTX is
# compiled by the driver for newer GPUs. Two architectures keep a 2-core build in minutes.
NO_GPU_ARCH_LIST = "8.0;9.0+PTX"

HERE = os.path.dirname(os.path.abspath(__file__))
_CSRC_CANDIDATES = (os.path.join(HERE, "csrc"), os.path.join(os.path.dirname(HERE), "csrc"))


def csrc_dir():
    for d in _CSRC_CANDIDATES:
        if os.path.isfile(os.path.join(d, "ops.cpp")):
            return d
    raise FileNotFoundError(f"ampkernels C++/CUDA sources not found in {_CSRC_CANDIDATES}")


def sources():
    d = csrc_dir()
    return sorted(glob.glob(os.path.join(d, "*.cpp")) + glob.glob(os.path.join(d, "*.cu")))


def _is_toolkit(root):
    return bool(root) and os.path.isfile(os.path.join(root, "bin", "nvcc")) and \
        os.path.isfile(os.path.join(root, "include", "cuda_runtime.h"))


def cuda_home():
    """The CUDA toolkit root, or None. A toolkit needs bin/nvcc and include/cuda_runtime.h."""
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    nvcc = shutil.which("nvcc")
    if nvcc:
        real = os.path.realpath(nvcc)
        candidates += [os.path.dirname(os.path.dirname(real)), os.path.dirname(os.path.dirname(nvcc))]
    candidates += sorted(glob.glob("/usr/local/cuda-*"), reverse=True)
    return next((c for c in candidates if _is_toolkit(c)), None)


def _nvidia_wheel_roots():
    """include/lib roots of the nvidia-* pip wheels (nvidia/cu13, nvidia/cublas, ...)."""
    roots = []
    for base in {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}:
        for inc in glob.glob(os.path.join(base, "nvidia", "*", "include")):
            roots.append(os.path.dirname(inc))
    return sorted(roots)


def _find_header(name, extra_roots):
    for root in [cuda_home()] + extra_roots:
        if root and os.path.isfile(os.path.join(root, "include", name)):
            return os.path.join(root, "include")
    return None


def _find_library(stem, extra_roots):
    """Full path of lib<stem>.so or its highest versioned variant."""
    roots = [cuda_home()] + extra_roots
    for root in roots:
        if not root:
            continue
        for sub in ("lib64", "lib", os.path.join("targets", "x86_64-linux", "lib")):
            found = sorted(glob.glob(os.path.join(root, sub, f"lib{stem}.so*")), key=len)
            if found:
                return found[0]
    return None


def compile_flags():
    """include dirs, compiler and linker flags for _C."""
    wheels = _nvidia_wheel_roots()
    include_dirs = [csrc_dir()]
    for header in ("cublasLt.h", "cusparse.h"):
        d = _find_header(header, wheels)
        if d is None:
            raise RuntimeError(f"{header} not found in the CUDA toolkit ({cuda_home()}) or the nvidia pip wheels")
        if d not in include_dirs:
            include_dirs.append(d)
    lib = _find_library("cublasLt", wheels)
    if lib is None:
        raise RuntimeError("libcublasLt not found in the CUDA toolkit or the nvidia pip wheels")
    return {
        "include_dirs": include_dirs,
        "cxx": ["-O3", "-std=c++20"],
        "nvcc": ["-O3", "-std=c++20", "-lineinfo", "--expt-relaxed-constexpr",
                 "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__",
                 "-U__CUDA_NO_BFLOAT16_CONVERSIONS__", "-U__CUDA_NO_HALF2_OPERATORS__"],
        # the full path: the unversioned libcublasLt.so may not exist; rpath finds it when torch has not loaded it
        "ldflags": [lib, f"-Wl,-rpath,{os.path.dirname(lib)}"],
    }


def arch_list():
    """(TORCH_CUDA_ARCH_LIST to build with, or None to let torch build for the visible GPUs;
    a sentence saying which)."""
    user = os.environ.get("TORCH_CUDA_ARCH_LIST", "").strip()
    if user:
        return user, f"building for {user} (TORCH_CUDA_ARCH_LIST)"
    import torch
    if torch.cuda.device_count() > 0:
        return None, "building for the visible GPUs' architectures"
    return NO_GPU_ARCH_LIST, f"no visible GPU: building for {NO_GPU_ARCH_LIST} (set TORCH_CUDA_ARCH_LIST to choose)"


def cannot_build_reason():
    """Why _C cannot be built here, or None when it can."""
    try:
        import torch
    except ImportError:
        return "torch is not importable in the build environment (isolated build)"
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU-only build"
    if cuda_home() is None:
        return "no CUDA toolkit (nvcc) found; set CUDA_HOME"
    return None
