"""Where a small linear_act loses time on the GPU: per activation, the Triton forward's autotune
timings (ms per config) and pick, then each backend's forward under do_bench as a user calls it
and the same call replayed from a CUDA graph (no host work: the GPU time alone); with --host,
the host time per call (enqueued behind a long GPU sleep, so the host never waits) and the
functions with the most own host time under cProfile. "triton/kg" is the Triton backend with its
launches through Triton's own kernel[grid] path instead of ampkernels.triton.launch.
    python scripts/linear_act_probe.py [M K N] [--host]
"""
import functools
import sys

import torch
from ampkernels.benchmarks.common import graph_replay_ms, host_profile, top_host_functions
from triton.testing import do_bench

import ampkernels
from ampkernels.triton import launch as tlaunch
from ampkernels.triton import linear_act as tl_linear

HOST = "--host" in sys.argv
dims = [a for a in sys.argv[1:] if a != "--host"]
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
    y = (torch.nn.functional.relu(torch.nn.functional.linear(xg, wg, bg)) if backend == "eager"
         else ampkernels.linear_act(xg, wg, bg, act, backend=backend))
    return torch.autograd.grad(y, (xg, wg, bg), dy)


print(f"shape {M}x{K}x{N} bf16")
with torch.no_grad():
    print(f"  matmul: eager {flop / do_bench(lambda: x @ w.T) / 1e9:.0f} TFLOP/s")
    for act in ("relu", "silu", "gelu", "gelu_tanh"):
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
