"""A/B of one norm kernel choice: run it once per setting of an env switch, from one build.
Times the forward (x read, y written) or the backward alone (x and dy read, dx written), as
the benchmarks count bytes, at the benchmark's N (M = 2^27 / N rows). For example

    AMPKERNELS_NORM_BWD_PIPE=0 python scripts/norm_ab.py --pass bwd            # per-row CUDA kernels
    python scripts/norm_ab.py --pass bwd                                       # the default
    python scripts/norm_ab.py --pass fwd --params fp32 --backend triton
    python scripts/norm_ab.py --pass fwd --residual                            # x + residual, normalised
    AMPKERNELS_TRITON_NORM_BWD_STAGES=1 python scripts/norm_ab.py --pass bwd --backend triton
    python scripts/norm_ab.py --pass fwd --backend triton --n 8192 16384 32768 65536

Each line is labelled with the AMPKERNELS_* variables that were set.
"""
import argparse
import functools
import os

import torch
from triton.testing import do_bench

import ampkernels

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--pass", dest="which", choices=("fwd", "bwd"), default="bwd")
parser.add_argument("--backend", choices=("cuda", "triton", "auto"), default="cuda")
parser.add_argument("--params", choices=("x", "fp32"), default="x",
                    help="weight/bias dtype: the input's, or fp32 (the AMP case)")
parser.add_argument("--n", type=int, nargs="+", default=[768, 1024, 2048, 4096, 8192, 16384])
parser.add_argument("--residual", action="store_true",
                    help="forward only: fused residual add in x's dtype (x and residual read, out and the sum written)")
args = parser.parse_args()
if args.residual and args.which != "fwd":
    parser.error("--residual times the forward only (--pass fwd)")

label = " ".join(f"{k}={v}" for k, v in sorted(os.environ.items())
                 if k.startswith("AMPKERNELS_") and k != "AMPKERNELS_COMMIT") or "(defaults)"
for dtype in (torch.bfloat16, torch.float16):
    pdtype = torch.float32 if args.params == "fp32" else dtype
    for n in args.n:
        m = 2**27 // n
        x = torch.randn(m, n, device="cuda", dtype=dtype, requires_grad=args.which == "bwd")
        w = torch.rand(n, device="cuda", dtype=pdtype, requires_grad=args.which == "bwd")
        b = torch.randn(n, device="cuda", dtype=pdtype, requires_grad=args.which == "bwd")
        dy = torch.randn(m, n, device="cuda", dtype=dtype)
        res = torch.randn(m, n, device="cuda", dtype=dtype) if args.residual else None
        for op in ("layer_norm", "rms_norm"):
            fwd = (functools.partial(ampkernels.layer_norm, x, (n,), w, b, residual=res, backend=args.backend)
                   if op == "layer_norm" else
                   functools.partial(ampkernels.rms_norm, x, (n,), w, residual=res, backend=args.backend))
            if args.which == "fwd":
                ms = do_bench(fwd, warmup=25, rep=200)
                moved = (4 if args.residual else 2) * m * n * x.element_size()
            else:
                y = fwd()
                inputs = (x, w, b) if op == "layer_norm" else (x, w)
                ms = do_bench(functools.partial(torch.autograd.grad, y, inputs, dy, retain_graph=True),
                              warmup=25, rep=200)
                moved = 3 * m * n * x.element_size()
                del y
            print(f"{label} {args.backend} {op} {args.which}{'+residual' if args.residual else ''} {str(dtype)[6:]} "
                  f"params={args.params} N={n}: "
                  f"{moved / ms / 1e9:.2f} TB/s ({ms * 1e3:.1f} us)", flush=True)
        del x, w, b, dy, res  # free this N before the next one
