"""dz = (g @ W) * act'(saved) on the GPU three ways, as CUDA-graph replays (GPU time only):
cuBLAS GEMM then the CUDA act' pass (FusedMLP's cuda backward, whose db comes from its dW
GEMM), cuBLAS GEMM then the Triton dz pass with db (its triton backward), and the Triton GEMM
with act' and the db partials in its epilogue (matmul_act_grad, AMPKERNELS_TRITON_FUSED_DGRAD=1);
the plain GEMM for scale.
    python scripts/matmul_act_grad_probe.py [--out DIR] [--acts gelu_tanh gelu ...]
Shapes (M, K, N): FusedMLP's dh = dout @ W2 in the MLP benchmark's blocks (T=16384, H=1024:
hidden 4096; T=8192, H=4096: hidden 16384) and the linear_act benchmark's 8192x1024x4096.
"""
import argparse
import json
import os

import torch

from ampkernels import _extension
from ampkernels.bench.common import graph_replay_ms, probe_log
from ampkernels.ops import linear_act as la
from ampkernels.reference import activation_id
from ampkernels.triton import linear_act as tla

SHAPES = [(16384, 1024, 4096), (8192, 4096, 16384), (8192, 1024, 4096)]


def _us(fn):
    return graph_replay_ms(fn, warmup=25, rep=200) * 1e3


def _probe(g, w, saved, act):
    """Microseconds for each way of forming dz (and db where it is formed here)."""
    def two_step(backend):
        dz = g.mm(w)
        la._act_backward_(dz, saved, act, backend == "triton", backend)

    return {"cuda": _us(lambda: two_step("cuda")), "triton": _us(lambda: two_step("triton")),
            "fused": _us(lambda: tla.matmul_act_grad(g, w, saved, activation_id(act), True))}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--acts", nargs="+", default=["gelu_tanh", "gelu", "silu"])
    args = ap.parse_args()
    # the CUDA ops register when the extension loads (the backend check does it for the public API)
    assert _extension.load(), "ampkernels._C did not load: the 'cuda' column needs it"
    rows = []
    with probe_log(os.path.join(args.out, "matmul-act-grad.log")) as say:
        say(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {tla.triton.__version__}; "
            "CUDA-graph replay us (median)")
        for dtype in (torch.bfloat16, torch.float16):
            for m, k, n in SHAPES:
                g = torch.randn(m, k, device="cuda", dtype=dtype)
                w = torch.randn(k, n, device="cuda", dtype=dtype) / k ** 0.5
                saved = torch.randn(m, n, device="cuda", dtype=dtype)
                gemm = _us(lambda: g.mm(w))  # noqa: B023 -- timed here, before the loop moves on
                say(f"{str(dtype)[6:]:8s} {m}x{k}x{n} plain GEMM {gemm:.1f} us")
                for act in args.acts:
                    t = _probe(g, w, saved, act)
                    say(f"{str(dtype)[6:]:8s} {m}x{k}x{n} {act:9s} "
                        + "  ".join(f"{kind} {v:7.1f} us" for kind, v in t.items())
                        + f"  (fused - GEMM: {t['fused'] - gemm:.1f} us)")
                    rows.append(dict(dtype=str(dtype), M=m, K=k, N=n, act=act, gemm_us=gemm,
                                     **{f"{kind}_us": v for kind, v in t.items()}))
    with open(os.path.join(args.out, "matmul-act-grad.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
