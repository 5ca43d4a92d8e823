"""Norm forward probe: torch.compile's own kernels beside ours and candidate Triton launches.

For each N (M = 2^27 / N rows) and op (LayerNorm with weight and bias, RMSNorm with weight),
params in x's dtype (or fp32 with --params fp32, the AMP case; no torch.compile row then):
saves the Triton source torch.compile generates (appended to OUT/inductor-sources.py), prints
the launch config its autotuner picked, and times, with do_bench (L2 flushed), in one process:
  compile             torch.compile of F.layer_norm / F.rms_norm (fresh per shape)
  triton              ampkernels' Triton backend as shipped
  triton+gluon        the same with tln.GLUON on (the Gluon forward, layer_norm_gluon.py, where it
                      takes the call: fp32 params, N 4104-16384); with --params fp32
  reg ROWS/WARPS[/pf][/nostats]  _norm_fwd_kernel with that launch (pf: params loaded with x;
                      nostats: mean/rstd not stored, as for inference)
  chunk BLOCK/WARPS uU  _norm_fwd_chunked_kernel (N a compile-time constant), its loops unrolled U
                      times by Triton (u1: left to the compiler)
TB/s counts x read and y written, as the benchmarks do.

    python scripts/norm_fwd_probe.py --out DIR [--n 768 16384] [--dtype bf16] [--params fp32] [--no-candidates]
"""
import argparse
import json
import os

import torch
import torch.nn.functional as F
from triton.testing import do_bench

import ampkernels
from ampkernels.triton import layer_norm as tln

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--out", default=os.environ.get("OUT", "."))
parser.add_argument("--n", type=int, nargs="+", default=[768, 1024, 8192, 16384, 32768])
parser.add_argument("--dtype", choices=("bf16", "fp16"), nargs="+", default=["bf16"])
parser.add_argument("--no-compile", action="store_true", help="skip torch.compile (its source and time)")
parser.add_argument("--params", choices=("x", "fp32"), default="x", help="weight/bias dtype: x's, or fp32 (AMP)")
parser.add_argument("--no-candidates", action="store_true", help="only the shipped kernels (and the Gluon one)")
args = parser.parse_args()
os.makedirs(args.out, exist_ok=True)
results = open(os.path.join(args.out, "norm-fwd-probe.jsonl"), "a")


def candidates(n, wide):
    """(kind, a, b, c): reg (ROWS, warps, (params first, stats stored)) or chunk (BLOCK_N, warps,
    (unroll, stats stored)); the register kernel up to 16384 elements, the chunked one from 8192
    (with 32 warps too past 16384: fewer rows in flight, so more of each row is still in L2 for
    the second pass). wide: fp32 params with 16-bit x."""
    block = 1 << (n - 1).bit_length()
    cands = []
    if wide and block <= 16384:
        cands += [("reg", r, w, (False, True)) for r, w in ((1, 4), (1, 8), (2, 8), (1, 16), (2, 16))
                  if 32 * w <= block * r]
    elif block <= 2048:
        cands += [("reg", r, w, (pf, st)) for r, w, pf in ((2, 2, False), (1, 1, True), (2, 2, True))
                  for st in (True, False)]
    elif block <= 16384:
        cands += [("reg", 1, 4 if block <= 8192 else 8, (False, st)) for st in (True, False)]
    if block >= 8192:
        cands += [("chunk", b, w, (u, True)) for b, w, u in ((2048, 8, 8), (2048, 16, 8), (4096, 8, 8), (4096, 16, 8),
                                                            (4096, 16, 4), (2048, 16, 1), (2048, 8, 1), (4096, 16, 1))]
    if block > 16384:
        cands += [("chunk", b, 32, (u, True)) for b, u in ((4096, 8), (8192, 4), (8192, 2))]
    return cands


def launcher(kind, a, b, c, x, w, bias, is_rms):
    m, n = x.shape
    y = torch.empty_like(x)
    mean = torch.empty(m, device=x.device, dtype=torch.float32)
    rstd = torch.empty_like(mean)
    ptrs = (x, x, w, x if bias is None else bias, y, x, rstd if is_rms else mean, rstd)
    flags = dict(IS_RMS=is_rms, HAS_R=False, HAS_W=True, HAS_B=bias is not None)
    block = 1 << (n - 1).bit_length()

    def go():  # launches, returns y
        if kind == "reg":
            tln._norm_fwd_kernel[(-(-m // a),)](*ptrs, m, n, 1e-5, **flags, BLOCK_N=block, ROWS=a, PARAMS_FIRST=c[0],
                                                STORE_STATS=c[1], num_warps=b)
        else:
            tln._norm_fwd_chunked_kernel[(m,)](*ptrs, m, 1e-5, int(c[1]), N=n, **flags, BLOCK_N=a,
                                               UNROLL=c[0], EVEN=n % a == 0, num_warps=b)
        return y
    return go


def inductor_configs():
    """The launch configs inductor's autotuner settled on, for the kernels alive now."""
    import gc
    from torch._inductor.runtime.triton_heuristics import CachingAutotuner
    found = []
    for obj in gc.get_objects():
        try:  # (dead weak proxies among the objects raise on any access)
            if isinstance(obj, CachingAutotuner) and obj.launchers:
                cfg = obj.launchers[0].config
                found.append(f"{obj.fn.__name__}: {cfg.kwargs} num_warps={cfg.num_warps} num_stages={cfg.num_stages}")
        except ReferenceError:
            pass
    return "; ".join(found) or "none found"


def record(op, dtype, n, name, fn, ref):
    err = (fn().float() - ref).abs().max().item()
    ms = do_bench(fn, warmup=25, rep=200)
    m = 2**27 // n
    tbps = 2 * m * n * 2 / ms / 1e9
    print(f"{op:10s} {dtype} N={n:6d} {name:22s} {tbps:6.3f} TB/s ({ms * 1e3:7.1f} us) max err {err:.3g}", flush=True)
    results.write(json.dumps(dict(op=op, dtype=dtype, N=n, provider=name, TBps=round(tbps, 3), ms=ms,
                                  gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                                  commit=os.environ.get("AMPKERNELS_COMMIT", ""))) + "\n")


for dname in args.dtype:
    dtype = torch.bfloat16 if dname == "bf16" else torch.float16
    dname += "/fp32p" if args.params == "fp32" else ""  # the label of every row
    for n in args.n:
        m = 2**27 // n
        x = torch.randn(m, n, device="cuda", dtype=dtype)
        pdtype = torch.float32 if args.params == "fp32" else dtype
        w = torch.rand(n, device="cuda", dtype=pdtype)
        b = torch.randn(n, device="cuda", dtype=pdtype)
        for op in ("layer_norm", "rms_norm"):
            is_rms = op == "rms_norm"
            bias = None if is_rms else b
            if is_rms:
                def eager(x, w, b):
                    return F.rms_norm(x, (n,), w, eps=1e-5)
            else:
                def eager(x, w, b):
                    return F.layer_norm(x, (n,), w, b, eps=1e-5)
            ref = eager(x.float(), w.float(), b.float())
            if not args.no_compile and n <= 16384 and args.params == "x":  # (F.layer_norm takes one dtype)
                torch._dynamo.reset()
                __import__("gc").collect()  # earlier shapes' kernels: inductor_configs() lists the live ones
                compiled = torch.compile(eager)
                from torch._inductor.utils import run_and_get_code
                _, codes = run_and_get_code(compiled, x, w, b)
                with open(os.path.join(args.out, "inductor-sources.py"), "a") as f:
                    f.write(f"\n\n# ==== {op} {dname} N={n}\n\n" + "\n\n# ----\n\n".join(codes))
                record(op, dname, n, "compile", lambda: compiled(x, w, b), ref)
                print(f"  torch.compile picked: {inductor_configs()}", flush=True)
            if is_rms:
                record(op, dname, n, "triton", lambda: ampkernels.rms_norm(x, (n,), w, backend="triton"), ref)
            else:
                record(op, dname, n, "triton", lambda: ampkernels.layer_norm(x, (n,), w, b, backend="triton"), ref)
            if args.params == "fp32" and tln._gluon.available():
                def shipped(x=x, w=w, bias=bias, n=n, is_rms=is_rms):
                    if is_rms:
                        return ampkernels.rms_norm(x, (n,), w, backend="triton")
                    return ampkernels.layer_norm(x, (n,), w, bias, backend="triton")
                tln.GLUON = True
                try:
                    record(op, dname, n, "triton+gluon", shipped, ref)
                finally:
                    tln.GLUON = False
            for kind, a, c_w, c in [] if args.no_candidates else candidates(n, args.params == "fp32"):
                fn = launcher(kind, a, c_w, c, x, w, bias, is_rms)
                variant = ("/pf" * c[0]) if kind == "reg" else f" u{c[0]}"
                name = f"{kind} {a}/{c_w}{variant}" + "/nostats" * (not c[1])
                try:
                    record(op, dname, n, name, fn, ref)
                except Exception as e:  # a launch that does not fit: say so, go on
                    print(f"{op:10s} {dname} N={n:6d} {name:22s} failed: {type(e).__name__}: {str(e)[:200]}")
        del x, w, b
results.close()
