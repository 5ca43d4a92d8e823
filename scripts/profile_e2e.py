"""Where a model's AMP training step spends its GPU and host time, unconverted against converted:
the e2e benchmark's models (ampkernels.bench.bench_e2e, built from configs), one process.

    python scripts/profile_e2e.py [--models vit ...] [--dtype bfloat16] [--size full] [--compile] [--out DIR]

Per model: the step time (CUDA events, median), the host's time to issue a step, the GPU kernel
time per step, the kernels and the host-side operators (self CPU time: aten ops, launches,
autograd nodes) whose time per step differs most between the two runs (torch.profiler, a few
steps after warm-up), the ampkernels custom ops called per step (under --compile "auto"
should leave none but the fused loss in the graphs), where the GPU sat idle in one step (summed
by the kernel it waited for and the operator that launched it), and the Python functions whose
own time per step differs most (cProfile; it inflates Python several-fold, so read the deltas,
not the totals). A step time above its kernel time is host-bound. --out DIR also writes the
report to DIR/profile-e2e.txt (scripts/gpu_run.sh GPU_CMD=).
"""
import argparse
import bisect
import collections
import contextlib
import cProfile
import io
import os
import pstats
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from ampkernels.bench import bench_e2e
from ampkernels.bench.common import own_compiles

WARM, TIMED, PROFILED, TOP = 4, 10, 3, 18
GAP_US = 20  # idle stretches shorter than this between two kernels are launch latency, not waiting


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
            with torch.profiler.record_function(_STEP):
                step()
            torch.cuda.synchronize()
    gaps = _step_gaps(prof)
    py, py_n = python_time(step, TIMED)
    gpu, gpu_n, cpu, cpu_n = (collections.Counter() for _ in range(4))
    for e in prof.key_averages():
        if e.device_type.name == "CUDA":
            gpu[e.key] += e.self_device_time_total / PROFILED / 1e3
            gpu_n[e.key] += e.count // PROFILED
        elif e.device_type.name == "CPU":
            cpu[e.key] += e.self_cpu_time_total / PROFILED / 1e3
            cpu_n[e.key] += e.count // PROFILED
    return statistics.median(times), statistics.median(host), gpu, gpu_n, cpu, cpu_n, gaps, py, py_n


_STEP = "profile_e2e.step"


def enclosing_op(ops, starts, t):
    """The operator a launch at time t ran in: the innermost enclosing op that is not an aten op (an
    autograd node, a custom op, the optimizer), else the innermost. ops: [(name, start, dur)]
    sorted by start; starts: their starts."""
    i = bisect.bisect_right(starts, t) - 1
    innermost = None
    for j in range(i, max(-1, i - 400), -1):
        name, start, dur = ops[j]
        if start <= t <= start + dur:
            innermost = innermost or name
            if not name.startswith("aten::"):
                return name
    return innermost or "?"


def idle_gaps(kernels, launch_at, ops):
    """GPU idle time between consecutive kernels, {(kernel waited for, op that launched it): [ms, count]}.
    kernels: [(name, start_ns, dur_ns, correlation)] of one step, sorted by start; launch_at:
    {correlation: host time of the launch call}; ops: host operators [(name, start_ns, dur_ns)]."""
    ops = sorted(ops, key=lambda o: o[1])
    starts = [o[1] for o in ops]
    out = collections.defaultdict(lambda: [0.0, 0])
    for a, b in zip(kernels, kernels[1:]):
        gap_us = (b[1] - (a[1] + a[2])) / 1e3
        if gap_us > GAP_US:
            t = launch_at.get(b[3])
            key = (b[0], "?" if t is None else enclosing_op(ops, starts, t))
            out[key][0] += gap_us / 1e3
            out[key][1] += 1
    return out


def _step_gaps(prof):
    """idle_gaps of the last profiled step, from the profiler's raw events."""
    events = prof.profiler.kineto_results.events()
    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    steps = [e for e in events if e.device_type() == cpu and e.name() == _STEP]
    last = max(steps, key=lambda e: e.start_ns())
    lo, hi = last.start_ns(), last.start_ns() + last.duration_ns()
    kernels = sorted(((e.name(), e.start_ns(), e.duration_ns(), e.correlation_id()) for e in events
                      if e.device_type() == cuda and e.duration_ns() > 0 and e.name() != _STEP
                      and not e.name().startswith(("Memcpy", "Memset")) and e.start_ns() >= lo), key=lambda k: k[1])
    launch_at, ops = {}, []
    for e in events:
        if e.device_type() != cpu or not lo <= e.start_ns() <= hi or e.name() == _STEP:
            continue
        if e.name().startswith("cu"):  # the runtime's launch calls: cudaLaunchKernel, cuLaunchKernelEx, ...
            launch_at[e.correlation_id()] = e.start_ns()
        else:
            ops.append((e.name(), e.start_ns(), e.duration_ns()))
    return idle_gaps(kernels, launch_at, ops)


def python_time(step, steps):
    """({function: own ms per step}, {function: calls per step}) of `steps` steps under cProfile."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        step()
        torch.cuda.synchronize()
    prof.disable()
    ms, calls = collections.Counter(), collections.Counter()
    for (path, line, func), (_, ncalls, tottime, _, _) in pstats.Stats(prof).stats.items():
        key = f"{path.split('site-packages/')[-1]}:{line}({func})"
        ms[key] += tottime / steps * 1e3
        calls[key] += ncalls // steps
    return ms, calls


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
    for label, (_, _, _, _, _, _, gaps, _, _) in (("unconverted", base), ("converted", conv)):
        print(f"  GPU idle in one {label} step: {sum(g[0] for g in gaps.values()):.2f} ms, by the kernel it waited "
              f"for and the op that launched it")
        for (kernel, op), (ms, n) in sorted(gaps.items(), key=lambda kv: -kv[1][0])[:TOP // 2]:
            print(f"  {ms:7.3f} ms x{n:<4d} before {kernel[:50]} | launched in {op[:60]}")
    _deltas("Python (own time under cProfile)", base[7], conv[7], base[8], conv[8])


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
            with own_compiles():  # no graph of another autocast dtype from torch's on-disk cache
                profile_model(name, getattr(torch, args.dtype), args.size, args.compile)
    if args.out:
        print(buf.getvalue(), end="")
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "profile-e2e.txt"), "w") as f:
            f.write(buf.getvalue())


if __name__ == "__main__":
    main()
