"""Where the pre-LN MLP block's AMP training step spends its time: eager vs ampkernels
(LayerNorm + FusedMLP, and the eager block after nn.convert).

    python scripts/profile_mlp_block.py [T H dtype] [--only kernels|host] [--out DIR]   # e.g. 16384 1024 bfloat16

--out DIR also writes the report to DIR/profile-mlp-block.txt (scripts/gpu_run.sh GPU_CMD=).
Variants: eager; LayerNorm + FusedMLP on "auto" (cuda) and on Triton; the eager block after
nn.convert.

Per variant:
- kernels: GPU kernel time per step and the top CUDA kernels by total time (torch.profiler);
- host: step time back to back (events around 50 steps), host time per step (enqueueing 8
  steps behind a torch.cuda._sleep, so the host never waits for the GPU; more steps would fill
  the launch queue, and then the host waits), and the functions with the most own host time
  under cProfile. A step whose host time is above its GPU time leaves the GPU idle.
"""
import argparse
import contextlib
import copy
import os
import sys

import torch
from ampkernels.bench.common import host_profile
from torch.profiler import ProfilerActivity, profile

import ampkernels.nn as aknn

p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
p.add_argument("shape", nargs="*", default=["16384", "1024", "bfloat16"], help="T H [dtype]")
p.add_argument("--only", choices=["kernels", "host"])
p.add_argument("--out", help="also write the report to OUT/profile-mlp-block.txt")
args = p.parse_args()
T, H = int(args.shape[0]), int(args.shape[1])
dtype = getattr(torch, args.shape[2]) if len(args.shape) > 2 else torch.bfloat16
STEPS, HOST_STEPS, PROFILED_STEPS = 50, 8, 10
torch.manual_seed(0)
eager = torch.nn.Sequential(torch.nn.LayerNorm(H), torch.nn.Linear(H, 4 * H), torch.nn.GELU(approximate="tanh"),
                            torch.nn.Linear(4 * H, H)).cuda()
fused = torch.nn.Sequential(aknn.LayerNorm(H, out_dtype="autocast"), aknn.FusedMLP(H, 4 * H)).cuda()
fused_triton = torch.nn.Sequential(aknn.LayerNorm(H, out_dtype="autocast", backend="triton"),
                                   aknn.FusedMLP(H, 4 * H, backend="triton")).cuda()
converted = copy.deepcopy(eager)
aknn.convert(converted, norm_out_dtype="autocast")
x = torch.randn(T, H, device="cuda", requires_grad=True)


def kernel_table(name, step):
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(PROFILED_STEPS):
            step()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    total = sum(e.self_device_time_total for e in events) / PROFILED_STEPS / 1e3
    print(f"\n== {name}: {total:.3f} ms of GPU kernel time per step")
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:20]:
        print(f"  {e.self_device_time_total / PROFILED_STEPS / 1e3:7.3f} ms  x{e.count // PROFILED_STEPS:<3d} "
              f"{e.key[:110]}")


def host_time(name, step):
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(STEPS):
        step()
    stop.record()
    torch.cuda.synchronize()
    gpu_ms = start.elapsed_time(stop) / STEPS
    host, stats = host_profile(step, HOST_STEPS, 800_000_000)  # ~0.4 s of GPU sleep ahead of the steps
    print(f"\n== {name}: {gpu_ms:.3f} ms/step back to back, host {host * 1e3:.3f} ms/step")
    stats.sort_stats("tottime").print_stats(16)


class _Tee:
    def __init__(self, *streams):
        self.streams = streams

    def write(self, text):
        for s in self.streams:
            s.write(text)

    def flush(self):
        for s in self.streams:
            s.flush()


def run_all():
    print(f"T={T} H={H} {dtype} (torch {torch.__version__}, {torch.cuda.get_device_name()})")
    variants = (("eager", eager), ("fusedmlp", fused), ("fusedmlp-triton", fused_triton), ("convert", converted))
    for name, block in variants:
        def step(block=block):
            with torch.autocast("cuda", dtype=dtype):
                y = x + block(x)
            y.float().square().mean().backward()

        for _ in range(5):
            step()
        torch.cuda.synchronize()
        if args.only != "host":
            kernel_table(name, step)
        if args.only != "kernels":
            host_time(name, step)


if args.out:
    with open(os.path.join(args.out, "profile-mlp-block.txt"), "w") as report, \
            contextlib.redirect_stdout(_Tee(sys.stdout, report)):
        run_all()
else:
    run_all()
