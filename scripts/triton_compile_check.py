"""Compile every Triton kernel launch of ampkernels for a GPU target without a GPU.

The real launchers run on "meta" tensors (shapes, no data); each kernel launch is caught
before it runs and compiled with Triton's own compiler and bundled ptxas for the target
(default sm_90: the H200), specialized as Triton's launcher would (16-divisible ints, 16-byte
aligned tensors). Autotuned kernels compile every config. A kernel or config that does not
compile for the GPU is then found on any machine, as the CUDA extension's build is; ptxas -v on
each kernel's PTX gives its registers and spills (printed with -v, or when it spills). A launch
whose kernel needs more shared memory than the GPU gives a block is refused as on the GPU
(OutOfResources), so a launcher's fallback for it runs and compiles too.

    python scripts/triton_compile_check.py [--arch 90] [-v]

Exit status 1 when a compile fails. The Triton here may not be the GPU machine's; passing
says the sources compile with this Triton. Not under TRITON_INTERPRET (the kernels would be
interpreter functions): the script clears it for itself.
"""
import argparse
import os
import re
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)  # before triton is imported

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.compiler import ASTSource
from triton.runtime.autotuner import Autotuner
from triton.runtime.errors import OutOfResources
from triton.runtime.jit import JITFunction

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:
    TensorDescriptor = None
try:  # Gluon kernels (ampkernels/triton/linear_act_pingpong.py) compile from their own AST source
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonTensorDescriptor
except ImportError:
    GluonASTSource = GluonTensorDescriptor = None

_DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", torch.int8: "i8",
           torch.int32: "i32", torch.int64: "i64"}


def _divisible_by_16(value):
    """What Triton's launcher specializes on (the "D" of its key, tt.divisibility = 16): an int
    that is a multiple of 16, a tensor whose data starts 16-byte aligned. Without it pointer
    arithmetic is not provably aligned and loads compile to scalars: other code, other registers
    and shared memory than the GPU's launch compiles. (Meta tensors: the storage offset stands
    for the address.)"""
    if isinstance(value, torch.Tensor):
        return value.storage_offset() * value.element_size() % 16 == 0
    return isinstance(value, int) and not isinstance(value, bool) and value % 16 == 0


def _max_threads(regs):
    """The most threads a block of a kernel of `regs` registers a thread may launch with on sm_90
    (the CUDA occupancy rules): registers are given out per warp in units of 256, warps per
    block in units of 4, from 64 K registers."""
    per_warp = -(-regs * 32 // 256) * 256
    return 65536 // per_warp // 4 * 4 * 32


def _arg_type(value):
    if isinstance(value, torch.Tensor):
        return "*" + _DTYPES[value.dtype]
    if GluonTensorDescriptor is not None and isinstance(value, GluonTensorDescriptor):
        # as Triton's launcher types it: the shared-memory layout is part of a Gluon descriptor
        shape = ",".join(str(s) for s in value.block_shape)
        return f"tensordesc<{_DTYPES[value.base.dtype]}[{shape}],{value.layout!r}>"
    if TensorDescriptor is not None and isinstance(value, TensorDescriptor):
        shape = ",".join(str(s) for s in value.block_shape)
        return f"tensordesc<{_DTYPES[value.base.dtype]}[{shape}]>"
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -2**31 <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no Triton type for {type(value).__name__}")


# shared memory a block may use (the opt-in maximum), per compute capability
MAX_SHARED = {80: 166912, 86: 101376, 89: 101376, 90: 232448}


class Checker:
    def __init__(self, arch, verbose):
        self.target = GPUTarget("cuda", arch, 32)
        self.max_shared = MAX_SHARED.get(arch, MAX_SHARED[90])
        self.verbose = verbose
        self.shared, self.tuned, self.failures = {}, set(), []  # shared: compile key -> bytes

    def compile(self, fn, args, kwargs, options):
        """fn: the JITFunction; args/kwargs: a launch's arguments (kwargs hold the constexprs).
        Returns the kernel's shared memory in bytes (None when it did not compile)."""
        bound = dict(zip(fn.arg_names, args))
        bound.update({k: v for k, v in kwargs.items() if k in fn.arg_names})
        signature, constexprs, attrs = {}, {}, {}
        for i, param in enumerate(fn.params):
            value = bound.get(param.name, param.default)
            if param.is_constexpr or value is None:
                signature[param.name] = "constexpr"
                constexprs[param.name] = value
            else:
                signature[param.name] = _arg_type(value)
                # do_not_specialize holds names (Triton 3.8) or indices (older)
                if _divisible_by_16(value) and i not in fn.do_not_specialize and param.name not in fn.do_not_specialize:
                    attrs[(i,)] = [["tt.divisibility", 16]]
        key = (fn.__name__, tuple(sorted(signature.items())), tuple(sorted(map(str, constexprs.items()))),
               tuple(sorted(attrs)), tuple(sorted(options.items())))
        if key in self.shared:
            return self.shared[key]
        self.shared[key] = None
        what = f"{fn.__name__} {options} " + " ".join(f"{k}={v}" for k, v in constexprs.items())
        try:
            source = GluonASTSource if getattr(fn, "is_gluon", lambda: False)() else ASTSource
            kernel = triton.compile(source(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
                                    target=self.target, options=options)
            regs, spills = self.ptxas_usage(kernel)
            threads = kernel.metadata.num_warps * 32  # every partition's warps (ttg.total-num-warps)
            if regs is not None and threads > _max_threads(regs):
                # what the GPU's launch refuses (OutOfResources "threads"), e.g. a 20-warp
                # kernel of 102 registers, whose block may hold 512 threads
                raise OutOfResources(threads, _max_threads(regs), "threads")
            if self.verbose or spills:
                nreg = sorted(set(re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", kernel.asm["ptx"])), key=int)
                print(f"ok   {what} (shared {kernel.metadata.shared} B, {regs} registers, {spills} B spilled"
                      + (f", setmaxnreg {' '.join(nreg)})" if nreg else ")"))
        except Exception as e:  # noqa: BLE001 -- every failure is reported, then the run goes on
            self.failures.append(what)
            print(f"FAIL {what}: {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}")
            return None
        self.shared[key] = kernel.metadata.shared
        return kernel.metadata.shared

    def ptxas_usage(self, kernel):
        """(registers per thread, bytes of spill stores) from ptxas -v on the kernel's PTX: the
        figures a GPU run would report, here without one."""
        ptx = kernel.asm["ptx"]
        target = re.search(r"^\.target\s+(\S+)", ptx, re.MULTILINE).group(1)
        with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
            f.write(ptx)
            f.flush()
            info = subprocess.run([get_ptxas(self.target.arch).path, "-v", f"--gpu-name={target}", f.name,
                                   "-o", os.devnull], capture_output=True, text=True, check=False).stderr
        regs = re.search(r"Used (\d+) registers", info)
        spills = re.search(r"(\d+) bytes spill stores", info)
        return (int(regs.group(1)) if regs else None), (int(spills.group(1)) if spills else 0)

    def install(self):
        checker = self

        def jit_run(fn, *args, grid, warmup, **kwargs):
            options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages", "maxnreg") if k in kwargs}
            shared = checker.compile(fn, args, kwargs, options)
            if shared is not None and shared > checker.max_shared:
                # as the GPU's launch does: the launcher may catch it and launch something smaller
                print(f"     {fn.__name__}: {shared} B of shared memory > {checker.max_shared}: launch refused")
                raise OutOfResources(shared, checker.max_shared, "shared memory")

        def autotuned_run(tuner, *args, **kwargs):
            # every config at the first launch of an autotuned kernel per argument types (the
            # launches start with the heaviest epilogue), the first config afterwards: configs
            # differ in tiles and stages, launches in constexpr flags
            first = (tuner.fn.__name__, tuple(_arg_type(a) for a in args))
            configs = tuner.configs if first not in checker.tuned else tuner.configs[:1]
            checker.tuned.add(first)
            for config in configs:
                nargs = {**dict(zip(tuner.arg_names, args)), **kwargs, **config.kwargs}
                if config.pre_hook:
                    config.pre_hook(nargs)
                options = {"num_warps": config.num_warps, "num_stages": config.num_stages}
                checker.compile(tuner.fn, args, {**kwargs, **config.kwargs}, options)

        JITFunction.run = jit_run
        Autotuner.run = autotuned_run
        from ampkernels.triton import launch
        launch._TRITON_PATH_ONLY = True  # every launch through JITFunction.run, replaced above


def launch_everything(max_shared):
    """The launchers of ampkernels.triton on meta tensors: every launch configuration regime and
    every constexpr branch at least once (not every combination: each compile takes seconds).
    max_shared: the GPU's shared memory per block, which the norm backward's fit plans for."""
    from ampkernels.reference import ACTIVATIONS
    from ampkernels.triton import gated_linear_act as tga
    from ampkernels.triton import layer_norm as tln
    from ampkernels.triton import linear_act as tla
    from ampkernels.triton import linear_cross_entropy as tlce
    from ampkernels.triton import rotary as trot

    tln._smem_per_program = lambda device: max_shared  # a meta device has no properties

    meta = torch.device("meta")
    empty = lambda *shape, dtype: torch.empty(*shape, dtype=dtype, device=meta)
    gelu = ACTIVATIONS.index("gelu")
    for dtype in (torch.bfloat16, torch.float16):
        # linear_cross_entropy's row passes: long rows (4096 lanes, 8 warps) and short ones, with and
        # without smoothing / gradient / lse, one scale or one per row; the vocabulary pass's blocks
        t, loss = empty(64, dtype=torch.int64), empty(64, dtype=torch.float32)
        for v, eps, grad, per_row in ((50257, 0.1, True, False), (128256, 0.0, True, True), (1000, 0.0, False, False),
                                      (7, 0.1, True, True)):
            scale = empty(64 if per_row else 1, dtype=torch.float32)
            tlce.rows_pass(empty(64, v, dtype=dtype), t, loss, scale, -100, eps, grad, None if per_row else loss)
            tlce.grad_pass(empty(64, min(v, 2048), dtype=dtype), t, loss, scale, 64, v, -100, eps)
        # linear_act, every autotune config: erf GELU with bias and pre stored (the heaviest epilogue)
        x, w, bias, y = empty(256, 512, dtype=dtype), empty(384, 512, dtype=dtype), empty(384, dtype=dtype), \
            empty(256, 384, dtype=dtype)
        for tma in (True, False):
            tla.linear_act_fwd(x, w, bias, gelu, True, tma=tma)
        if tla._pingpong.available():  # the Hopper ping-pong kernel: with and without pre / bias
            for act_id in range(len(ACTIVATIONS)):
                tla.linear_act_fwd(x, w, bias, act_id, True, tma=True, pingpong=True)
            tla.linear_act_fwd(x, w, None, gelu, False, tma=True, pingpong=True)
        # gated_linear_act, every autotune config: erf GELU with both biases and g|u stored (the
        # heaviest epilogue); then the other activations, no biases, inference
        h, gu = empty(256, 384, dtype=dtype), empty(256, 768, dtype=dtype)
        tga.gated_linear_act_fwd(x, w, w, bias, bias, gelu, True)
        if tla._pingpong.available():  # its Hopper ping-pong kernel: both biases and gu stored, and neither
            for act_id in range(len(ACTIVATIONS)):
                tla._pingpong.gated_linear_act_fwd_pingpong(x, w, w, bias, bias, act_id, h, gu, 132)
            tla._pingpong.gated_linear_act_fwd_pingpong(x, w, w, None, None, gelu, h, None, 132)
        if dtype == torch.bfloat16:
            for name in ("silu", "gelu_tanh"):
                tga.gated_linear_act_fwd(x, w, w, None, bias, ACTIVATIONS.index(name), True)
            tga.gated_linear_act_fwd(x, w, w, None, None, gelu, False)
            for name in ("silu", "gelu", "gelu_tanh"):
                tga.gated_act_backward(h, gu, gu, ACTIVATIONS.index(name), True)
                tga.gated_act_forward(gu, ACTIVATIONS.index(name))
            tga.gated_act_backward(h, gu, gu, gelu, False)
        # the rotary embedding, forward and backward: HF's layout (16-bit q, fp32 cos, fp32 out) and
        # every dtype the same, at head dims 64 and 96 (a half that is not a power of two)
        for d in (64, 96):
            q, cos = empty(2, 16, 3, d, dtype=dtype).transpose(1, 2), empty(1, 16, d, dtype=torch.float32)
            for backward, out in ((False, torch.float32), (True, dtype)):
                trot.rotary(q, cos, cos, 1, out, backward)
            trot.rotary(q, cos.to(dtype), cos.to(dtype), 1, dtype, False)
        if dtype == torch.float16:
            continue  # the branches below do not depend on the dtype
        # every other activation, no bias / no pre (first config)
        for act_id in range(len(ACTIVATIONS)):
            for tma in (True, False):
                tla.linear_act_fwd(x, w, bias, act_id, True, tma=tma)
            tla.linear_act_dz(y, y, act_id, True)
            tla.act_forward(y, act_id)
        for tma in (True, False):
            tla.linear_act_fwd(x, w, None, gelu, False, tma=tma)
        tla.linear_act_dz(y, y, gelu, False)
        tla.column_sums(y)  # the dz pass storing nothing (an identity layer's bias gradient)
        # norms: N picks the regime (several rows per program, one row, chunked with and without
        # a partial chunk); LayerNorm with fp32 params and a residual, RMSNorm with 16-bit params
        # and none; the forward for training (mean/rstd stored) and for inference
        for n in (7, 768, 4096, 8192, 16384, 20000, 65536):
            x = empty(64, n, dtype=dtype)
            for is_rms, params, residual in ((False, torch.float32, x), (True, dtype, None)):
                w = empty(n, dtype=params)
                b = None if is_rms else empty(n, dtype=params)
                tln.norm_fwd(x, w, b, residual, 1e-5, is_rms, None, False, want_stats=False)
                _, _, mean, rstd = tln.norm_fwd(x, w, b, residual, 1e-5, is_rms, None, False)
                tln.norm_bwd(x, x, w, mean, rstd, residual, is_rms, True, not is_rms, dtype,
                             None if residual is None else torch.float32, params)
        # LayerNorm with 16-bit params: the register kernel at 8192, the chunked one at 16384
        # (RMSNorm's 16-bit-params routes are in the loop above)
        for n in (8192, 16384):
            x, w = empty(64, n, dtype=dtype), empty(n, dtype=dtype)
            tln.norm_fwd(x, w, w, None, 1e-5, False, None, False)
        # the Gluon kernels at every row length they take, a whole row and a partial one: the backward
        # for LayerNorm with fp32 params and with none, RMSNorm with 16-bit params; the forward
        # (fp32 params) for LayerNorm, training and inference, and RMSNorm at 8192
        if tln._gluon.available():
            saved, tln.GLUON_MIN_N = tln.GLUON_MIN_N, dict.fromkeys(tln.GLUON_MIN_N, 0)
            try:
                for n in (16384, 12296):
                    x, st = empty(64, n, dtype=dtype), empty(64, dtype=torch.float32)
                    for is_rms, w in ((False, empty(n, dtype=torch.float32)), (False, None), (True, empty(n, dtype=dtype))):
                        tln.norm_bwd(x, x, w, st, st, None, is_rms, w is not None, not is_rms and w is not None,
                                     dtype, None, None if w is None else w.dtype)
                    w32 = empty(n, dtype=torch.float32)
                    for want_stats in (True, False):
                        tln.norm_fwd(x, w32, w32, None, 1e-5, False, None, False, want_stats=want_stats)
                x, w32 = empty(64, 8192, dtype=dtype), empty(8192, dtype=torch.float32)
                tln.norm_fwd(x, w32, None, None, 1e-5, True, None, False)
            finally:
                tln.GLUON_MIN_N = saved


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", type=int, default=90, help="compute capability x 10 (default 90)")
    p.add_argument("-v", "--verbose", action="store_true")
    args = p.parse_args(argv)
    checker = Checker(args.arch, args.verbose)
    checker.install()
    launch_everything(checker.max_shared)
    print(f"triton {triton.__version__}, sm_{args.arch}: {len(checker.shared)} kernel variants compiled, "
          f"{len(checker.failures)} failed")
    return 1 if checker.failures else 0


if __name__ == "__main__":
    sys.exit(main())
