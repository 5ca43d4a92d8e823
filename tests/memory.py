"""Peak tensor memory of a step on CPU: which storages are alive at the peak, and who made them.

    with StorageTracker() as mem:
        step()
    mem.peak, mem.breakdown()

StorageTracker is a TorchDispatchMode: every aten op run while it is active (forward and, on
CPU, the autograd engine's backward, which runs on the calling thread) reports its outputs;
an output whose storage is new (shared with no input: not a view, not in-place, not out=) is
counted with its storage's nbytes until that storage dies (a weakref finalizer on the storage
object, which torch keeps alive exactly as long as the storage) or is resized (checked before
every op: fused_mlp's backward frees its saved pre-activation with resize_(0)). `peak` is the most bytes
alive after any op: the CPU stand-in for torch.cuda.max_memory_allocated() minus
memory_allocated() before the step, as ampkernels/bench/bench_mlp.py measures it on the GPU.

What it does not see, and why that is fine for comparing blocks:
- storages created before it started (inputs, parameters, existing .grad): the base;
- temporaries inside one aten kernel or inside a C++ custom op (cuBLAS workspaces, the
  CUDA extension's internal buffers): invisible on CPU, where the torch paths run instead;
  they are reasoned about where those paths differ (ampkernels/ops/mlp.py);
- the CUDA caching allocator's rounding (to 512 B): negligible at these sizes.
Each live entry is labelled with the op that made it and, in backward, the autograd node
that was running (e.g. AddmmBackward0), so a breakdown reads like the code.
"""
import dataclasses
import weakref
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ampkernels.bench.bench_mlp import fused_block_state_dict
from ampkernels.bench.common import cuda_step_peak


@dataclass
class Entry:
    op: str          # aten op that created the storage
    node: str        # autograd node running at the time ("" in forward)
    shape: tuple
    dtype: torch.dtype
    nbytes: int
    seq: int         # creation order

    def label(self):
        where = f"{self.node}/" if self.node else ""
        return f"{where}{self.op} {tuple(self.shape)} {str(self.dtype).replace('torch.', '')}"


class StorageTracker(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.live = {}          # storage key -> Entry
        self.storages = {}      # storage key -> weakref to the storage, to see resizes
        self.current = 0
        self.peak = 0
        self.at_peak = []       # the entries alive when the peak was reached
        self.peak_op = ""
        self._seq = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self._refresh()
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage()._cdata for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        node = torch._C._current_autograd_node()
        node = type(node).__name__ if node is not None else ""
        if node in ("", "NoneType"):
            node = ""
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._track(t, func, node, inputs)
        if self.current > self.peak:
            self.peak = self.current
            # copies: an entry's nbytes may change later (a storage freed early by resize_)
            self.at_peak = sorted((dataclasses.replace(e) for e in self.live.values()), key=lambda e: (-e.nbytes, e.seq))
            self.peak_op = f"{node + '/' if node else ''}{func}"
        return out

    def _track(self, t, func, node, inputs):
        s = t.untyped_storage()
        key = s._cdata
        if key in self.live:  # an op resized a storage we count (out= / resize_)
            self.current += s.nbytes() - self.live[key].nbytes
            self.live[key].nbytes = s.nbytes()
            return
        if key in inputs or s.nbytes() == 0:  # a view, an in-place or out= result, or nothing
            return
        self._seq += 1
        self.live[key] = Entry(str(func), node, tuple(t.shape), t.dtype, s.nbytes(), self._seq)
        self.storages[key] = weakref.ref(s)
        self.current += s.nbytes()
        weakref.finalize(s, self._free, key)

    def _refresh(self):
        # storages resized outside any aten op (untyped_storage().resize_(0) frees one early, as
        # fused_mlp's backward does with pre) count what they hold now
        for key, ref in self.storages.items():
            s, e = ref(), self.live.get(key)
            if s is not None and e is not None and s.nbytes() != e.nbytes:
                self.current += s.nbytes() - e.nbytes
                e.nbytes = s.nbytes()

    def _free(self, key):
        self.storages.pop(key, None)
        e = self.live.pop(key, None)
        if e is not None:
            self.current -= e.nbytes

    def breakdown(self, unit=None, unit_name="B", top=None):
        """Lines: the peak, then every storage alive at it, largest first (in `unit` bytes)."""
        unit = unit or 1
        fmt = lambda b: f"{b / unit:8.2f} {unit_name}"
        lines = [f"peak {fmt(self.peak)}  (reached at {self.peak_op})"]
        for e in self.at_peak[:top]:
            lines.append(f"  {fmt(e.nbytes)}  {e.label()}")
        return lines


def step_peak(step, warmup=True):
    """StorageTracker of one call of step(), after one untracked call (so that .grad tensors
    exist and are accumulated into, as in the benchmark's timed steps)."""
    if warmup:
        step()
    with StorageTracker() as mem:
        step()
    return mem


# ---------------------------------------------------------------- the pre-LN MLP block

class KernelLikeLayerNorm(torch.autograd.Function):
    """LayerNorm that allocates what the CUDA and Triton norm kernels allocate (csrc/ops.cpp
    norm_fwd/norm_bwd, ampkernels/triton/layer_norm.py): forward out (out_dtype), mean, rstd;
    backward dx (x's dtype) and dweight/dbias (+ per-block fp32 partials, small). The torch
    backend of ampkernels.layer_norm, which is what runs on CPU, computes the whole backward in
    fp32 temporaries (several (T, H) fp32 tensors at once): a CPU artefact, not what the GPU
    sees. Same math (reference.norm_forward/norm_backward), row block by row block."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps, out_dtype):
        from ampkernels import reference
        out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
        mean, rstd = (torch.empty(x.shape[0], device=x.device) for _ in range(2))
        for s, e in reference.row_blocks(x):
            o, _, m, r = reference.norm_forward(x[s:e], weight, bias, eps, out_dtype=out_dtype)
            out[s:e], mean[s:e], rstd[s:e] = o, m, r
        ctx.save_for_backward(x, weight, mean, rstd)
        return out

    @staticmethod
    def backward(ctx, dy):
        from ampkernels import reference
        x, weight, mean, rstd = ctx.saved_tensors
        dx = torch.empty_like(x)
        dw, db = (torch.zeros_like(weight) for _ in range(2))
        for s, e in reference.row_blocks(x):
            d, w_, b_ = reference.norm_backward(dy[s:e], x[s:e], weight, mean[s:e], rstd[s:e])
            dx[s:e] = d
            dw += w_
            db += b_
        return dx, dw, db, None, None


def mlp_block_step(kind, tokens, hidden, dtype=torch.bfloat16, activation="gelu_tanh", backend=None, ln="kernel",
                   seed=0, device="cpu"):
    """(step, unit): one training step of y = x + MLP(LayerNorm(x)), loss = mean(y^2), x fp32,
    as ampkernels/bench/bench_mlp.py runs it on the GPU. unit = tokens * hidden * dtype's itemsize,
    the size of one (T, H) activation in the compute dtype; the hidden tensors are 4 units.

    kind "eager": nn.LayerNorm -> Linear -> act -> Linear under autocast, autograd saving what
    eager saves. On CPU, CPU autocast, whose policy for these ops is CUDA's: linear in `dtype`,
    layer_norm in fp32 with an fp32 output, parameter casts cached per autocast region.
    kind "fused": on CUDA, nn.LayerNorm(out_dtype="autocast") + nn.FusedMLP (`backend`, None =
    auto), as the benchmark runs them. On CPU, a LayerNorm emitting `dtype` (ln="kernel":
    KernelLikeLayerNorm, what the GPU kernels allocate; ln="torch": ampkernels' torch backend,
    what runs on CPU), then the fused_mlp op given the fp32 parameters and the compute dtype, as
    fused_mlp calls it under CUDA autocast, on the reference's CPU stand-ins for the cuda kernels
    (tests/utils.py; they allocate what the kernels allocate).
    kind "mlp-eager" / "mlp-fused": the MLP alone on a `dtype` (T, H) input (the norm's output),
    backward from a given gradient: what the MLP itself adds, no norm, no loss.
    """
    import ampkernels.nn as aknn
    from ampkernels import reference
    from ampkernels.nn.modules import _ACTIVATION_MODULES, _SquaredReLU
    from tests.utils import REFERENCE_GEMM_KERNELS, kernels_on_cpu

    dev = torch.device(device)
    torch.manual_seed(seed)
    act = _ACTIVATION_MODULES.get(activation, _SquaredReLU)()
    eager = torch.nn.Sequential(torch.nn.LayerNorm(hidden), torch.nn.Linear(hidden, 4 * hidden), act,
                                torch.nn.Linear(4 * hidden, hidden)).to(dev)
    for p in eager[0].parameters():  # not the identity affine: its gradient must flow for real
        p.data.add_(0.1 * torch.randn_like(p))
    fc1, fc2 = eager[1], eager[3]
    x = torch.randn(tokens, hidden, device=dev, requires_grad=True)

    def fused_mlp(z):
        if dev.type == "cuda":  # the public op: casts under autocast, "auto" picks the backend
            from ampkernels.ops.mlp import fused_mlp as op
            return op(z, fc1.weight, fc1.bias, fc2.weight, fc2.bias, activation, backend=backend)
        return torch.ops.ampkernels.fused_mlp.default(z, fc1.weight, fc1.bias, fc2.weight, fc2.bias,
                                                      reference.activation_id(activation), dtype, "cuda")

    if kind in ("eager", "fused"):
        if kind == "eager":
            block = eager
        elif dev.type == "cuda":
            block = torch.nn.Sequential(aknn.LayerNorm(hidden, out_dtype="autocast"),
                                        aknn.FusedMLP(hidden, 4 * hidden, activation=activation, backend=backend))
            block.load_state_dict(fused_block_state_dict(eager.state_dict()))
            block.to(dev)
        elif ln == "kernel":
            ln_ = eager[0]
            block = lambda x: fused_mlp(KernelLikeLayerNorm.apply(x, ln_.weight, ln_.bias, ln_.eps, dtype))
        elif ln == "torch":
            norm = aknn.LayerNorm(hidden, out_dtype="autocast", backend="torch")
            norm.load_state_dict(eager[0].state_dict())
            block = lambda x: fused_mlp(norm(x))
        else:
            raise ValueError(f"ln must be 'kernel' or 'torch', got {ln!r}")

        def step():
            with torch.autocast(dev.type, dtype=dtype):
                y = x + block(x)
            y.float().square().mean().backward()
    elif kind in ("mlp-eager", "mlp-fused"):
        z = torch.randn(tokens, hidden, device=dev, dtype=dtype, requires_grad=True)
        g = torch.randn(tokens, hidden, device=dev, dtype=dtype)
        mlp = eager[1:] if kind == "mlp-eager" else fused_mlp

        def step():
            with torch.autocast(dev.type, dtype=dtype):
                out = mlp(z)
            out.backward(g)
    else:
        raise ValueError(f"unknown kind {kind!r}")
    if dev.type == "cpu" and kind in ("fused", "mlp-fused"):
        run = step

        def step():  # the op's kernels on CPU: the reference, allocating what they allocate
            with kernels_on_cpu(REFERENCE_GEMM_KERNELS):
                run()
    return step, tokens * hidden * torch.empty(0, dtype=dtype).element_size()


def cuda_peak_blocks(step, unit, top, warmup=2):
    """Lines: the CUDA caching allocator's view of one step (after warm-up steps), from
    torch.cuda.memory's allocation history: the blocks alive at the step's peak, largest first,
    each with the Python frames that allocated it. What the tracker cannot see (temporaries
    inside an aten kernel or a C++ op) shows here under the op's caller."""
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(max_entries=1_000_000, context="alloc", stacks="python")
    try:
        step()
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    live, current, peak, at_peak = {}, 0, 0, []
    for event in snapshot["device_traces"][torch.cuda.current_device()]:
        if event["action"] == "alloc":
            live[event["addr"]] = event
            current += event["size"]
            if current > peak:
                peak, at_peak = current, sorted(live.values(), key=lambda e: -e["size"])
        elif event["action"] == "free_completed" and event["addr"] in live:
            current -= live.pop(event["addr"])["size"]
    lines = [f"allocator peak {peak / unit:8.2f} U above the step's start; blocks alive then:"]
    for e in at_peak[:top]:
        frames = [f"{f['filename'].split('site-packages/')[-1].split('/work/main/')[-1]}:{f['line']}({f['name']})"
                  for f in e["frames"] if not f["filename"].startswith("<")][:5]
        lines.append(f"  {e['size'] / unit:8.2f} U  " + " <- ".join(frames))
    return lines


def _main():
    import argparse
    p = argparse.ArgumentParser(description="Peak-memory breakdown of the pre-LN MLP block's training step "
                                "(StorageTracker; on cuda also torch.cuda's peak)")
    p.add_argument("tokens", type=int, nargs="?", default=4096)
    p.add_argument("hidden", type=int, nargs="?", default=256)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--activation", default="gelu_tanh")
    p.add_argument("--device", default="cpu")
    p.add_argument("--top", type=int, default=12, help="live tensors listed per peak")
    p.add_argument("--backend", default=None, help="FusedMLP's backend on cuda (default: auto)")
    p.add_argument("--snapshot", action="store_true",
                   help="on cuda, also the allocator's blocks alive at each step's peak and who allocated them")
    a = p.parse_args()
    dtype, cuda = getattr(torch, a.dtype), a.device.startswith("cuda")
    variants = [("eager", None), ("fused", None if cuda else "kernel")] + ([] if cuda else [("fused", "torch")])
    peaks = {}
    for kind, ln in variants + [("mlp-eager", None), ("mlp-fused", None)]:
        step, unit = mlp_block_step(kind, a.tokens, a.hidden, dtype, a.activation, backend=a.backend if cuda else None,
                                    ln=ln or "kernel", device=a.device)
        mem = step_peak(step)
        name = kind + (f" (ln={ln})" if ln else "")
        peaks[name] = mem.peak
        print(f"== {name}: T={a.tokens} H={a.hidden} {a.dtype} {a.activation} on {a.device}; "
              f"U = T*H*{unit // (a.tokens * a.hidden)} B = {unit} B; hidden-sized tensors are 4U")
        if cuda:
            peaks[name] = cuda_step_peak(step)
            print(f"torch.cuda peak {peaks[name] / unit:8.2f} U = {peaks[name] / 2**20:.1f} MiB "
                  f"(the tracker's below misses workspaces and the extension's internal buffers)")
        print("\n".join(mem.breakdown(unit, "U", a.top)))
        if cuda and a.snapshot:
            print("\n".join(cuda_peak_blocks(step, unit, a.top)))
    fused = "fused" if cuda else "fused (ln=kernel)"
    print(f"block: fused / eager peak = {peaks[fused] / peaks['eager']:.3f}"
          + ("" if cuda else f"; fused (ln=torch) / eager = {peaks['fused (ln=torch)'] / peaks['eager']:.3f}"))
    print(f"MLP alone: fused / eager peak = {peaks['mlp-fused'] / peaks['mlp-eager']:.3f}")


if __name__ == "__main__":
    _main()
