"""The Hopper ping-pong forward (ampkernels/triton/linear_act_pingpong.py) under other K steps,
operand-ring depths and tile-walk band heights, beside cuBLAS's plain matmul and the tuned TMA
kernel, as CUDA-graph replays (GPU time only), inference (no pre stored), bf16.
    python scripts/pingpong_probe.py [--out DIR] [--acts gelu silu relu]
Each variant's output is checked against F.linear + the activation in fp32 before it is timed.
All variants compile for sm_90 within the H200's 227 KB of shared memory (5 stages of 64: 224 KB).
"""
import argparse
import json
import os

import torch
import torch.nn.functional as F

from ampkernels.bench.common import graph_replay_ms, probe_log
from ampkernels.reference import ACTIVATIONS, act_fwd
from ampkernels.triton import linear_act as tla
from ampkernels.triton import linear_act_pingpong as pp

# (M, K, N): the linear_act benchmark's shapes and FusedMLP's first GEMM in the MLP benchmark
SHAPES = [(4096, 768, 3072), (8192, 1024, 4096), (8192, 4096, 4096), (8192, 4096, 16384), (16384, 1024, 4096)]
# (block_k, stages, group): the default first; (64, 4, 8) was the default until 46194bc
VARIANTS = [(pp.BLOCK_K, pp.STAGES, pp.GROUP_M), (64, 4, 8), (128, 2, 8), (32, 8, 8), (64, 5, 16), (64, 5, 4)]


def _us(fn):
    return graph_replay_ms(fn, warmup=10, rep=50) * 1e3


def _probe_shape(say, rows, m, k, n, acts, programs):
    torch.manual_seed(0)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(n, k, device="cuda") / k ** 0.5).to(torch.bfloat16)
    b = (torch.randn(n, device="cuda") * 0.5).to(torch.bfloat16)
    y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    mm = _us(lambda: torch.mm(x, w.t(), out=y))
    say(f"{m}x{k}x{n} plain matmul {mm:.1f} us")
    z = F.linear(x.float(), w.float(), b.float()).to(torch.bfloat16).float()
    for act in acts:
        aid = ACTIVATIONS.index(act)
        want = act_fwd(z, act)
        tma = _us(lambda aid=aid: tla.linear_act_fwd(x, w, b, aid, False, tma=True, pingpong=False))
        say(f"{m}x{k}x{n} {act:5s} TMA kernel (tuned) {tma:7.1f} us  ratio {mm / tma:.3f}")
        for block_k, stages, group in VARIANTS:
            params = {"block_k": block_k, "stages": stages, "group": group}

            def run(aid=aid, params=params):
                pp.linear_act_fwd_pingpong(x, w, b, aid, y, None, programs, **params)

            y.zero_()
            run()
            err = ((y.float() - want).abs().max() / want.abs().max()).item()
            t = _us(run) if err < 1e-2 else float("nan")
            say(f"{m}x{k}x{n} {act:5s} pingpong " + " ".join(f"{p} {v:3d}" for p, v in params.items())
                + f" {t:7.1f} us  ratio {mm / t:.3f}  max rel err {err:.1e}")
            rows.append({"M": m, "K": k, "N": n, "act": act, "kernel": "pingpong", **params, "us": t, "matmul_us": mm,
                         "tma_us": tma, "max_rel_err": err})


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--acts", nargs="+", default=["gelu", "silu", "relu"])
    args = ap.parse_args()
    programs = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    with probe_log(os.path.join(args.out, "pingpong-probe.log")) as say:
        say(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {tla.triton.__version__}; "
            "bf16 inference forward, us per call (CUDA-graph replay median); ratio = plain matmul's time / this")
        for m, k, n in SHAPES:
            _probe_shape(say, rows, m, k, n, args.acts, programs)
    with open(os.path.join(args.out, "pingpong-probe.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
