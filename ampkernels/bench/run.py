"""`ampkernels bench`: run benchmark modules side by side, write rows, report targets, plot.

    ampkernels bench --op layer_norm linear_act --dtype float16 --quick --out results/
    python -m ampkernels.bench.run --op all            # the same, from a source checkout

Each op's module (bench_<module>.py) has run(recorder, dtypes, quick) and report(rows).
Public kernels (Liger-Kernel, QuACK, Apex, flash-attn's Triton norms) are measured beside
ours when they import here (providers.py); none is required.
Without a GPU, a clearly labelled CPU demo runs the ops' reference path instead: it
checks results against the float64 reference and times them, which says nothing about
GPU speed; `--op e2e` and `--op host` run CPU versions of their own (tiny models, the
torch reference path), equally labelled.
The e2e options (--models, --modes, --no-compile / --compile-only, --steps) slice that run.
"""
import argparse
import importlib
import os
import sys
import time

import torch

from . import providers
from .common import Recorder, bench, environment

MODULES = {"layer_norm": "bench_layer_norm", "rms_norm": "bench_layer_norm", "linear_act": "bench_linear_act",
           "linear_cross_entropy": "bench_linear_cross_entropy", "gated_linear_act": "bench_gated_linear_act",
           "mlp": "bench_mlp", "e2e": "bench_e2e", "host": "bench_host"}
# ops with a CPU version of their own (without a GPU, the others share cpu_demo)
CPU_OWN = ("e2e", "host")
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


def cpu_demo(recorder):
    """The ops on CPU through the torch reference backend, checked against float64 math."""
    import ampkernels
    from ampkernels import reference

    print("NO GPU: running ampkernels' torch reference path on the CPU. These timings say nothing about\n"
          "GPU speed; run `ampkernels bench` on a CUDA machine for the real comparison.\n", flush=True)
    torch.manual_seed(0)
    x = torch.randn(2048, 1024)
    w, b = torch.randn(1024) * 0.1 + 1, torch.randn(1024) * 0.1
    lin_x, lin_w, lin_b = torch.randn(512, 1024), torch.randn(2048, 1024) * 0.03, torch.randn(2048) * 0.1
    target = torch.randint(0, 2048, (512,))
    cases = {
        "layer_norm": (lambda: ampkernels.layer_norm(x, (1024,), w, b, backend="torch"),
                       lambda: torch.nn.functional.layer_norm(x, (1024,), w, b),
                       lambda: reference.layer_norm(x.double(), (1024,), w.double(), b.double())),
        "rms_norm": (lambda: ampkernels.rms_norm(x, (1024,), w, 1e-6, backend="torch"),
                     lambda: torch.nn.functional.rms_norm(x, (1024,), w, 1e-6),
                     lambda: reference.rms_norm(x.double(), (1024,), w.double(), 1e-6)),
        "linear_act": (lambda: ampkernels.linear_act(lin_x, lin_w, lin_b, "gelu_tanh", backend="torch"),
                       lambda: torch.nn.functional.gelu(torch.nn.functional.linear(lin_x, lin_w, lin_b), approximate="tanh"),
                       lambda: reference.linear_act(lin_x.double(), lin_w.double(), lin_b.double(), "gelu_tanh")),
        "linear_cross_entropy": (
            lambda: ampkernels.linear_cross_entropy(lin_x, lin_w, target, lin_b, backend="torch"),
            lambda: torch.nn.functional.cross_entropy(torch.nn.functional.linear(lin_x, lin_w, lin_b), target),
            lambda: reference.linear_cross_entropy(lin_x.double(), lin_w.double(), target, lin_b.double())),
    }
    ok = True
    for op, (ours, eager, ref) in cases.items():
        expected = ref()
        err = ((ours().double() - expected).norm() / expected.norm()).item()
        ok &= err < 1e-5
        for provider, fn in (("ampkernels-torch", ours), ("eager", eager)):
            ms = bench(fn)[0]
            recorder.add(op=op, provider=provider, **{"pass": "fwd"}, dtype="float32", device="cpu",
                         metric="ms (CPU, not a GPU number)", value=round(ms, 3), rel_err_vs_fp64=err)
    print(f"\nCPU demo: results {'match' if ok else 'DO NOT match'} the float64 reference.", flush=True)
    return ok


def _shapes_for(module, specs):
    """--shapes parsed for one benchmark module: the specs of its form (N, MxKxN or TxH)."""
    if not specs:
        return None
    dims = {"bench_layer_norm": 1, "bench_linear_act": 3, "bench_linear_cross_entropy": 3,
            "bench_gated_linear_act": 3, "bench_mlp": 2}.get(module)
    parsed = [tuple(int(d) for d in s.lower().split("x")) for s in specs]
    mine = [p for p in parsed if len(p) == dims]
    return [p[0] for p in mine] if dims == 1 else mine or None


def main(argv=None):
    p = argparse.ArgumentParser(prog="ampkernels bench", description=__doc__.splitlines()[0])
    p.add_argument("--op", nargs="+", default=["all"], choices=["all"] + list(MODULES))
    p.add_argument("--dtype", nargs="+", default=["float16", "bfloat16"], choices=list(DTYPES))
    p.add_argument("--quick", action="store_true", help="fewer shapes and repetitions")
    p.add_argument("--out", default=None, help="folder for results.jsonl, results.csv and report.txt (default: ./bench-out)")
    p.add_argument("--plot", action="store_true", help="also draw PNG plots into --out (needs matplotlib)")
    p.add_argument("--shapes", nargs="+", default=None, metavar="SHAPE",
                   help="instead of each op's default list: N for layer_norm/rms_norm (rows = 2^27 / N), "
                        "MxKxN for linear_act, TxHxV for linear_cross_entropy, TxKxH for gated_linear_act, "
                        "TxH (tokens x hidden) for mlp; "
                        "e2e keeps its model")
    from . import bench_e2e
    bench_e2e.add_arguments(p)
    args = p.parse_args(argv)
    out = args.out or os.path.join(os.getcwd(), "bench-out")
    recorder = Recorder(out)
    env = environment()
    print(f"ampkernels bench on {env['gpu']} (cc {env['cc']}), torch {env['torch']}, triton {env['triton']}, "
          f"commit {env['commit']}; rows -> {recorder.path}", flush=True)
    print(providers.describe(providers.discover()), flush=True)
    ops = list(MODULES) if "all" in args.op else args.op
    ok = True
    if not torch.cuda.is_available():
        # the op benchmarks' CPU demo, unless only ops with a CPU version of their own were asked for
        if "all" in args.op or set(ops) - set(CPU_OWN):
            ok = cpu_demo(recorder)
            if "all" in args.op:
                return 0 if ok else 1
        ops = [o for o in ops if o in CPU_OWN]
    modules = list(dict.fromkeys(MODULES[o] for o in ops))
    dtypes = [DTYPES[d] for d in args.dtype]
    report = []
    for i, name in enumerate(modules, 1):
        t0 = time.time()
        print(f"\n[{i}/{len(modules)}] {name}", flush=True)
        try:
            mod = importlib.import_module(f".{name}", __package__)
        except ImportError as e:
            print(f"  skipped: {e}", flush=True)
            continue
        first = len(recorder.rows)
        shapes = _shapes_for(name, args.shapes)
        kwargs = {"shapes": shapes} if shapes else bench_e2e.options(args) if name == "bench_e2e" else {}
        mod.run(recorder, dtypes, args.quick, **kwargs)
        report += mod.report(recorder.rows[first:])
        print(f"  {name} took {time.time() - t0:.0f}s", flush=True)
    text = "\n".join(["targets (docs/design.md), measured in this run:"] + [f"  {line}" for line in report])
    print("\n" + text)
    with open(os.path.join(out, "report.txt"), "w") as f:
        f.write(text + "\n")
    if args.plot:
        from .plot import plot_all
        plot_all(recorder.path, out)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
