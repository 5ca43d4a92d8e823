"""A/B, to delete once decided: do the residual adds fused into the norms (convert's
FusedResidualBlocks for timm's ViT, FusedPostNormResidual for BERT) speed up the e2e benchmark's
eager training step? Per model and dtype, three copies trained side by side, their timed steps
interleaved in bursts (as `ampkernels bench --op e2e` does): unconverted, converted as shipped
(adds fused), converted with the adds apart (the fused modules swapped back to the blocks /
add-then-norm). Under torch.compile both converted forms trace alike, so eager only.

    python scripts/ab_residual_fusion.py [--models vit bert] [--dtypes bfloat16 float16] [--steps 30] [--out F]
"""
import argparse
import json
import os
import statistics

import torch

import ampkernels.nn as aknn
from ampkernels.bench import bench_e2e


class _AddThenNorm(torch.nn.Module):
    """FusedPostNormResidual's computation with the add apart: BertSelfOutput's forward."""

    def __init__(self, fused):
        super().__init__()
        self.dense, self.LayerNorm, self.dropout = fused.dense, fused.LayerNorm, fused.dropout

    def forward(self, hidden_states, input_tensor):
        return self.LayerNorm(self.dropout(self.dense(hidden_states)) + input_tensor)


def unfuse(model):
    n = 0
    for _, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            if type(child) is aknn.FusedResidualBlocks:
                setattr(parent, name, torch.nn.Sequential(*child))
                n += 1
            elif type(child) is aknn.FusedPostNormResidual:
                setattr(parent, name, _AddThenNorm(child))
                n += 1
    return n


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["vit", "bert"], choices=["vit", "bert"])
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float16"], choices=["bfloat16", "float16"])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--out", default=None, help="a .jsonl file for the rows")
    args = p.parse_args()
    rows = []
    device = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: tiny models, to try the script
    for name in args.models:
        work = bench_e2e.BUILDERS[name]("full" if device == "cuda" else "tiny", args.steps)
        for dt in args.dtypes:
            mode = {"bfloat16": "amp_bf16", "float16": "amp_fp16"}[dt]
            runs = {"unconverted": bench_e2e._Run(work, mode, False, device),
                    "fused": bench_e2e._Run(work, mode + "_convert", False, device),
                    "apart": bench_e2e._Run(work, mode + "_convert", False, device)}
            swapped = unfuse(runs["apart"].model)
            assert swapped, "convert fused no residual add: nothing to compare"
            warm = args.steps // 2
            for r in runs.values():
                r.run(warm, timed=False)
            bench_e2e.timed_in_turn(list(runs.values()), args.steps - warm)
            for variant, r in runs.items():
                row = dict(model=name, dtype=dt, variant=variant, ms=round(statistics.median(r.times), 3),
                           host_ms=round(statistics.median(r.host), 3),
                           loss=round(r.loss.item(), 4), swapped_back=swapped if variant == "apart" else 0,
                           gpu=torch.cuda.get_device_name() if device == "cuda" else "cpu", torch=torch.__version__,
                           commit=os.environ.get("AMPKERNELS_COMMIT"))
                rows.append(row)
                print(json.dumps(row), flush=True)
            f, a = runs["fused"], runs["apart"]
            print(f"{name} {dt}: fused {statistics.median(f.times):.2f} ms (host {statistics.median(f.host):.2f}) "
                  f"vs apart {statistics.median(a.times):.2f} (host {statistics.median(a.host):.2f}): "
                  f"{statistics.median(a.times) / statistics.median(f.times):.3f}x", flush=True)
            del runs, r, f, a
            if device == "cuda":
                torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as fh:
            fh.writelines(json.dumps(r) + "\n" for r in rows)


if __name__ == "__main__":
    main()
