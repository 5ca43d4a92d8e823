"""linear_act benchmark: y = act(x @ W^T + b) side by side in one run.

Providers, per shape (M, K, N), dtype and activation:
  matmul            F.linear(x, W) without bias: the ceiling (fwd and fwd+bwd)
  eager             F.linear(x, W, b) then the activation (the unfused baseline)
  addmm_act         torch._addmm_activation (cuBLASLt GELU/ReLU epilogue; relu and gelu_tanh)
  compile           torch.compile of eager (fresh per shape: torch._dynamo.reset())
  ampkernels-cuda, ampkernels-triton (and ampkernels-triton-ptr: the pointer kernel, TMA off)
  apex              public kernels when they import (providers.py): apex's FusedDense (bias in
                    the cuBLASLt epilogue), then the activation
Passes: "fwd" = inference (no grad, nothing saved); "fwd_bwd" = training forward + backward
(dx, dW, db). Rows: TFLOP/s (2MNK fwd, 6MNK fwd+bwd) with median/p20/p80 ms, the relative
error of each provider's output against an fp32 reference, and the bytes each provider keeps
alive after a training forward (saved tensors + output).

    python -m ampkernels.bench.bench_linear_act --out DIR [--quick]
"""
import functools
import os
import types

import torch
import torch.nn.functional as F

from . import providers
from .. import _extension
from .common import bench, first_call_s, guard, progress, standalone_main

# (M, K, N): the "tiny" bucket's (a short sequence through GPT-2's MLP, the first layer of an
# apex-sized MLP), then GPT-2's and LLaMA-scale training shapes
SHAPES = [(128, 768, 3072), (1024, 480, 1024), (4096, 768, 3072), (8192, 1024, 4096), (8192, 4096, 4096),
          (8192, 4096, 16384)]
ACTIVATIONS = ("gelu_tanh", "relu", "gelu", "silu")
COMPILE_SHAPE = (8192, 1024, 4096)
OP = "linear_act"


def _act(z, activation):
    from ampkernels import reference
    return reference.act_fwd(z, activation)


def _eager(x, w, b, activation):
    return _act(F.linear(x, w, b), activation)


def _addmm(x, w, b, activation):
    return torch._addmm_activation(b, x, w.t(), use_gelu=activation == "gelu_tanh")


def _matmul(x, w, b):
    return F.linear(x, w)


def _triton_ptr(x, w, b, activation):
    """The Triton pointer kernel, for comparison with the default TMA kernel."""
    import ampkernels
    os.environ["AMPKERNELS_TRITON_TMA"] = "0"
    try:
        return ampkernels.linear_act(x, w, b, activation, backend="triton")
    finally:
        os.environ.pop("AMPKERNELS_TRITON_TMA", None)


def _compiled_here(activation, shape, quick):
    return activation == "gelu_tanh" and (not quick or shape == COMPILE_SHAPE)


def _public(fn, activation):
    return lambda x, w, b: fn(x, w, b, activation)


def _providers(activation, shape, quick, public):
    """name -> (fn(x, w, b), extra row fields) for one activation and shape, in run order."""
    import ampkernels

    def ours(backend, **kw):
        return lambda x, w, b: ampkernels.linear_act(x, w, b, activation, backend=backend, **kw)

    p = {"eager": (functools.partial(_eager, activation=activation), {})}
    if activation in ("relu", "gelu_tanh"):
        p["addmm_act"] = (functools.partial(_addmm, activation=activation), {})
    avail = ampkernels.available_backends()
    if avail["cuda"][0]:
        p["ampkernels-cuda"] = (ours("cuda"), {})
    if avail["triton"][0] and _extension.loaded():  # the op lives in the extension
        p["ampkernels-triton"] = (ours("triton"), {})
    if _compiled_here(activation, shape, quick):
        if "ampkernels-triton" in p:
            p["ampkernels-triton-ptr"] = (functools.partial(_triton_ptr, activation=activation), {})
        p["compile"] = (torch.compile(lambda x, w, b: _eager(x, w, b, activation)), {})
    for prov in public:
        if OP in prov.ops:
            p[prov.name] = (_public(prov.ops[OP].fn, activation), prov.fields(OP))
    return p


def _memory_providers(provs, activation):
    """The providers whose bytes held after a training forward are compared."""
    import ampkernels

    mem = {name: provs[name] for name in ("eager", "ampkernels-cuda", "ampkernels-triton") if name in provs}
    if "ampkernels-cuda" in provs:
        mem["ampkernels-cuda-recompute"] = (lambda x, w, b: ampkernels.linear_act(
            x, w, b, activation, backend="cuda", recompute=True), {})
    return mem


def _timed(fn, quick):
    return bench(fn, warmup=10 if quick else 25, rep=40 if quick else 100)


def _record(recorder, provider, pas, dtype, shape, activation, ms, flops, **extra):
    m, k, n = shape
    med, p20, p80 = ms
    return recorder.add(op=OP, provider=provider, **{"pass": pas}, dtype=str(dtype).replace("torch.", ""), M=m, K=k,
                        N=n, shape=f"{m}x{k}x{n}", activation=activation, metric="TFLOP/s",
                        value=round(flops / med / 1e9, 1), ms=round(med, 4), ms_p20=round(p20, 4),
                        ms_p80=round(p80, 4), **extra)


def _rel_err(out, ref):
    return float(((out.float() - ref).norm() / ref.norm().clamp_min(1e-30)).item())


def _measure(recorder, name, fn, pas, x, w, b, dtype, shape, activation, quick, ref=None, **extra):
    m, k, n = shape
    flops = (2 if pas == "fwd" else 6) * m * n * k
    if pas == "fwd":
        with torch.no_grad():
            extra["first_call_s"] = first_call_s(lambda: fn(x, w, b))  # compilation, reported apart
            if ref is not None:
                extra["rel_err"] = round(_rel_err(fn(x, w, b), ref), 6)
            ms = _timed(lambda: fn(x, w, b), quick)
    else:
        xs, ws, bs = (t.detach().requires_grad_() for t in (x, w, b))
        dy = torch.randn(m, n, dtype=dtype, device=x.device)

        def step():
            fn(xs, ws, bs).backward(dy)

        extra["first_call_s"] = first_call_s(step)
        ms = bench(step, warmup=10 if quick else 25, rep=40 if quick else 100, grad_to_none=[xs, ws, bs])
    return _record(recorder, name, pas, dtype, shape, activation, ms, flops, **extra)


def _memory_row(recorder, name, fn, x, w, b, dtype, shape, activation):
    """Bytes alive after a training forward beyond the inputs: saved tensors + the output."""
    xs, ws, bs = (t.detach().requires_grad_() for t in (x, w, b))
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    y = fn(xs, ws, bs)
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - before
    hidden = y.numel() * y.element_size()
    m, k, n = shape
    recorder.add(op=OP, provider=name, **{"pass": "fwd_bwd"}, dtype=str(dtype).replace("torch.", ""), M=m, K=k, N=n,
                 shape=f"{m}x{k}x{n}", activation=activation, metric="hidden tensors held after forward",
                 value=round(held / hidden, 2), bytes=held)
    del y


def _inputs(dtype, shape, dev):
    m, k, n = shape
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(m, k, device=dev, generator=g).to(dtype)
    w = (torch.randn(n, k, device=dev, generator=g) / k**0.5).to(dtype)
    b = (torch.randn(n, device=dev, generator=g) * 0.5).to(dtype)
    return types.SimpleNamespace(key=(dtype, shape), x=x, w=w, b=b)


def run(recorder, dtypes, quick, device="cuda", shapes=None):
    """Measure every provider side by side at shapes (M, K, N), default SHAPES. device="cpu" is
    only a smoke test of this code
    (tests use it with tiny shapes under TRITON_INTERPRET=1); its numbers mean nothing."""
    from ampkernels import reference

    if device == "cuda" and not torch.cuda.is_available():
        print("bench_linear_act: no CUDA device; nothing measured (see ampkernels/bench/run.py for the CPU demo)")
        return
    dev, public = device, providers.discover(OP)
    # one case per (dtype, shape, activation, provider, pass), in the order measured: progress counts these
    cases = []
    for dtype in dtypes:
        for shape in shapes or SHAPES:
            cases += [(dtype, shape, "none", "matmul", pas) for pas in ("fwd", "fwd_bwd")]
            for activation in ACTIVATIONS:
                provs = _providers(activation, shape, quick, public)
                cases += [(dtype, shape, activation, name, pas) for name in provs
                          for pas in (("fwd",) if name == "addmm_act" else ("fwd", "fwd_bwd"))]
                if shape == COMPILE_SHAPE and activation in ("gelu_tanh", "relu") and dev == "cuda":
                    cases += [(dtype, shape, activation, name, "memory")
                              for name in _memory_providers(provs, activation)]
    t = group = fns = ref = None
    for dtype, shape, activation, name, pas in progress(
            cases, OP, lambda c: f"{str(c[0])[6:]} {'x'.join(map(str, c[1]))} {c[2]} {c[3]} {c[4]}"):
        if t is None or t.key != (dtype, shape):
            t = fns = ref = None  # free the last shape's tensors first
            if dev == "cuda":
                torch.cuda.empty_cache()
            t = _inputs(dtype, shape, dev)
        if group != (dtype, shape, activation):
            group = (dtype, shape, activation)
            if activation == "none":
                fns, ref = {"matmul": (_matmul, {})}, None
            else:
                if _compiled_here(activation, shape, quick):
                    torch._dynamo.reset()  # torch.compile fresh per shape
                provs = _providers(activation, shape, quick, public)
                fns = {**provs, **_memory_providers(provs, activation)}
                ref = reference.linear_act(t.x, t.w, t.b, activation).float()
        fn, fields = fns[name]
        if pas == "memory":
            guard(recorder, f"{name} memory", _memory_row, recorder, name, fn, t.x, t.w, t.b, dtype, shape, activation)
        else:
            guard(recorder, f"{name} {pas}", _measure, recorder, name, fn, pas, t.x, t.w, t.b, dtype, shape,
                  activation, quick, ref, **fields)


# ---------------------------------------------------------------- report

FWD_TARGET = {"gelu_tanh": 0.98, "relu": 0.98, "gelu": 0.95, "silu": 0.95}


def _index(rows):
    idx = {}
    for r in rows:
        if r.get("op") == OP and r.get("metric") == "TFLOP/s":
            idx[(r["provider"], r["pass"], r["dtype"], r["shape"], r["activation"])] = r["value"]
    return idx


def _best_ours(idx, pas, dtype, shape, activation):
    cands = [(idx[(p, pas, dtype, shape, activation)], p) for p in ("ampkernels-cuda", "ampkernels-triton")
             if (p, pas, dtype, shape, activation) in idx]
    return max(cands) if cands else (None, None)


def _verdict(ok):
    return "PASS" if ok else "FALLS SHORT"


def report(rows):
    """One line per target: measured ratio, threshold, PASS or FALLS SHORT; our best against
    the best public kernel where one was measured; then the fastest backend per (dtype,
    activation, shape) for ampkernels/ops/linear_act.py's "auto" table."""
    idx = _index(rows)
    public = {r["provider"] for r in rows if r.get("op") == OP and r.get("provider_version")}
    lines = []
    keys = sorted({(k[2], k[3], k[4]) for k in idx if k[4] in FWD_TARGET},
                  key=lambda t: (t[0], [int(v) for v in t[1].split("x")], t[2]))
    for dtype, shape, act in keys:
        best, who = _best_ours(idx, "fwd", dtype, shape, act)
        mm = idx.get(("matmul", "fwd", dtype, shape, "none"))
        if best and mm:
            r = best / mm
            lines.append(f"linear_act fwd {act:9s} {dtype:8s} {shape:15s} {r:5.3f} of matmul (>= {FWD_TARGET[act]}) "
                         f"[{who}] {_verdict(r >= FWD_TARGET[act])}")
        addmm = idx.get(("addmm_act", "fwd", dtype, shape, act if act in ("relu", "gelu_tanh") else "gelu_tanh"))
        if best and addmm:
            r = best / addmm
            lines.append(f"linear_act fwd {act:9s} {dtype:8s} {shape:15s} {r:5.3f} of _addmm_activation (>= 1.0) "
                         f"{_verdict(r >= 1.0)}")
        best_t, who_t = _best_ours(idx, "fwd_bwd", dtype, shape, act)
        mm_t = idx.get(("matmul", "fwd_bwd", dtype, shape, "none"))
        if best_t and mm_t:
            r = best_t / mm_t
            lines.append(f"linear_act fwd+bwd {act:9s} {dtype:8s} {shape:15s} {r:5.3f} of matmul (>= 0.95) "
                         f"[{who_t}] {_verdict(r >= 0.95)}")
        eager_t = idx.get(("eager", "fwd_bwd", dtype, shape, act))
        if best_t and eager_t and shape == "x".join(map(str, COMPILE_SHAPE)) and act in ("gelu", "gelu_tanh"):
            r = best_t / eager_t
            lines.append(f"linear_act fwd+bwd {act:9s} {dtype:8s} {shape:15s} {r:5.3f}x eager (>= 1.15) "
                         f"{_verdict(r >= 1.15)}")
        eager_f = idx.get(("eager", "fwd", dtype, shape, act))
        if best and eager_f:
            lines.append(f"linear_act fwd {act:9s} {dtype:8s} {shape:15s} {best / eager_f:5.3f}x eager (>= 1.0) "
                         f"{_verdict(best >= eager_f)}")
        for pas, label, ours in (("fwd", "fwd", best), ("fwd_bwd", "fwd+bwd", best_t)):
            pub = {p: idx[(p, pas, dtype, shape, act)] for p in public if (p, pas, dtype, shape, act) in idx}
            if ours and pub:
                pp = max(pub, key=pub.get)
                lines.append(f"linear_act {label} {act:9s} {dtype:8s} {shape:15s} {ours / pub[pp]:5.3f}x best public "
                             f"[{pp}] (>= 1.0) {_verdict(ours >= pub[pp])}")
    for r in rows:
        if r.get("op") == OP and r.get("metric") == "hidden tensors held after forward":
            lines.append(f"linear_act memory {r['provider']:26s} {r['activation']:9s} {r['dtype']:8s} "
                         f"{r['value']} hidden-sized tensors held after a training forward (output included)")
    # fastest per (dtype, activation, pass, shape): what "auto" should pick
    for dtype, shape, act in keys:
        for pas in ("fwd", "fwd_bwd"):
            cands = {p: idx[(p, pas, dtype, shape, act)] for p in ("ampkernels-cuda", "ampkernels-triton", "eager")
                     if (p, pas, dtype, shape, act) in idx}
            if cands:
                order = sorted(cands, key=cands.get, reverse=True)
                lines.append(f"auto {pas:7s} {act:9s} {dtype:8s} {shape:15s} fastest first: "
                             + ", ".join(f"{p}={cands[p]}" for p in order))
    return lines


def auto_table(rows):
    """ampkernels/ops/linear_act.py's _MEASURED from benchmark rows: per (dtype, shape bucket,
    training) and activation column, the backends fastest first, by time summed over the
    bucket's shapes; a fused kernel within 1% of eager counts as a tie and is kept. rows may
    hold several runs of the same cases: their times add up, a mean over the runs (host-bound
    cells move 2x between runs on the H200 machine). tests/test_cli.py checks that the committed
    table is what its source run gives."""
    from ampkernels.ops import linear_act as la

    ms = {}
    for r in rows:
        if r.get("op") == OP and r.get("metric") == "TFLOP/s" and r["provider"] in _AUTO_PROVIDERS:
            key = (getattr(torch, r["dtype"]), la.shape_bucket(r["M"], r["N"], r["K"]), r["pass"] == "fwd_bwd",
                   r["activation"], _AUTO_PROVIDERS[r["provider"]])
            ms[key] = ms.get(key, 0.0) + r["ms"]
    table = {}
    for dtype, bucket, training in {k[:3] for k in ms}:
        prefs = []
        for act in la._ACT_COLUMNS:
            cuda, triton, eager = (ms.get((dtype, bucket, training, act, b)) for b in ("cuda", "triton", "torch"))
            if None in (cuda, triton, eager):
                break
            prefs.append(("torch",) if min(cuda, triton) > 1.01 * eager else
                         ("cuda", "triton") if cuda <= triton else ("triton", "cuda"))
        else:
            table[(dtype, bucket, training)] = tuple(prefs)
    return table


_AUTO_PROVIDERS = {"ampkernels-cuda": "cuda", "ampkernels-triton": "triton", "eager": "torch"}


def _print_auto_table(paths):
    import json

    from ampkernels.ops.shared import BUCKETS

    rows = []
    for path in paths:
        with open(path) as f:
            rows += [json.loads(line) for line in f if line.strip()]
    table = auto_table(rows)
    names = {("cuda", "triton"): "_C", ("triton", "cuda"): "_T", ("torch",): "_E"}
    order = {b: i for i, b in enumerate(BUCKETS)}
    for (dtype, bucket, training), prefs in sorted(table.items(), key=lambda kv: (str(kv[0][0]), kv[0][2],
                                                                                 order[kv[0][1]])):
        print(f"    ({dtype}, \"{bucket}\", {training}): ({', '.join(names[p] for p in prefs)}),")


if __name__ == "__main__":
    import sys

    if sys.argv[1:2] == ["--auto-table"]:  # python -m ampkernels.bench.bench_linear_act --auto-table RUN.jsonl [RUN2.jsonl ...]
        _print_auto_table(sys.argv[2:])
        raise SystemExit(0)
    raise SystemExit(standalone_main("linear_act", __doc__, run, report))
