"""layer_norm / rms_norm benchmark: every implementation side by side in one run.

Providers, per op (layer_norm, rms_norm), dtype and N (M = 2^27 / N rows):
  copy                   x -> out device copy: the bandwidth ceiling (op "copy")
  eager                  F.layer_norm / F.rms_norm, params in x.dtype
  compile                torch.compile of eager, fresh per shape (torch._dynamo.reset())
  autocast               nn.LayerNorm / nn.RMSNorm with fp32 params on fp16/bf16 x under
                         autocast (fwd only; torch upcasts and returns fp32)
  ampkernels-<backend>   each live backend, params in x.dtype
  ampkernels-<backend>-autocast   the same under autocast with fp32 params (the AMP case)
Bytes (as ../shared/baselines): fwd = x read + y written, bwd = x and dy read + dx written,
all at x's element size (so the autocast rows are "TB/s-equivalent"). Backward is timed alone
(retain_graph, grads set to None between runs). Rows: TB/s with median/p20/p80 ms.

    python -m benchmarks.bench_layer_norm --out DIR [--quick]
"""

import torch
import torch.nn.functional as F

from .common import bench, guard, standalone_main

NS = (768, 1024, 2048, 4096, 8192, 16384)
QUICK_NS = (768, 2048, 8192, 16384)
TOTAL = 2**27
OPS = ("layer_norm", "rms_norm")
FWD_TARGET, BWD_TARGET, BACKEND_SHARE, AUTOCAST_SPEEDUP = 3.9, 3.2, 0.85, 5.0


def _eager(op, n):
    if op == "layer_norm":
        return lambda x, w, b: F.layer_norm(x, (n,), w, b, 1e-5)
    return lambda x, w, b: F.rms_norm(x, (n,), w, 1e-5)


def _ours(op, n, backend):
    import ampkernels
    if op == "layer_norm":
        return lambda x, w, b: ampkernels.layer_norm(x, (n,), w, b, 1e-5, backend=backend)
    return lambda x, w, b: ampkernels.rms_norm(x, (n,), w, 1e-5, backend=backend)


def _module(op, n):
    m = torch.nn.LayerNorm(n, device="cuda") if op == "layer_norm" else torch.nn.RMSNorm(n, eps=1e-5, device="cuda")
    return lambda x, w, b: m(x)


def _record(recorder, op, provider, pas, dtype, n, m, ms, nbytes, **extra):
    med, p20, p80 = ms
    return recorder.add(op=op, provider=provider, **{"pass": pas}, dtype=str(dtype).replace("torch.", ""), N=n, M=m,
                        shape=f"{m}x{n}", metric="TB/s", value=round(nbytes / med / 1e9, 3), ms=round(med, 4),
                        ms_p20=round(p20, 4), ms_p80=round(p80, 4), **extra)


def _fwd_bwd(recorder, op, provider, fn, x, w, b, dy, n, quick, autocast=None, bwd=True):
    m = x.shape[0]
    e = x.element_size()
    timing = dict(warmup=10 if quick else 25, rep=40 if quick else 100)
    ctx = (lambda: torch.autocast("cuda", dtype=autocast)) if autocast else torch.enable_grad

    def fwd():
        with ctx(), torch.no_grad():
            return fn(x, w, b)

    fwd()  # compile / warm up outside the timing
    extra = {}
    if provider.startswith("ampkernels-"):
        # the same forward replayed from a CUDA graph: the kernels without host time (diagnostic)
        extra["graph_TBps"] = round(2 * m * n * e / _graph_ms(fwd, timing) / 1e9, 3)
    _record(recorder, op, provider, "fwd", x.dtype, n, m, bench(fwd, **timing), 2 * m * n * e, **extra)
    if not bwd:
        return
    leaves = [t.detach().requires_grad_() for t in (x, w, b) if t is not None]
    xg, wg = leaves[0], leaves[1]
    bg = leaves[2] if len(leaves) > 2 else None
    with ctx():
        out = fn(xg, wg, bg)
    out.backward(dy, retain_graph=True)
    _record(recorder, op, provider, "bwd", x.dtype, n, m,
            bench(lambda: out.backward(dy, retain_graph=True), grad_to_none=leaves, **timing), 3 * m * n * e)
    del out


def _graph_ms(fn, timing):
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return bench(graph.replay, **timing)[0]


# N: ([(ROWS, num_warps) forward], [(ROWS, num_warps) backward]); each pair is one Triton compile
SWEEP = {768: ([(2, 4), (4, 4), (4, 8), (8, 8), (8, 16)], [(1, 4), (2, 4), (4, 8), (8, 8), (8, 16)]),
         2048: ([(1, 4), (1, 8), (2, 8), (4, 8), (4, 16)], [(1, 4), (1, 8), (2, 8), (2, 16), (4, 16)]),
         8192: ([(1, 8), (1, 16), (1, 32)], [(1, 8), (1, 16), (1, 32)]),
         16384: ([(1, 8), (1, 16), (1, 32)], [(1, 16), (1, 32)])}


def sweep(recorder, ns=QUICK_NS, dtype=torch.float16):
    """Triton launch configurations (ROWS, num_warps, programs per SM, looped) for the
    LayerNorm launchers alone, timed side by side: the data behind _fwd_config/_bwd_config."""
    import triton
    from ampkernels.triton import layer_norm as tln

    fwd_config, bwd_config = tln._fwd_config, tln._bwd_config
    try:
        for n in ns:
            m = TOTAL // n
            block = triton.next_power_of_2(n)
            x = torch.randn(m, n, device="cuda", dtype=dtype)
            dy = torch.randn_like(x)
            w, b = torch.rand(n, device="cuda", dtype=dtype) + 0.5, torch.randn(n, device="cuda", dtype=dtype)
            fcands = SWEEP[n][0]
            for rows, warps in fcands:
                tln._fwd_config = lambda _n, c=(block, rows, warps): c
                fn = lambda: tln.norm_fwd(x, w, b, None, 1e-5, False, None, False)  # noqa: E731
                guard(recorder, "sweep", lambda: recorder.add(
                    op="layer_norm", provider=f"sweep-triton-r{rows}-w{warps}", **{"pass": "fwd"},
                    dtype=str(dtype)[6:], N=n, M=m, metric="TB/s-sweep",
                    value=round(2 * m * n * 2 / bench(fn, warmup=5, rep=20)[0] / 1e9, 3)))
            mean, rstd = tln.norm_fwd(x, w, b, None, 1e-5, False, None, False)[2:]
            bcands = [(block, r, wp, ps, False) for r, wp in SWEEP[n][1] for ps in (1, 2, 4, 8) if 16 <= wp * ps <= 64]
            if n >= 8192:
                bcands += [(4096, 1, 16, 1, True), (4096, 1, 8, 2, True)]
            for cfg in bcands:
                tln._bwd_config = lambda _n, c=cfg: c
                fn = lambda: tln.norm_bwd(dy, x, w, mean, rstd, None, False, True, True, dtype, None, None)  # noqa
                guard(recorder, "sweep", lambda: recorder.add(
                    op="layer_norm", provider="sweep-triton-r%d-w%d-p%d%s" % (cfg[1], cfg[2], cfg[3],
                                                                               "-looped" if cfg[4] else ""),
                    **{"pass": "bwd"}, dtype=str(dtype)[6:], N=n, M=m, metric="TB/s-sweep",
                    value=round(3 * m * n * 2 / bench(fn, warmup=5, rep=20)[0] / 1e9, 3)))
            del x, dy
            torch.cuda.empty_cache()
    finally:
        tln._fwd_config, tln._bwd_config = fwd_config, bwd_config


def run(recorder, dtypes=(torch.float16, torch.bfloat16), quick=False):
    import ampkernels

    live = [name for name, (ok, _) in ampkernels.available_backends().items() if ok and name in ("cuda", "triton")]
    for dtype in dtypes:
        for n in QUICK_NS if quick else NS:
            m = TOTAL // n
            torch.manual_seed(0)
            x = torch.randn(m, n, device="cuda", dtype=dtype)
            dy = torch.randn(m, n, device="cuda", dtype=dtype)
            w = torch.rand(n, device="cuda", dtype=dtype) + 0.5
            b = torch.randn(n, device="cuda", dtype=dtype)
            w32, b32 = w.float(), b.float()
            out = torch.empty_like(x)
            guard(recorder, "copy", lambda: _record(recorder, "copy", "copy", "fwd", dtype, n, m,
                                                    bench(lambda: out.copy_(x)), 2 * m * n * x.element_size()))
            del out
            for op in OPS:
                bb = b if op == "layer_norm" else None
                bb32 = b32 if op == "layer_norm" else None
                guard(recorder, op, lambda: _fwd_bwd(recorder, op, "eager", _eager(op, n), x, w, bb, dy, n, quick))

                def compiled():
                    torch._dynamo.reset()
                    _fwd_bwd(recorder, op, "compile", torch.compile(_eager(op, n)), x, w, bb, dy, n, quick)
                guard(recorder, op, compiled)
                guard(recorder, op, lambda: _fwd_bwd(recorder, op, "autocast", _module(op, n), x, w32, bb32, dy, n,
                                                     quick, autocast=dtype, bwd=False))
                for backend in live:
                    guard(recorder, op, lambda: _fwd_bwd(recorder, op, f"ampkernels-{backend}", _ours(op, n, backend),
                                                         x, w, bb, dy, n, quick))
                    guard(recorder, op, lambda: _fwd_bwd(recorder, op, f"ampkernels-{backend}-autocast",
                                                         _ours(op, n, backend), x, w32, bb32, dy, n, quick,
                                                         autocast=dtype))
            del x, dy
            torch.cuda.empty_cache()


def report(rows):
    """One line per target of issue 3 / DESIGN.md, per op, pass, dtype and N."""
    value = {}
    for r in rows:
        if r.get("metric") == "TB/s":
            value[(r["op"], r["provider"], r["pass"], r["dtype"], r["N"])] = r["value"]
    lines = []
    keys = sorted({(k[0], k[2], k[3], k[4]) for k in value if k[0] in OPS and k[1].startswith("ampkernels-")
                   and not k[1].endswith("-autocast")})
    verdict = lambda ok: "PASS" if ok else "FALLS SHORT"  # noqa: E731
    for op, pas, dtype, n in keys:
        ours = {p: v for (o, p, s, d, nn), v in value.items()
                if (o, s, d, nn) == (op, pas, dtype, n) and p.startswith("ampkernels-") and not p.endswith("-autocast")}
        best_p = max(ours, key=ours.get)
        best = ours[best_p]
        target = FWD_TARGET if pas == "fwd" else BWD_TARGET
        copy = value.get(("copy", "copy", "fwd", dtype, n))
        rel = f" ({best / copy:.0%} of copy {copy})" if copy else ""
        lines.append(f"{op} {pas} {dtype} N={n}: best {best_p} {best:.2f} TB/s{rel} >= {target}: "
                     f"{verdict(best >= target)}")
        for p, v in sorted(ours.items()):
            lines.append(f"{op} {pas} {dtype} N={n}: {p} {v:.2f} TB/s >= {BACKEND_SHARE:.0%} of {target} "
                         f"({BACKEND_SHARE * target:.2f}): {verdict(v >= BACKEND_SHARE * target)}")
        for base in ("eager", "compile"):
            bv = value.get((op, base, pas, dtype, n))
            if bv is not None:
                lines.append(f"{op} {pas} {dtype} N={n}: best {best:.2f} vs {base} {bv:.2f} TB/s "
                             f"({best / bv:.2f}x) >= 1x: {verdict(best >= bv)}")
        if pas == "fwd":
            amp = value.get((op, "autocast", "fwd", dtype, n))
            ac = {p: v for (o, p, s, d, nn), v in value.items()
                  if (o, s, d, nn) == (op, "fwd", dtype, n) and p.endswith("-autocast") and p.startswith("ampkernels")}
            if amp and ac:
                bp = max(ac, key=ac.get)
                lines.append(f"{op} fwd {dtype} N={n}: autocast fp32 params {bp} {ac[bp]:.2f} vs nn under autocast "
                             f"{amp:.2f} TB/s-eq ({ac[bp] / amp:.1f}x) >= {AUTOCAST_SPEEDUP}x: "
                             f"{verdict(ac[bp] >= AUTOCAST_SPEEDUP * amp)}")
    return lines


def main(argv=None):
    def extra(p):
        p.add_argument("--sweep", action="store_true", help="only time Triton launch configurations")

    def special(args, recorder):
        if args.sweep:
            sweep(recorder)
        return args.sweep

    return standalone_main("layer_norm", __doc__, run, report, argv, extra, special)


if __name__ == "__main__":
    raise SystemExit(main())
