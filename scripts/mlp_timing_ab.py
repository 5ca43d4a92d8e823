"""Does timing the MLP block's providers one after the other or in interleaved rounds change
their times? At 7d4dbb7, interleaved rounds measured ampkernels' providers at T=16384 H=1024
9-65% slower than ampkernels/bench/bench_mlp.py's sequential timing while eager's rows matched
(benchmarks/results/h200-2026-12-01-7d4dbb7-mlp-interleaved-report.txt). This times, in one
process, the same providers (bench_mlp._providers, each in its own environment):

  A. sequential: each provider in turn, do_bench (rep 200 ms) as bench_mlp times it, but with
     every provider's step built (and warmed up) first, where bench_mlp builds one at a time:
     A against bench_mlp's rows tells whether the others' presence matters, B against A
     whether the interleaving does;
  B. interleaved: every step kept alive, 5 rounds of do_bench (rep 100 ms) over the providers
     in turn, each round's median printed; B2: the same without the fp32 provider (17 ms fp32
     steps between rounds heat the GPU);
  C. sequential again, with B's steps (and their memory) still alive.

    python scripts/mlp_timing_ab.py [T H] [--out DIR]
"""
import argparse
import os
import statistics

import torch
from ampkernels.bench.bench_mlp import _providers, make_step, provider_env
from ampkernels.bench.common import bench, probe_log

p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
p.add_argument("shape", nargs="*", type=int, default=[16384, 1024], help="T H")
p.add_argument("--out", default=".")
args = p.parse_args()
tokens, hidden = args.shape

providers, eager = _providers(hidden)
steps = {}
for name, block, dtype in providers:
    _, step = make_step(block, eager, dtype, tokens, hidden)
    with provider_env(name):
        for _ in range(3):
            step()
    steps[name] = step
torch.cuda.synchronize()


def timed(name, rep):
    with provider_env(name):
        return bench(steps[name], rep=rep)[0]


with probe_log(os.path.join(args.out, "mlp-timing-ab.log")) as say:
    say(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}; T={tokens} H={hidden}; ms per step")
    sequential = {name: timed(name, 200) for name in steps}
    rounds = {}
    for label, names in (("B", list(steps)), ("B2", [n for n in steps if n != "fp32"])):
        rounds[label] = {name: [] for name in names}
        for _ in range(5):
            for name in names:
                rounds[label][name].append(timed(name, 100))
    again = {name: timed(name, 200) for name in steps}
    say(f"{'provider':45s} {'A seq':>7s} {'B med':>7s} {'B2 med':>7s} {'C seq':>7s}   B rounds")
    for name in steps:
        b, b2 = rounds["B"][name], rounds["B2"].get(name)
        say(f"{name:45s} {sequential[name]:7.3f} {statistics.median(b):7.3f} "
            f"{statistics.median(b2) if b2 else float('nan'):7.3f} {again[name]:7.3f}   "
            + " ".join(f"{v:.3f}" for v in b))
