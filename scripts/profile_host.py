"""Host (CPU) cost of one training step: eager AMP vs ampkernels, for the pre-LN MLP block.

    python scripts/profile_host.py [T H dtype]   # e.g. 16384 1024 bfloat16

Per variant: GPU time per step (events around 50 back-to-back steps), host time per step
(enqueueing 8 steps behind a torch.cuda._sleep, so the host never waits for the GPU; more
steps would fill the launch queue, and then the host waits),
and the functions with the most own host time under cProfile. A step whose host time is
above its GPU time leaves the GPU idle: that is the gap between kernel time and step time.
"""
import copy
import cProfile
import pstats
import sys
import time

import torch

import ampkernels.nn as aknn

T, H = (int(sys.argv[1]), int(sys.argv[2])) if len(sys.argv) > 2 else (16384, 1024)
dtype = getattr(torch, sys.argv[3]) if len(sys.argv) > 3 else torch.bfloat16
STEPS = 50
HOST_STEPS = 8
torch.manual_seed(0)
eager = torch.nn.Sequential(torch.nn.LayerNorm(H), torch.nn.Linear(H, 4 * H), torch.nn.GELU(approximate="tanh"),
                            torch.nn.Linear(4 * H, H)).cuda()
fused = torch.nn.Sequential(aknn.LayerNorm(H, out_dtype="autocast"), aknn.FusedMLP(H, 4 * H)).cuda()
converted = copy.deepcopy(eager)
aknn.convert(converted, norm_out_dtype="autocast")
x = torch.randn(T, H, device="cuda", requires_grad=True)
print(f"T={T} H={H} {dtype}")
for name, block in (("eager", eager), ("fusedmlp", fused), ("convert", converted)):
    def step():
        with torch.autocast("cuda", dtype=dtype):
            y = x + block(x)
        y.float().square().mean().backward()

    for _ in range(5):
        step()
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(STEPS):
        step()
    stop.record()
    torch.cuda.synchronize()
    gpu_ms = start.elapsed_time(stop) / STEPS
    torch.cuda._sleep(400_000_000)  # ~0.2 s of GPU busy-wait: the host never blocks below
    t0 = time.perf_counter()
    for _ in range(HOST_STEPS):
        step()
    host_ms = (time.perf_counter() - t0) * 1e3 / HOST_STEPS
    torch.cuda.synchronize()
    print(f"\n== {name}: {gpu_ms:.3f} ms/step back to back, host {host_ms:.3f} ms/step")
    torch.cuda._sleep(400_000_000)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(HOST_STEPS):
        step()
    prof.disable()
    torch.cuda.synchronize()
    pstats.Stats(prof).sort_stats("tottime").print_stats(16)
