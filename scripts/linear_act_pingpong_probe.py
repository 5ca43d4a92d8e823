"""The Triton linear_act forward kernels side by side on the GPU: the TMA kernel and the Hopper
ping-pong kernel (linear_act_pingpong.py), forced, against cuBLAS's plain matmul (F.linear without
bias), all timed as CUDA-graph replays (GPU time, no host work), per activation and with the
pre-activation stored (training) or not (inference).
    AMPKERNELS_TRITON_AUTOTUNE=0 python scripts/linear_act_pingpong_probe.py [--out DIR]
(with autotuning off the TMA kernel runs its first config, the one picked at 8192x1024x4096)
"""
import argparse
import json
import os

import torch
import torch.nn.functional as F

from ampkernels.bench.common import graph_replay_ms, probe_log
from ampkernels.reference import ACTIVATIONS
from ampkernels.triton import linear_act as tla

SHAPES = [(4096, 768, 3072), (8192, 1024, 4096), (8192, 4096, 4096), (8192, 4096, 16384)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--acts", nargs="+", default=["relu", "gelu", "silu"])
    args = ap.parse_args()
    with probe_log(os.path.join(args.out, "linear-act-pingpong.log")) as say:
        say(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {tla.triton.__version__}; "
            "CUDA-graph replay ms; ratio = plain matmul time / kernel time")
        rows = []
        for dtype in (torch.bfloat16, torch.float16):
            for m, k, n in SHAPES:
                x = torch.randn(m, k, device="cuda", dtype=dtype)
                w = torch.randn(n, k, device="cuda", dtype=dtype) / k ** 0.5
                b = torch.randn(n, device="cuda", dtype=dtype)
                mm = graph_replay_ms(lambda: F.linear(x, w), warmup=25, rep=200)
                say(f"{str(dtype)[6:]:8s} {m}x{k}x{n} plain matmul {mm * 1e3:.1f} us, {2 * m * n * k / mm / 1e9:.0f} TFLOP/s")
                for act in args.acts:
                    a = ACTIVATIONS.index(act)
                    for store_pre in (False, True):
                        t = {kind: graph_replay_ms(lambda: tla.linear_act_fwd(x, w, b, a, store_pre, tma=True,
                                                                              pingpong=kind == "pingpong"),
                                                   warmup=25, rep=200) for kind in ("tma", "pingpong")}
                        say(f"{str(dtype)[6:]:8s} {m}x{k}x{n} {act:9s} pre={int(store_pre)}  "
                            + "  ".join(f"{kind} {v * 1e3:7.1f} us {mm / v:.3f}" for kind, v in t.items()))
                        rows.append(dict(dtype=str(dtype), M=m, K=k, N=n, act=act, store_pre=store_pre, matmul_ms=mm,
                                         **{f"{kind}_ms": v for kind, v in t.items()}))
    with open(os.path.join(args.out, "linear-act-pingpong.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
