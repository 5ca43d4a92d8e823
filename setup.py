"""Build ampkernels, with the compiled extension ampkernels._C when it can be built.

`pip install --no-build-isolation .` compiles ampkernels._C against the torch in
the environment (the convention for torch extensions: an isolated build would
compile against a different torch). When the build environment has no torch
(plain `pip install .`), no nvcc or a CPU-only torch, the package installs
without _C and ampkernels compiles the same sources at first use on a CUDA
machine (ampkernels/_extension.py). AMPKERNELS_FORCE_CUDA=1 turns a skipped
build into an error. TORCH_CUDA_ARCH_LIST and MAX_JOBS are honoured; with neither
TORCH_CUDA_ARCH_LIST nor a visible GPU the build picks _build_env.NO_GPU_ARCH_LIST.
"""
import os
import sys

from setuptools import setup

ROOT = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(ROOT, "ampkernels"))
import _build_env  # noqa: E402  (ampkernels/_build_env.py: toolchain discovery shared with the JIT build)

FORCE_CUDA = os.environ.get("AMPKERNELS_FORCE_CUDA", "0") == "1"


def say(msg):
    print(f"ampkernels setup: {msg}", file=sys.stderr, flush=True)


def extension_build():
    """Return (ext_modules, cmdclass), or ([], {}) with the reason said once."""
    problem = _build_env.cannot_build_reason()
    if problem:
        if FORCE_CUDA:
            raise RuntimeError(f"AMPKERNELS_FORCE_CUDA=1 but the CUDA extension cannot be built: {problem}")
        say(f"NOT building the CUDA extension ({problem}). The package installs without it; "
            "on a CUDA machine it is compiled at first use (cached), otherwise the triton/torch backends run.")
        return [], {}
    os.environ["CUDA_HOME"] = _build_env.cuda_home()  # before cpp_extension reads it
    from torch.utils.cpp_extension import BuildExtension, CUDAExtension

    flags = _build_env.compile_flags()
    archs, which = _build_env.arch_list()
    if archs is not None:
        os.environ["TORCH_CUDA_ARCH_LIST"] = archs  # read by cpp_extension when it compiles
    say(f"building ampkernels._C with CUDA_HOME={os.environ['CUDA_HOME']}; {which}")
    ext = CUDAExtension(
        name="ampkernels._C",
        sources=[os.path.relpath(p, ROOT) for p in _build_env.sources()],  # setuptools wants relative paths
        include_dirs=flags["include_dirs"],
        extra_compile_args={"cxx": flags["cxx"], "nvcc": flags["nvcc"]},
        extra_link_args=flags["ldflags"],
    )
    return [ext], {"build_ext": BuildExtension.with_options(use_ninja=True)}


ext_modules, cmdclass = extension_build()
setup(
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    # csrc/ travels inside the package so that the first-use build finds it
    packages=["ampkernels", "ampkernels.ops", "ampkernels.triton", "ampkernels.nn", "ampkernels.bench",
              "ampkernels.integrations",
              "ampkernels.csrc"],
    package_dir={"ampkernels.csrc": "csrc"},
    package_data={"ampkernels.csrc": ["*.cu", "*.cpp", "*.h", "*.cuh"]},
)
