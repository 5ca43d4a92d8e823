"""The Triton dz pass (dz = dy * act'(saved) + fp32 dbias partials) under several launch shapes,
beside the CUDA act' pass and torch's dy * saved (same traffic: two reads, one write), as
CUDA-graph replays; then FusedMLP's training step per backend, timed plainly and as a graph
replay (the difference is the host's share).
    python scripts/dz_pass_probe.py [--out DIR]
"""
import argparse
import os

import torch

from ampkernels import _extension
from ampkernels.bench.common import bench, graph_replay_ms, probe_log
from ampkernels.nn import FusedMLP
from ampkernels.reference import activation_id
from ampkernels.triton import cdiv
from ampkernels.triton import linear_act as tla

SHAPES = [(16384, 4096), (8192, 16384)]  # FusedMLP's hidden gradient in the MLP benchmark


def _dz(dy, saved, act, bm, bn, sub, warps, want_db):
    M, N = dy.shape
    grid = (cdiv(M, bm), cdiv(N, bn))
    part = torch.empty((grid[0], N), dtype=torch.float32, device=dy.device) if want_db else dy
    tla._linear_act_dz_kernel[grid](dy, saved, dy, part, M, N, ACT=act, WANT_PARTIAL=want_db,
                                    BLOCK_M=bm, BLOCK_N=bn, SUB_M=sub, num_warps=warps)
    return part.sum(0) if want_db else None


def _probe_shape(say, m, n, dtype, act):
    dy = torch.randn(m, n, device="cuda", dtype=dtype)
    saved = torch.randn(m, n, device="cuda", dtype=dtype)
    out = torch.empty_like(dy)
    gb = 3 * m * n * dy.element_size() / 1e9

    def row(name, fn):
        us = graph_replay_ms(fn, warmup=25, rep=200) * 1e3
        say(f"{m}x{n} {str(dtype)[6:]} {name:38s} {us:8.1f} us {gb / us * 1e3:5.2f} TB/s")

    row("torch mul (same traffic)", lambda: torch.mul(dy, saved, out=out))
    row("cuda act' pass (no db)", lambda: torch.ops.ampkernels.act_backward_cuda_(dy, saved, act, False))
    row("cuda act' pass db=1", lambda: torch.ops.ampkernels.act_backward_cuda_(dy, saved, act, True))
    row("cuda bias_act_bwd db=1 (new dz)", lambda: torch.ops.ampkernels.bias_act_bwd_cuda(dy, saved, act, torch.float32))
    for launch in [(64, 128, 16, 4), (64, 128, 32, 4), (128, 128, 16, 4), (128, 128, 32, 8),
                   (32, 128, 16, 4), (64, 256, 16, 8)]:
        for want_db in (True, False):
            row("triton {}x{} sub {} w{}".format(*launch) + f" db={int(want_db)}",
                lambda launch=launch, want_db=want_db: _dz(dy, saved, act, *launch, want_db))


def _fused_mlp_step(say, t, h, backend):
    mlp = FusedMLP(h, 4 * h, activation="gelu_tanh", backend=backend).cuda().to(torch.bfloat16)
    x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def step():
        mlp(x).sum().backward()

    plain = bench(step, warmup=10, rep=100)[0] * 1e3
    try:
        graph = graph_replay_ms(step, warmup=10, rep=100) * 1e3
    except Exception as e:  # noqa: BLE001 -- a probe: say why and go on
        say(f"FusedMLP {backend}: graph capture failed: {e!r}"[:300])
        graph = float("nan")
    say(f"FusedMLP T={t} H={h} bf16 {backend:6s} step plain {plain:8.1f} us  graph {graph:8.1f} us")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    # the CUDA ops register when the extension loads (the backend check does it for the public API)
    assert _extension.load(), "ampkernels._C did not load: the 'cuda' column needs it"
    with probe_log(os.path.join(args.out, "dz-pass.log")) as say:
        say(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {tla.triton.__version__}; "
            "us per call, CUDA-graph replay median; TB/s counts dy, saved read and dz written")
        for m, n in SHAPES:
            _probe_shape(say, m, n, torch.bfloat16, activation_id("gelu"))
        _fused_mlp_step(say, 16384, 1024, "cuda")
        _fused_mlp_step(say, 16384, 1024, "triton")


if __name__ == "__main__":
    main()
