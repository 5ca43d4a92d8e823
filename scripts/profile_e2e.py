"""Where a model's AMP training step spends its GPU time, unconverted against converted: the e2e
benchmark's models (ampkernels.bench.bench_e2e, built from configs), eager, one process.

    python scripts/profile_e2e.py [--models vit ...] [--dtype bfloat16] [--size full] [--out DIR]

Per model: the step time (CUDA events, median), the GPU kernel time per step, and the kernels
whose time per step differs most between the two runs (torch.profiler, a few steps after
warm-up), so that a converted model that is slower shows which kernels cost it. A step time
above its kernel time is host-bound. --out DIR also writes the report to DIR/profile-e2e.txt
(scripts/gpu_run.sh GPU_CMD=).
"""
import argparse
import collections
import contextlib
import io
import os
import statistics

import torch
from torch.profiler import ProfilerActivity, profile

from ampkernels.bench import bench_e2e

WARM, TIMED, PROFILED, TOP = 4, 10, 3, 18


def _stepper(work, convert, dtype):
    model = bench_e2e.model_copy(work, convert, "cuda")[0]
    return bench_e2e.training_step(work, model, model, dtype, "cuda")


def _measure(step):
    for _ in range(WARM):
        step()
    times = []
    for _ in range(TIMED):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        step()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(PROFILED):
            step()
        torch.cuda.synchronize()
    kernels = collections.Counter()
    counts = collections.Counter()
    for e in prof.key_averages():
        if e.device_type.name == "CUDA":
            kernels[e.key] += e.self_device_time_total / PROFILED / 1e3
            counts[e.key] += e.count // PROFILED
    return statistics.median(times), kernels, counts


def profile_model(name, dtype, size):
    work = bench_e2e.BUILDERS[name](size, WARM + TIMED + PROFILED)
    (base_ms, base, base_n), (conv_ms, conv, conv_n) = (_measure(_stepper(work, c, dtype)) for c in (False, True))
    print(f"\n== {name} ({work.shape}), {str(dtype).replace('torch.', '')}: step {base_ms:.2f} -> {conv_ms:.2f} ms "
          f"({base_ms / conv_ms:.2f}x); GPU kernel time {sum(base.values()):.2f} -> {sum(conv.values()):.2f} ms")
    print("  ms/step unconverted -> converted (delta), calls/step, kernel")
    keys = sorted(set(base) | set(conv), key=lambda k: -abs(conv[k] - base[k]))
    for k in keys[:TOP]:
        print(f"  {base[k]:7.3f} -> {conv[k]:7.3f} ({conv[k] - base[k]:+7.3f})  x{base_n[k]:<3d}-> x{conv_n[k]:<3d} {k[:100]}")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", choices=bench_e2e.MODELS, default=["vit"])
    p.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    p.add_argument("--size", choices=list(bench_e2e.STEPS), default="full", help="the e2e benchmark's model sizes")
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
            profile_model(name, getattr(torch, args.dtype), args.size)
    if args.out:
        print(buf.getvalue(), end="")
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "profile-e2e.txt"), "w") as f:
            f.write(buf.getvalue())


if __name__ == "__main__":
    main()
