"""Where a small linear_act loses time on the GPU: per activation, the Triton forward's autotune
timings (ms per config) and pick, then each backend's forward under do_bench as a user calls it
and the same call replayed from a CUDA graph (no host work: the GPU time alone); with --host,
the host time per call (enqueued behind a long GPU sleep, so the host never waits) and the
functions with the most own host time under cProfile. "triton/kg" is the Triton backend with its
launches through Triton's own kernel[grid] path instead of ampkernels.triton.launch.
--train-only skips the forwards; --trace adds, per training step (relu and gelu_tanh, eager and
the cuda backend), the host time of the step's parts called alone (the C++ ops without the
autograd Function) and torch.profiler's host events by self time (C++ ops and CUDA runtime/driver
calls, which cProfile lumps into the op that makes them).
    python scripts/linear_act_probe.py [M K N] [--host] [--train-only] [--trace]
"""
import contextlib
import functools
import sys

import torch
from ampkernels.bench.common import graph_replay_ms, host_profile, top_host_functions
from triton.testing import do_bench

import ampkernels
from ampkernels.triton import launch as tlaunch
from ampkernels.triton import linear_act as tl_linear

FLAGS = ("--host", "--train-only", "--trace")
HOST, TRAIN_ONLY, TRACE = (f in sys.argv for f in FLAGS)
dims = [a for a in sys.argv[1:] if a not in FLAGS]
M, K, N = (int(v) for v in dims[:3]) if len(dims) >= 3 else (4096, 768, 3072)
dtype = torch.bfloat16
x = torch.randn(M, K, device="cuda", dtype=dtype)
w = torch.randn(N, K, device="cuda", dtype=dtype) / K**0.5
b = torch.randn(N, device="cuda", dtype=dtype)
flop = 2 * M * N * K
xg, wg, bg = (t.clone().requires_grad_() for t in (x, w, b))
dy = torch.randn(M, N, device="cuda", dtype=dtype)


def report(label, fn, flops):
    try:
        fn()
        eager, graph = do_bench(fn, warmup=25, rep=200), graph_replay_ms(fn, warmup=25, rep=200)
        print(f"  {label}: called {flops / eager / 1e9:.0f} TFLOP/s ({eager * 1e3:.1f} us),"
              f" graph {flops / graph / 1e9:.0f} ({graph * 1e3:.1f} us)", flush=True)
        if HOST:
            print_host_profile(fn)
    except Exception as e:  # noqa: BLE001 (a probe: say what failed and go on)
        print(f"  {label}: {type(e).__name__}: {e}", flush=True)


def print_host_profile(fn, calls=20):
    host, stats = host_profile(fn, calls, 2_000_000_000)  # ~1 s of GPU sleep ahead of the calls
    print(f"    host {host * 1e6:.0f} us per call; own host time, top functions over {calls} calls:")
    for own, cum, times, where in top_host_functions(stats, calls, 12):
        print(f"      {own:7.1f} us own {cum:7.1f} us cum {times:3d}x {where}")


def via_kernel_grid(fn):
    """fn with every launch through Triton's kernel[grid] path."""
    def run():
        tlaunch._TRITON_PATH_ONLY = True
        try:
            return fn()
        finally:
            tlaunch._TRITON_PATH_ONLY = False
    return run


def train_step(backend, act):
    if backend == "eager":
        y = torch.nn.functional.linear(xg, wg, bg)
        y = torch.nn.functional.relu(y) if act == "relu" else torch.nn.functional.gelu(y, approximate="tanh")
    else:
        y = ampkernels.linear_act(xg, wg, bg, act, backend=backend)
    return torch.autograd.grad(y, (xg, wg, bg), dy)


def host_us(fn, calls=20):
    return host_profile(fn, calls, 2_000_000_000)[0] * 1e6


def trace(act):
    """The training step's host time split: the C++ ops alone, then torch.profiler's host events."""
    from ampkernels import reference
    aid = reference.activation_id(act)
    store_pre = act != "relu"
    ops = torch.ops.ampkernels
    with torch.no_grad():
        y, pre = ops.linear_act_fwd_cuda(x, w, b, aid, store_pre, True)
        saved = pre if store_pre else y
        parts = {
            "fwd op alone": lambda: ops.linear_act_fwd_cuda(x, w, b, aid, store_pre, True),
            "bwd op alone": lambda: ops.linear_act_bwd_cuda(dy, x, w, saved, aid, True, True, True, True),
            "torch.empty_like(dy) x3": lambda: [torch.empty_like(dy) for _ in range(3)],
            "F.linear alone": lambda: torch.nn.functional.linear(x, w, b),
        }
        for name, fn in parts.items():
            fn()
            print(f"    {name}: host {host_us(fn):.0f} us per call")
    for backend in ("eager", "cuda"):
        fn = functools.partial(train_step, backend, act)
        fn()
        print(f"    {act} {backend} step: host {host_us(fn):.0f} us per call; torch.profiler host events"
              " (self us per step, calls per step):")
        steps = 20
        torch.cuda.synchronize()
        torch.cuda._sleep(2_000_000_000)
        acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=acts) as prof:
            for _ in range(steps):
                fn()
        torch.cuda.synchronize()
        rows = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
        for e in sorted(rows, key=lambda e: -e.self_cpu_time_total)[:22]:
            print(f"      {e.self_cpu_time_total / steps:7.1f} us self {e.cpu_time_total / steps:7.1f} us total "
                  f"{e.count / steps:4.1f}x {e.key[:90]}")


print(f"shape {M}x{K}x{N} bf16")
with torch.no_grad() if not TRAIN_ONLY else contextlib.nullcontext():
    print(f"  matmul: eager {flop / do_bench(lambda: x @ w.T) / 1e9:.0f} TFLOP/s")
    for act in () if TRAIN_ONLY else ("relu", "silu", "gelu", "gelu_tanh"):
        for backend in ("cuda", "triton"):
            fn = functools.partial(ampkernels.linear_act, x, w, b, act, backend=backend)
            report(f"{act:9s} {backend:9s} fwd", fn, flop)
        report(f"{act:9s} triton/kg fwd", via_kernel_grid(fn), flop)
        for kern in (tl_linear._linear_act_fwd_tma_kernel, tl_linear._linear_act_fwd_kernel):
            timings = getattr(kern, "configs_timings", None)
            if timings:
                best = min(timings, key=lambda c: timings[c][0] if isinstance(timings[c], list) else timings[c])
                print(f"    {kern.fn.__name__} pick {best}:")
                for cfg, t in timings.items():
                    print(f"      {t} {cfg}")
                kern.configs_timings = None
print("forward + backward (relu; eager = F.linear + relu):")
for backend in ("eager", "cuda", "triton"):
    report(f"relu {backend:9s} fwd+bwd", functools.partial(train_step, backend, "relu"), 3 * flop)
report("relu triton/kg fwd+bwd", via_kernel_grid(functools.partial(train_step, "triton", "relu")), 3 * flop)
print("forward + backward (gelu_tanh; eager = F.linear + gelu(approximate='tanh')):")
for backend in ("eager", "cuda", "triton"):
    report(f"gelu_tanh {backend:9s} fwd+bwd", functools.partial(train_step, backend, "gelu_tanh"), 3 * flop)
if TRACE:
    for act in ("relu", "gelu_tanh"):
        print(f"trace, {act}:")
        trace(act)
