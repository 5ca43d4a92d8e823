"""A/B of the CUDA norm backward: the backward alone (x and dy read, dx written, as the
benchmarks count bytes) for the cuda backend at the benchmark's N (M = 2^27 / N rows).
Run it once per kernel choice, e.g.

    AMPKERNELS_NORM_BWD_PIPE=0 python scripts/norm_bwd_ab.py   # the per-row kernels
    python scripts/norm_bwd_ab.py                              # the default choice
"""
import functools
import os

import torch
from triton.testing import do_bench

import ampkernels

label = f"AMPKERNELS_NORM_BWD_PIPE={os.environ.get('AMPKERNELS_NORM_BWD_PIPE', '(unset)')}"
for dtype in (torch.bfloat16, torch.float16):
    for n in (768, 1024, 2048, 4096, 8192, 16384):
        m = 2**27 // n
        x = torch.randn(m, n, device="cuda", dtype=dtype, requires_grad=True)
        w = torch.rand(n, device="cuda", dtype=dtype, requires_grad=True)
        b = torch.randn(n, device="cuda", dtype=dtype, requires_grad=True)
        dy = torch.randn(m, n, device="cuda", dtype=dtype)
        for op in ("layer_norm", "rms_norm"):
            y = (ampkernels.layer_norm(x, (n,), w, b, backend="cuda") if op == "layer_norm"
                 else ampkernels.rms_norm(x, (n,), w, backend="cuda"))
            inputs = (x, w, b) if op == "layer_norm" else (x, w)
            ms = do_bench(functools.partial(torch.autograd.grad, y, inputs, dy, retain_graph=True), warmup=25, rep=200)
            print(f"{label} {op} bwd {str(dtype)[6:]} N={n}: {3 * m * n * x.element_size() / ms / 1e9:.2f} TB/s"
                  f" ({ms * 1e3:.1f} us)", flush=True)
        del x, w, b, dy, y, inputs  # free this N before the next one
