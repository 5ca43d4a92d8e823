"""Where a small linear_act loses time on the GPU: per activation, the Triton forward's autotune
timings (ms per config) and pick, then each backend's forward under do_bench as a user calls it
and the same call replayed from a CUDA graph (no host work: the GPU time alone).
    python scripts/linear_act_probe.py [M K N]
"""
import functools
import sys

import torch
from triton.testing import do_bench

import ampkernels
from ampkernels.triton import linear_act as tl_linear

M, K, N = (int(v) for v in sys.argv[1:4]) if len(sys.argv) > 3 else (4096, 768, 3072)
dtype = torch.bfloat16
x = torch.randn(M, K, device="cuda", dtype=dtype)
w = torch.randn(N, K, device="cuda", dtype=dtype) / K**0.5
b = torch.randn(N, device="cuda", dtype=dtype)
flop = 2 * M * N * K
xg, wg, bg = (t.clone().requires_grad_() for t in (x, w, b))
dy = torch.randn(M, N, device="cuda", dtype=dtype)


def graph_ms(fn):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()  # warm (autotune, plans) outside the capture
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return do_bench(g.replay, warmup=25, rep=200)


def report(label, fn, flops):
    try:
        fn()
        eager, graph = do_bench(fn, warmup=25, rep=200), graph_ms(fn)
        print(f"  {label}: called {flops / eager / 1e9:.0f} TFLOP/s ({eager * 1e3:.1f} us),"
              f" graph {flops / graph / 1e9:.0f} ({graph * 1e3:.1f} us)", flush=True)
    except Exception as e:  # noqa: BLE001 (a probe: say what failed and go on)
        print(f"  {label}: {type(e).__name__}: {e}", flush=True)


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
            report(f"{act:9s} {backend:6s} fwd", fn, flop)
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
    report(f"relu {backend:6s} fwd+bwd", functools.partial(train_step, backend, "relu"), 3 * flop)
