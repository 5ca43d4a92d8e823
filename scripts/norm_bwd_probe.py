"""Where a norm backward's time goes, per backend: the backward as the benchmark times it
(out.backward with the grads cleared, do_bench with L2 flushes) with its p20/p80 spread, the backend's kernel call alone
(the launcher, no autograd), the same call replayed from a CUDA graph (the GPU time alone) and the
host time per call (enqueued behind a long GPU sleep, so the host never waits), with the
functions with the most own host time under cProfile. M*N = 2^27 as in the benchmark. The Triton
backend is measured with ampkernels.triton.launch and with Triton's own launch path.
--spread adds, per backend, the percentiles of out.backward's host time call by call and the timed
backward again with Python's garbage collector off: the benchmark's Triton backward rows are
bimodal (p20 at the kernels' time, p80 up to 3x it) where the CUDA backend's are not.
    python scripts/norm_bwd_probe.py [N ...] [--spread]
"""
import functools
import gc
import sys
import time

import torch
from ampkernels.bench.common import bench, graph_replay_ms, host_profile, top_host_functions

import ampkernels
from ampkernels.triton import launch as tlaunch
from ampkernels.triton import layer_norm as tln

NS = [int(a) for a in sys.argv[1:] if a != "--spread"] or [2048, 8192]
SPREAD = "--spread" in sys.argv
dtype = torch.bfloat16


def spread(fn):
    p50, p20, p80 = bench(fn, rep=200)
    return f"{p50 * 1e3:.1f} us (p20 {p20 * 1e3:.1f}, p80 {p80 * 1e3:.1f})"


def host(fn, calls=20):
    t, stats = host_profile(fn, calls, 2_000_000_000)  # ~1 s of GPU sleep ahead of the calls
    top = "; ".join(f"{own:.1f} us {where.split('/')[-1]}" for own, _, _, where in top_host_functions(stats, calls, 8))
    return f"{t * 1e6:.0f} us per call [{top}]"


def host_percentiles(fn, calls=150, rounds=3):
    """Percentiles of fn's host time, call by call, each batch enqueued behind a GPU sleep (150
    calls of ~3 launches stay within the launch queue, so no call waits for the GPU)."""
    times = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        torch.cuda._sleep(1_000_000_000)
        for _ in range(calls):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
    q = torch.tensor(times).quantile(torch.tensor([0.1, 0.5, 0.9, 0.99])) * 1e6
    return "p10 {:.0f}, p50 {:.0f}, p90 {:.0f}, p99 {:.0f}, max {:.0f} us".format(*q.tolist(), max(times) * 1e6)


def spread_report(fn):
    """Host percentiles and the timed call with the garbage collector on, then off."""
    parts = []
    for collect in (True, False):
        (gc.enable if collect else gc.disable)()
        try:
            parts.append(f"gc {'on' if collect else 'off'}: host {host_percentiles(fn)}; timed {spread(fn)}")
        finally:
            gc.enable()
    return "; ".join(parts)


for n in NS:
    m = 2**27 // n
    x = torch.randn(m, n, device="cuda", dtype=dtype, requires_grad=True)
    w = torch.rand(n, device="cuda", dtype=dtype, requires_grad=True)
    b = torch.randn(n, device="cuda", dtype=dtype, requires_grad=True)
    dy = torch.randn(m, n, device="cuda", dtype=dtype)
    for op in ("layer_norm", "rms_norm"):
        is_rms = op == "rms_norm"
        # Triton twice: its kernels launched by ampkernels.triton.launch (kept compiled kernels),
        # then through Triton's own kernel[grid](...) path
        for backend, label in (("cuda", "cuda"), ("triton", "triton"), ("triton", "triton, Triton's launch path")):
            tlaunch._TRITON_PATH_ONLY = label.endswith("path")
            fwd = (functools.partial(ampkernels.rms_norm, x, (n,), w, backend=backend) if is_rms
                   else functools.partial(ampkernels.layer_norm, x, (n,), w, b, backend=backend))
            out = fwd()

            def backward(out=out, leaves=(x, w, b), dy=dy):  # grads cleared first, as the benchmark does
                for t in leaves:
                    t.grad = None
                out.backward(dy, retain_graph=True)

            backward()
            print(f"N={n} {op} {label}: out.backward {spread(backward)}; host {host(backward)}", flush=True)
            if SPREAD:
                print(f"  out.backward call by call, {spread_report(backward)}", flush=True)
            if backend == "triton":
                _, _, mean, rstd = tln.norm_fwd(x.detach(), w.detach(), None if is_rms else b.detach(), None, 1e-5,
                                                is_rms, None, False)
                call = functools.partial(tln.norm_bwd, dy, x.detach(), w.detach(), mean, rstd, None, is_rms, True,
                                         not is_rms, dtype, None, dtype)
                call()
                print(f"  norm_bwd alone {spread(call)}; graph {graph_replay_ms(call, warmup=25, rep=200) * 1e3:.1f} us;"
                      f" host {host(call)}", flush=True)
            x.grad = w.grad = b.grad = None
            del out, backward
    del x, w, b, dy
