"""layer_norm / rms_norm benchmark: every implementation side by side in one run.

Providers, per op (layer_norm, rms_norm), dtype and N (M = 2^27 / N rows):
  copy                   x -> out device copy: the bandwidth ceiling (op "copy")
  eager                  F.layer_norm / F.rms_norm, params in x.dtype
  compile                torch.compile of eager, fresh per shape (torch._dynamo.reset())
  autocast               nn.LayerNorm / nn.RMSNorm with fp32 params on fp16/bf16 x under
                         autocast (fwd only; torch upcasts and returns fp32)
  ampkernels-<backend>   each live backend, params in x.dtype
  ampkernels-<backend>-autocast   the same under autocast with fp32 params (the AMP case)
  liger, quack, apex, flash_attn  public kernels, each when it imports (providers.py), params
                         in x.dtype (fp32 where the kernel takes only fp32: param_dtype in the row)
Bytes: fwd = x read + y written, bwd = x and dy read + dx written,
all at x's element size (so the autocast rows are "TB/s-equivalent"). Backward is timed alone
(retain_graph, grads set to None between runs). Rows: TB/s with median/p20/p80 ms.

    python -m ampkernels.bench.bench_layer_norm --out DIR [--quick]
    python -m ampkernels.bench.bench_layer_norm --out DIR --sweep [--dtype bfloat16] [--sweep-pass bwd|fwd|both]
        Triton launch configurations alone (metric TB/s-sweep); see SWEEP_BWD
"""
import collections
import functools
import types

import torch
import torch.nn.functional as F

from . import providers
from .common import bench, first_call_s, graph_replay_ms, guard, progress, standalone_main

NS = (768, 1024, 2048, 4096, 8192, 16384)
QUICK_NS = (768, 2048, 8192, 16384)
TOTAL = 2**27
OPS = ("layer_norm", "rms_norm")
EPS = 1e-5
FWD_TARGET, BWD_TARGET, BACKEND_SHARE, AUTOCAST_SPEEDUP = 3.9, 3.2, 0.85, 5.0

# make(op, n) -> fn(x, w, b); fp32_params: timed with w32/b32; autocast: run under autocast(x.dtype)
Spec = collections.namedtuple("Spec", "make fp32_params autocast passes fields")
BOTH = ("fwd", "bwd")


def _eager(op, n):
    if op == "layer_norm":
        return lambda x, w, b: F.layer_norm(x, (n,), w, b, EPS)
    return lambda x, w, b: F.rms_norm(x, (n,), w, EPS)


def _compiled(op, n):
    torch._dynamo.reset()  # fresh per shape: no recompile limit, no guards from earlier shapes
    return torch.compile(_eager(op, n))


def _ours(op, n, backend):
    import ampkernels
    if op == "layer_norm":
        return lambda x, w, b: ampkernels.layer_norm(x, (n,), w, b, EPS, backend=backend)
    return lambda x, w, b: ampkernels.rms_norm(x, (n,), w, EPS, backend=backend)


def _module(op, n):
    m = torch.nn.LayerNorm(n, device="cuda") if op == "layer_norm" else torch.nn.RMSNorm(n, eps=EPS, device="cuda")
    return lambda x, w, b: m(x)


def _public(fn):
    return lambda op, n: lambda x, w, b: fn(x, w, b, EPS)


def _specs(op, live, public, device):
    """provider -> Spec for one op, in the order they are measured."""
    specs = {"eager": Spec(_eager, False, False, BOTH, {})}
    if device == "cuda":
        specs["compile"] = Spec(_compiled, False, False, BOTH, {})
        specs["autocast"] = Spec(_module, True, True, ("fwd",), {})
        for backend in live:
            make = functools.partial(_ours, backend=backend)
            specs[f"ampkernels-{backend}"] = Spec(make, False, False, BOTH, {})
            specs[f"ampkernels-{backend}-autocast"] = Spec(make, True, True, BOTH, {})
    for p in public:
        impl = p.ops.get(op)
        if impl is not None:
            specs[p.name] = Spec(_public(impl.fn), impl.fp32_params, False, BOTH if impl.bwd else ("fwd",),
                                 p.fields(op))
    return specs


def _record(recorder, op, provider, pas, dtype, n, m, ms, nbytes, **extra):
    med, p20, p80 = ms
    return recorder.add(op=op, provider=provider, **{"pass": pas}, dtype=str(dtype).replace("torch.", ""), N=n, M=m,
                        shape=f"{m}x{n}", metric="TB/s", value=round(nbytes / med / 1e9, 3), ms=round(med, 4),
                        ms_p20=round(p20, 4), ms_p80=round(p80, 4), **extra)


def _timing(quick):
    return {"warmup": 10 if quick else 25, "rep": 40 if quick else 100}


def _autocast(dtype):
    return (lambda: torch.autocast("cuda", dtype=dtype)) if dtype else torch.enable_grad


def _fwd(recorder, op, provider, fn, x, w, b, n, quick, autocast=None, **fields):
    m, e = x.shape[0], x.element_size()
    timing = _timing(quick)

    def fwd():
        with _autocast(autocast)(), torch.no_grad():
            return fn(x, w, b)

    fields["first_call_s"] = first_call_s(fwd)  # compile / warm up outside the timing, reported apart
    if provider.startswith("ampkernels-"):
        # the same forward replayed from a CUDA graph: the kernels without host time (diagnostic)
        fields["graph_TBps"] = round(2 * m * n * e / graph_replay_ms(fwd, **timing) / 1e9, 3)
    _record(recorder, op, provider, "fwd", x.dtype, n, m, bench(fwd, **timing), 2 * m * n * e, **fields)


def _bwd(recorder, op, provider, fn, x, w, b, dy, n, quick, autocast=None, **fields):
    m, e = x.shape[0], x.element_size()
    leaves = [t.detach().requires_grad_() for t in (x, w, b) if t is not None]
    xg, wg = leaves[0], leaves[1]
    bg = leaves[2] if len(leaves) > 2 else None

    def fwd():
        with _autocast(autocast)():
            return fn(xg, wg, bg)

    out = fwd()
    fields["first_call_s"] = first_call_s(functools.partial(out.backward, dy, retain_graph=True))
    if provider.startswith("ampkernels-"):
        # the backward's GPU time without the host's autograd and launch work (diagnostic: a
        # Triton backward call can cost more host time than GPU time): forward + backward
        # replayed from a CUDA graph (autograd runs a backward on its forward's stream, so both
        # are captured) less the forward's replay. (torch.autograd.grad cannot be captured.)
        def fwd_bwd():
            for t in leaves:
                t.grad = None
            fwd().backward(dy)

        try:  # a diagnostic: a failed capture loses this field (its error is recorded), not the row
            graph_ms = graph_replay_ms(fwd_bwd, **_timing(quick)) - graph_replay_ms(fwd, **_timing(quick))
            fields["graph_TBps"] = round(3 * m * n * e / graph_ms / 1e9, 3)
        except RuntimeError as err:
            fields["graph_error"] = f"{type(err).__name__}: {str(err).splitlines()[0]}"
            torch.cuda.synchronize()
    ms = bench(functools.partial(out.backward, dy, retain_graph=True), grad_to_none=leaves, **_timing(quick))
    _record(recorder, op, provider, "bwd", x.dtype, n, m, ms, 3 * m * n * e, **fields)


# Forward: N -> [(ROWS, num_warps)], each pair one Triton compile, with and without PARAMS_FIRST,
# swept with --sweep-pass fwd or both. One or two warps a program at N <= 1024 after
# torch.compile's persistent reduction (one warp a row there).
SWEEP_FWD = {768: [(4, 4), (2, 4), (4, 8), (8, 8), (1, 1), (2, 1), (1, 2), (2, 2), (4, 2), (8, 4)],
             1024: [(4, 4), (1, 1), (2, 1), (1, 2), (2, 2), (4, 2), (8, 4)],
             2048: [(1, 4), (1, 8), (2, 8), (4, 8), (1, 2), (2, 4)],
             4096: [(1, 8), (1, 16), (2, 16), (1, 4)], 8192: [(1, 8), (1, 16), (1, 4)], 16384: [(1, 8), (1, 16), (2, 16)]}
# fp32 params with 16-bit x (the AMP case): each row step reads the params again from L2, so
# several rows a step share one read. The defaults first, then the others.
SWEEP_FWD_W32 = {2048: [(4, 8), (1, 4), (2, 8), (4, 16)], 4096: [(2, 8), (1, 8), (2, 16), (4, 16)],
                 8192: [(1, 8), (2, 16), (2, 32)], 16384: [(2, 32), (1, 16)]}
# Backward: N -> [(ROWS, num_warps, programs per SM, looped, (num_stages, ...))]; each
# (config, num_stages) is one compile (a few seconds on the GPU machine's host: the whole
# backward sweep is ~35 compiles). num_stages 1 is the backward before the pipelining (its
# default configs at num_stages 1 are the previous launch, so old and new are timed side by
# side); the other ROWS/warps/programs are the next-best of the previous sweep. N = 16384: the
# RELOAD register kernel (16 warps, the default, and 32) against the looped kernel (the previous
# default).
_LOOPED = (1, 16, 1, True)
SWEEP_BWD = {768: [(2, 4, 4, False, (1, 2, 3)), (1, 4, 8, False, (1, 2, 3)), (4, 8, 2, False, (3,))],
             1024: [(2, 4, 4, False, (1, 2, 3)), (1, 4, 8, False, (3,))],  # 1 row a step: no masks
             2048: [(1, 4, 4, False, (1, 2, 3)), (1, 8, 2, False, (3,))],
             4096: [(1, 8, 2, False, (1, 2, 3)), (1, 16, 1, False, (3,))],
             8192: [(1, 16, 1, False, (1, 2, 3)), (1, 32, 1, False, (2, 3))],
             16384: [(1, 16, 1, False, (1, 2)), (1, 32, 1, False, (2,)), (*_LOOPED, (1, 3))]}
# fp32 params (the AMP case) where they change the kernel's shared memory and registers most
SWEEP_BWD_W32 = {16384: [(1, 16, 1, False, (2,)), (*_LOOPED, (3,))]}


def _sweep_cases(ns, passes):
    import triton

    from ampkernels.triton import layer_norm as tln

    cases = []
    for n in ns:
        block = triton.next_power_of_2(n)
        if "fwd" in passes:
            for w32, table in ((False, SWEEP_FWD), (True, SWEEP_FWD_W32)):
                # each with the params loaded after the reductions and with x (PARAMS_FIRST)
                cases += [(n, "fwd", "layer_norm", w32, (block, rows, warps, first))
                          for rows, warps in table.get(n, ()) for first in (False, True)]
        if "bwd" not in passes:
            continue
        for w32, table in ((False, SWEEP_BWD), (True, SWEEP_BWD_W32)):
            for rows, warps, per_sm, looped, stages in table.get(n, ()):
                for s in stages:
                    cfg = (tln._LOOP_BLOCK if looped else block, rows, warps, per_sm, looped, s)
                    cases.append((n, "bwd", "layer_norm", w32, cfg))
        # RMSNorm at the default config (no bias gradient: fewer registers, another compile)
        cases.append((n, "bwd", "rms_norm", False, tln._bwd_config(n, True)))
    return cases


def sweep(recorder, ns=NS, dtype=torch.float16, passes=("bwd",)):
    """Triton launch configurations for the norm launchers alone (no autograd, no host-side
    dispatch), timed side by side: the data behind _fwd_config/_bwd_config. Backward configs:
    (BLOCK_N, ROWS, num_warps, programs per SM, looped, num_stages); each row also says the
    config norm_bwd actually launched (after its shared-memory fit) and the first call's
    seconds (the compile)."""
    from ampkernels.triton import layer_norm as tln

    cases = _sweep_cases(ns, passes)
    fwd_config, bwd_config = tln._fwd_config, tln._bwd_config
    t = None
    try:
        for case in progress(cases, "layer_norm sweep", lambda c: f"N={c[0]} {c[1]} {c[2]} w32={c[3]} {c[4]}"):
            n = case[0]
            if t is None or t.x.shape[1] != n:
                t = None  # free the last N's tensors first
                torch.cuda.empty_cache()
                t = _inputs(dtype, n, "cuda")
                tln._fwd_config, tln._bwd_config = fwd_config, bwd_config
                t.stats = {op: tln.norm_fwd(t.x, t.w, None if op == "rms_norm" else t.b, None, EPS, op == "rms_norm",
                                            None, False)[2:] for op in OPS}
            guard(recorder, "sweep", _sweep_case, recorder, tln, t, *case)
    finally:
        tln._fwd_config, tln._bwd_config = fwd_config, bwd_config


def _sweep_case(recorder, tln, t, n, pas, op, w32, cfg):
    m, dtype = t.x.shape[0], t.x.dtype
    fields = {}
    if pas == "fwd":
        tln._fwd_config = lambda _n, _wide_params=False: cfg
        w, b = (t.w32, t.b32) if w32 else (t.w, t.b)
        fn = functools.partial(tln.norm_fwd, t.x, w, b, None, EPS, False, None, False)
        provider = f"sweep-triton-r{cfg[1]}-w{cfg[2]}{'-pfirst' if cfg[3] else ''}{'-fp32params' if w32 else ''}"
        nbytes = 2 * m * n * t.x.element_size()
        fields = {"param_dtype": str(w.dtype)[6:]}
    else:
        tln._bwd_config = lambda _n, _is_rms=False, _wide_params=False: cfg
        is_rms = op == "rms_norm"
        w = t.w32 if w32 else t.w
        mean, rstd = t.stats[op]
        fn = functools.partial(tln.norm_bwd, t.dy, t.x, w, mean, rstd, None, is_rms, True, not is_rms, dtype, None,
                               None)
        reload = not cfg[4] and cfg[0] > tln._MAX_BWD_BLOCK
        provider = (f"sweep-triton-r{cfg[1]}-w{cfg[2]}-p{cfg[3]}-s{cfg[5]}{'-looped' if cfg[4] else ''}"
                    f"{'-reload' if reload else ''}{'-fp32params' if w32 else ''}")
        nbytes = 3 * m * n * t.x.element_size()
        launched = tln._bwd_fit(cfg, tln._smem_per_program(t.x.device), t.x, t.dy, w, None)
        fields = {"config": list(cfg), "launched": list(launched), "param_dtype": str(w.dtype)[6:]}
    fields["first_call_s"] = first_call_s(fn)
    recorder.add(op=op, provider=provider, **{"pass": pas}, dtype=str(dtype)[6:], N=n, M=m, metric="TB/s-sweep",
                 value=round(nbytes / bench(fn, warmup=5, rep=20)[0] / 1e9, 3), **fields)


def _inputs(dtype, n, device):
    torch.manual_seed(0)
    m = TOTAL // n
    x = torch.randn(m, n, device=device, dtype=dtype)
    w, b = torch.rand(n, device=device, dtype=dtype) + 0.5, torch.randn(n, device=device, dtype=dtype)
    return types.SimpleNamespace(x=x, dy=torch.randn(m, n, device=device, dtype=dtype), w=w, b=b,
                                 w32=w.float(), b32=b.float())


def run(recorder, dtypes=(torch.float16, torch.bfloat16), quick=False, device="cuda", shapes=None):
    """Every provider side by side. shapes: hidden sizes N (rows M = TOTAL / N), default NS.
    device="cpu" only smoke-tests this code (tests use it with a tiny TOTAL and NS): eager and
    the public providers, numbers meaningless."""
    import ampkernels

    live = [name for name, (ok, _) in ampkernels.available_backends().items()
            if ok and name in ("cuda", "triton") and device == "cuda"]
    public = providers.discover()
    specs = {op: _specs(op, live, public, device) for op in OPS}
    # one case per (dtype, N, op, provider, pass), in the order measured: progress counts these
    cases = [(dtype, n, op, provider, pas) for dtype in dtypes
             for n in (shapes or (QUICK_NS if quick else NS))
             for op, provs in [("copy", {"copy": Spec(None, False, False, ("fwd",), {})})] + list(specs.items())
             for provider, spec in provs.items() for pas in spec.passes]
    t, fns = None, {}
    for dtype, n, op, provider, pas in progress(cases, "layer_norm/rms_norm",
                                                lambda c: f"{str(c[0])[6:]} N={c[1]} {c[2]} {c[3]} {c[4]}"):
        if t is None or (t.x.dtype, t.x.shape[1]) != (dtype, n):
            t, fns = None, {}  # free the last shape's tensors and compiled functions first
            if device == "cuda":
                torch.cuda.empty_cache()
            t = _inputs(dtype, n, device)
        if op == "copy":
            guard(recorder, "copy", _copy, recorder, t)
        else:
            guard(recorder, f"{op} {provider} {pas}", _measure, recorder, specs[op][provider], fns, t, op, provider,
                  pas, quick)


def _copy(recorder, t):
    x, out = t.x, torch.empty_like(t.x)
    _record(recorder, "copy", "copy", "fwd", x.dtype, x.shape[1], x.shape[0], bench(functools.partial(out.copy_, x)),
            2 * x.numel() * x.element_size())


def _measure(recorder, spec, fns, t, op, provider, pas, quick):
    n = t.x.shape[1]
    if (op, provider) not in fns:  # built once per shape: fwd and bwd time the same function
        fns[(op, provider)] = spec.make(op, n)
    w, b = (t.w32, t.b32) if spec.fp32_params else (t.w, t.b)
    b = b if op == "layer_norm" else None
    autocast = t.x.dtype if spec.autocast else None
    if pas == "fwd":
        _fwd(recorder, op, provider, fns[(op, provider)], t.x, w, b, n, quick, autocast, **spec.fields)
    else:
        _bwd(recorder, op, provider, fns[(op, provider)], t.x, w, b, t.dy, n, quick, autocast, **spec.fields)


def _verdict(ok):
    return "PASS" if ok else "FALLS SHORT"


def report(rows):
    """One line per target (docs/design.md), per op, pass, dtype and N; where public kernels
    were measured, the best of them against our best (never below it)."""
    public = {r["provider"] for r in rows if r.get("provider_version")}
    fp32_params = {r["provider"] for r in rows if r.get("param_dtype") == "float32"}
    value, graph = {}, {}
    for r in rows:
        if r.get("metric") == "TB/s":
            key = (r["op"], r["provider"], r["pass"], r["dtype"], r["N"])
            value[key] = r["value"]
            if r.get("graph_TBps"):
                graph[key] = r["graph_TBps"]
    lines = []
    keys = sorted({(k[0], k[2], k[3], k[4]) for k in value if k[0] in OPS and k[1].startswith("ampkernels-")
                   and not k[1].endswith("-autocast")})
    for op, pas, dtype, n in keys:
        ours = {p: v for (o, p, s, d, nn), v in value.items()
                if (o, s, d, nn) == (op, pas, dtype, n) and p.startswith("ampkernels-") and not p.endswith("-autocast")}
        best_p = max(ours, key=ours.get)
        best = ours[best_p]
        target = FWD_TARGET if pas == "fwd" else BWD_TARGET
        copy = value.get(("copy", "copy", "fwd", dtype, n))
        rel = f" ({best / copy:.0%} of copy {copy})" if copy else ""
        lines.append(f"{op} {pas} {dtype} N={n}: best {best_p} {best:.2f} TB/s{rel} >= {target}: "
                     f"{_verdict(best >= target)}")
        for p, v in sorted(ours.items()):
            # the kernels' own rate beside the called one: where they differ, the host set the pace
            g = graph.get((op, p, pas, dtype, n))
            kernels = f" (its kernels from a CUDA graph: {g:.2f})" if g else ""
            lines.append(f"{op} {pas} {dtype} N={n}: {p} {v:.2f} TB/s >= {BACKEND_SHARE:.0%} of {target} "
                         f"({BACKEND_SHARE * target:.2f}): {_verdict(v >= BACKEND_SHARE * target)}{kernels}")
        for base in ("eager", "compile"):
            bv = value.get((op, base, pas, dtype, n))
            if bv is not None:
                lines.append(f"{op} {pas} {dtype} N={n}: best {best:.2f} vs {base} {bv:.2f} TB/s "
                             f"({best / bv:.2f}x) >= 1x: {_verdict(best >= bv)}")
        pub = {p: v for (o, p, s, d, nn), v in value.items() if (o, s, d, nn) == (op, pas, dtype, n) and p in public}
        if pub:
            pp = max(pub, key=pub.get)
            params = " (fp32 params)" if pp in fp32_params else ""
            lines.append(f"{op} {pas} {dtype} N={n}: best {best:.2f} vs best public {pp}{params} {pub[pp]:.2f} TB/s "
                         f"({best / pub[pp]:.2f}x) >= 1x: {_verdict(best >= pub[pp])}")
        if pas == "fwd":
            amp = value.get((op, "autocast", "fwd", dtype, n))
            ac = {p: v for (o, p, s, d, nn), v in value.items()
                  if (o, s, d, nn) == (op, "fwd", dtype, n) and p.endswith("-autocast") and p.startswith("ampkernels")}
            if amp and ac:
                bp = max(ac, key=ac.get)
                lines.append(f"{op} fwd {dtype} N={n}: autocast fp32 params {bp} {ac[bp]:.2f} vs nn under autocast "
                             f"{amp:.2f} TB/s-eq ({ac[bp] / amp:.1f}x) >= {AUTOCAST_SPEEDUP}x: "
                             f"{_verdict(ac[bp] >= AUTOCAST_SPEEDUP * amp)}")
                share = BACKEND_SHARE * AUTOCAST_SPEEDUP
                for p, v in sorted(ac.items()):  # each backend: 85% of the target, as above
                    g = graph.get((op, p, "fwd", dtype, n))
                    kernels = f" (its kernels from a CUDA graph: {g:.2f})" if g else ""
                    lines.append(f"{op} fwd {dtype} N={n}: autocast fp32 params {p} {v / amp:.1f}x >= "
                                 f"{BACKEND_SHARE:.0%} of {AUTOCAST_SPEEDUP}x ({share:.2f}x): "
                                 f"{_verdict(v >= share * amp)}{kernels}")
    return lines


def main(argv=None):
    def extra(p):
        p.add_argument("--sweep", action="store_true",
                       help="only time Triton launch configurations (in the first --dtype; N: --sweep-n)")
        p.add_argument("--sweep-pass", choices=("bwd", "fwd", "both"), default="bwd")
        p.add_argument("--sweep-n", type=int, nargs="+", default=list(NS))

    def special(args, recorder):
        if args.sweep:
            passes = ("fwd", "bwd") if args.sweep_pass == "both" else (args.sweep_pass,)
            sweep(recorder, tuple(args.sweep_n), getattr(torch, args.dtype[0]), passes)
        return args.sweep

    return standalone_main("layer_norm", __doc__, run, report, argv, extra, special)


if __name__ == "__main__":
    raise SystemExit(main())
