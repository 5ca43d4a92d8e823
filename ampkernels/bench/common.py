"""Shared benchmark harness: timing (do_bench medians with 20/80 quantiles), the run's
environment (GPU, versions, commit) and result rows appended as JSON lines.

A row: {op, provider, shape..., dtype, pass (fwd|bwd|fwd_bwd), metric, value, ms, ms_p20,
ms_p80, gpu, cc, host, torch, cuda, triton, commit, time}; rows of a public provider (providers.py)
also carry provider_version. Plots and reports read these rows.
"""
import contextlib
import cProfile
import csv
import datetime
import functools
import json
import os
import platform
import pstats
import subprocess
import sys
import time

import torch


@functools.lru_cache(None)
def environment():
    """GPU name, capability and versions for every row of this run."""
    env = {"torch": torch.__version__, "cuda": torch.version.cuda, "triton": None, "gpu": "cpu", "cc": None}
    try:
        import triton
        env["triton"] = triton.__version__
    except ImportError:
        pass
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
        env["cc"] = "{}.{}".format(*torch.cuda.get_device_capability())
    env["host"] = _host_cpu()
    # AMPKERNELS_COMMIT wins: the GPU machine's copy of the tree can carry a .git whose HEAD is
    # not the commit that was copied
    env["commit"] = os.environ.get("AMPKERNELS_COMMIT")
    if not env["commit"]:
        try:
            root = os.path.dirname(os.path.abspath(__file__))
            env["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                                           text=True, timeout=10, check=False).stdout.strip() or "unknown"
        except (OSError, subprocess.SubprocessError):
            env["commit"] = "unknown"
    return env


def _host_cpu():
    """The host's CPU model and the cores this process may use: host-bound rows (small ops, eager
    training steps) follow the host, which differs between machines of one GPU kind."""
    model = None
    try:
        with open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), None)
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{model or platform.processor() or platform.machine()}, {cores} cores"


def cuda_step_peak(step, warmup=2):
    """Bytes: torch.cuda.max_memory_allocated during one untimed step minus memory_allocated
    before it, after warm-up steps (so .grad tensors exist). Taken outside do_bench, whose
    256 MiB L2-flush buffer would otherwise be the peak's largest "activation"."""
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


@contextlib.contextmanager
def probe_log(path):
    """say(line) for a probe script: prints the line and writes it to the log at path."""
    with open(path, "w") as log:
        def say(line):
            print(line, flush=True)
            log.write(line + "\n")

        yield say


def graph_replay_ms(fn, **timing):
    """Median ms of fn captured once in a CUDA graph and replayed: its GPU time without the
    host's work per call (fn is run once on a side stream first: autotuning, plans, caches)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return bench(graph.replay, **timing)[0]


def host_profile(fn, calls, sleep_cycles):
    """(host seconds per call, pstats.Stats of `calls` more calls): fn is enqueued behind a GPU
    busy-wait of sleep_cycles (long enough for both batches), so the host never waits for the
    GPU and the time is the host's own."""
    torch.cuda.synchronize()
    torch.cuda._sleep(sleep_cycles)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - t0) / calls
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    return host, pstats.Stats(prof)


def top_host_functions(stats, calls, n):
    """The n functions with the most own time in host_profile's stats: (own us per call, cumulative
    us per call, times called per call, "file:line(name)")."""
    rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:n]
    return [(tot / calls * 1e6, cum / calls * 1e6, ncalls // calls, f"{file.split('site-packages/')[-1]}:{line}({name})")
            for (file, line, name), (_, ncalls, tot, cum, _) in rows]


def bench(fn, *, warmup=25, rep=100, grad_to_none=None):
    """(median, p20, p80) milliseconds. GPU: triton.testing.do_bench (L2 flushed between
    runs). CPU: wall clock of a few calls -- says nothing about GPU speed."""
    if torch.cuda.is_available():
        from triton.testing import do_bench
        return tuple(do_bench(fn, warmup=warmup, rep=rep, quantiles=[0.5, 0.2, 0.8], grad_to_none=grad_to_none))
    import time
    fn()
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    return times[2], times[1], times[3]


# results.csv: these columns first (fixed, so rows of every op and every run line up), then
# "extra" holding the row's other fields as JSON
CSV_COLUMNS = ("time", "op", "provider", "provider_version", "pass", "dtype", "shape", "metric", "value", "ms",
               "ms_p20", "ms_p80", "gpu", "cc", "torch", "cuda", "triton", "commit")


def first_call_s(fn):
    """Seconds of fn's first call, synchronised: torch.compile's compilation (and autotuning,
    for the kernels) happens there, so rows report it apart from the timed runs."""
    import time
    t0 = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return round(time.perf_counter() - t0, 3)


class Recorder:
    """Collects rows, prints one line per row, and appends them to OUT/results.jsonl and
    OUT/results.csv (CSV_COLUMNS, then the other fields as JSON in "extra")."""

    def __init__(self, out_dir=None, filename="results.jsonl"):
        self.rows = []
        self.path = os.path.join(out_dir, filename) if out_dir else None
        self.csv_path = os.path.join(out_dir, "results.csv") if out_dir else None
        if out_dir:
            os.makedirs(out_dir, exist_ok=True)

    def add(self, **row):
        row = {**row, **environment(), "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
        self.rows.append(row)
        keys = [k for k in ("op", "provider", "pass", "dtype", "shape") if k in row]
        line = "  ".join(f"{row[k]}" for k in keys) + f" {row.get('value')} {row.get('metric', '')}"
        if _bar is not None:
            _bar.write(line, file=sys.stdout)  # above the progress bar, not through it
        else:
            print(line, flush=True)
        if self.path:
            with open(self.path, "a") as f:
                f.write(json.dumps(row) + "\n")
            new_file = not os.path.exists(self.csv_path)
            with open(self.csv_path, "a", newline="") as f:
                w = csv.writer(f)
                if new_file:
                    w.writerow((*CSV_COLUMNS, "extra"))
                extra = {k: v for k, v in row.items() if k not in CSV_COLUMNS}
                w.writerow((*(row.get(k, "") for k in CSV_COLUMNS), json.dumps(extra)))
        return row


@contextlib.contextmanager
def own_compiles():
    """torch.compile compiles each graph inside anew, without the AOTAutograd cache: torch before
    the fix of pytorch#181564 (2.11 among them) keys that cache without the ambient autocast
    dtype, so a module compiled under fp16 autocast was served under bf16 (the benchmarks compile
    the same fp32 module under both)."""
    import torch._functorch.config as functorch_config
    with functorch_config.patch(enable_autograd_cache=False):
        yield


def guard(recorder, what, fn, *args, **kwargs):
    """fn(*args, **kwargs): one measurement; an error row instead of losing the whole run."""
    try:
        return fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 -- a failing provider must not stop the side-by-side run
        recorder.add(op=what, provider="error", metric="error", value=f"{type(e).__name__}: {str(e)[:300]}")
        return None


_bar = None  # the tqdm bar of the running progress(), if any: Recorder.add prints above it


def progress(cases, desc, label=str):
    """Yield each of an op's cases in turn, saying how far the list has got: a tqdm bar when
    stderr is a terminal and tqdm is installed, else an "[i/n] desc: case" line on stderr
    before each case, so that a log of a long sweep shows where it is (or where it died)."""
    global _bar
    cases = list(cases)
    bar = None
    if sys.stderr.isatty():
        try:
            from tqdm import tqdm
            bar = tqdm(total=len(cases), desc=desc, file=sys.stderr, dynamic_ncols=True)
        except ImportError:
            pass
    _bar = bar
    try:
        for i, case in enumerate(cases, 1):
            if bar is not None:
                bar.set_postfix_str(label(case))
            else:
                print(f"[{i}/{len(cases)}] {desc}: {label(case)}", file=sys.stderr, flush=True)
            yield case
            if bar is not None:
                bar.update()
    finally:
        _bar = None
        if bar is not None:
            bar.close()


def standalone_main(name, doc, run, report, argv=None, extra_args=None, special=None):
    """`python -m ampkernels.bench.<name> --out DIR [--quick] [--dtype ...]` for one benchmark module.

    extra_args(parser) adds module options; special(args, recorder) may handle them and
    return True to skip the standard run. Prints the report and writes report_<name>.txt.
    """
    import argparse

    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--out", default=None)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--dtype", nargs="+", default=["float16", "bfloat16"], choices=["float16", "bfloat16"])
    if extra_args:
        extra_args(p)
    args = p.parse_args(argv)
    recorder = Recorder(args.out)
    env = environment()
    print(f"{name} on {env['gpu']}, torch {env['torch']}, triton {env['triton']}, commit {env['commit']}")
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure (`ampkernels bench` runs the CPU demo)")
        return 0
    if special and special(args, recorder):
        return 0
    run(recorder, [getattr(torch, d) for d in args.dtype], args.quick)
    text = "\n".join(report(recorder.rows))
    print("\n" + text)
    if args.out:
        with open(os.path.join(args.out, f"report_{name}.txt"), "w") as f:
            f.write(text + "\n")
    return 0
