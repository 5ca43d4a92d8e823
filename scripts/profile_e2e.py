"""Where a model's AMP training step spends its GPU and host time, unconverted against converted:
the e2e benchmark's models (ampkernels.bench.bench_e2e, built from configs), one process.

    python scripts/profile_e2e.py [--models vit ...] [--dtype bfloat16] [--size full] [--compile] [--out DIR]

Per model: the step time (CUDA events, median), the host's time to issue a step, the GPU kernel
time per step, the kernels and the host-side operators (self CPU time: aten ops, launches,
autograd nodes) whose time per step differs most between the two runs (torch.profiler, a few
steps after warm-up), and the ampkernels custom ops called per step (under --compile "auto"
should leave none but the fused loss in the graphs). A step time above its kernel time is
host-bound. --out DIR also writes the report to DIR/profile-e2e.txt (scripts/gpu_run.sh GPU_CMD=).
"""
import argparse
import collections
import contextlib
import io
import os
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from ampkernels.bench import bench_e2e

WARM, TIMED, PROFILED, TOP = 4, 10, 3, 18


def _stepper(work, convert, dtype, compiled):
    model = bench_e2e.model_copy(work, convert, "cuda")[0]
    torch._dynamo.reset()
    return bench_e2e.training_step(work, model, torch.compile(model) if compiled else model, dtype, "cuda")


def _measure(step):
    """(step ms, host ms to issue a step, {kernel: ms/step}, {kernel: calls/step}, {host op: ms/step},
    {host op: calls/step}); medians over TIMED steps, per-step means over PROFILED ones."""
    for _ in range(WARM):
        step()
    times, host = [], []
    for _ in range(TIMED):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        t0 = time.perf_counter()
        step()
        host.append((time.perf_counter() - t0) * 1e3)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(PROFILED):
            step()
        torch.cuda.synchronize()
    gpu, gpu_n, cpu, cpu_n = (collections.Counter() for _ in range(4))
    for e in prof.key_averages():
        if e.device_type.name == "CUDA":
            gpu[e.key] += e.self_device_time_total / PROFILED / 1e3
            gpu_n[e.key] += e.count // PROFILED
        elif e.device_type.name == "CPU":
            cpu[e.key] += e.self_cpu_time_total / PROFILED / 1e3
            cpu_n[e.key] += e.count // PROFILED
    return statistics.median(times), statistics.median(host), gpu, gpu_n, cpu, cpu_n


def _deltas(what, base, conv, base_n, conv_n):
    print(f"  {what}: ms/step unconverted -> converted (delta), calls/step")
    for k in sorted(set(base) | set(conv), key=lambda k: -abs(conv[k] - base[k]))[:TOP]:
        print(f"  {base[k]:7.3f} -> {conv[k]:7.3f} ({conv[k] - base[k]:+7.3f})  x{base_n[k]:<4d}-> x{conv_n[k]:<4d} "
              f"{k[:100]}")


def profile_model(name, dtype, size, compiled):
    work = bench_e2e.BUILDERS[name](size, WARM + TIMED + PROFILED)
    base, conv = (_measure(_stepper(work, c, dtype, compiled)) for c in (False, True))
    print(f"\n== {name} ({work.shape}), {str(dtype).replace('torch.', '')}, {'compiled' if compiled else 'eager'}: "
          f"step {base[0]:.2f} -> {conv[0]:.2f} ms ({base[0] / conv[0]:.2f}x); host {base[1]:.2f} -> {conv[1]:.2f} ms "
          f"to issue a step; GPU kernel time {sum(base[2].values()):.2f} -> {sum(conv[2].values()):.2f} ms")
    ours = {k: n for k, n in conv[5].items() if k.startswith("ampkernels::")}
    print("  ampkernels ops per converted step: " + (", ".join(f"{k} x{n}" for k, n in sorted(ours.items())) or "none"))
    _deltas("GPU kernels", base[2], conv[2], base[3], conv[3])
    _deltas("host (self CPU time under the profiler)", base[4], conv[4], base[5], conv[5])


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", choices=bench_e2e.MODELS, default=["vit"])
    p.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    p.add_argument("--size", choices=list(bench_e2e.STEPS), default="full", help="the e2e benchmark's model sizes")
    p.add_argument("--compile", action="store_true", help="profile torch.compile'd steps (both runs)")
    p.add_argument("--out", help="also write the report to OUT/profile-e2e.txt")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("profile_e2e.py needs a CUDA GPU")
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf) if args.out else contextlib.nullcontext():
        import triton
        print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
              f"commit {os.environ.get('AMPKERNELS_COMMIT', 'unknown')}")
        for name in args.models:
            profile_model(name, getattr(torch, args.dtype), args.size, args.compile)
    if args.out:
        print(buf.getvalue(), end="")
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "profile-e2e.txt"), "w") as f:
            f.write(buf.getvalue())


if __name__ == "__main__":
    main()
