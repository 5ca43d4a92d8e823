"""gated_linear_act benchmark: h = act(x Wg^T) * (x Wu^T) (SwiGLU / GeGLU) side by side.

Providers, per shape (tokens T, K -> H), dtype and activation:
  matmul            x @ [Wg; Wu]^T, ONE packed GEMM of N = 2H and nothing else: the ceiling
  eager             two F.linear, the activation, the multiply (the unfused baseline)
  compile           torch.compile of eager (fresh per shape)
  ampkernels-cuda, ampkernels-triton   separate gate and up weights
  ampkernels                           the same, backend "auto"
  ampkernels-cuda-packed               the weights as the two halves of one parameter (timm
                                       GluMlp's fc1): one GEMM of N = 2H on the cuda backend
Passes: "fwd" = inference (no grad); "fwd_bwd" = training forward + backward (dx, dWg, dWu).
Rows: TFLOP/s (2 T 2H K fwd, 6 T 2H K fwd+bwd) with median/p20/p80 ms, each provider's relative
error against an fp32 reference, and the bytes each provider keeps after a training forward
(saved tensors + output) in units of one (T, H) tensor.

    python -m ampkernels.bench.bench_gated_linear_act --out DIR [--quick]
    ampkernels bench --op gated_linear_act [--quick]
"""
import types

import torch
import torch.nn.functional as F

from .. import _extension
from .common import bench, first_call_s, guard, progress, standalone_main

TOKENS = 8192
SHAPES = [(TOKENS, 1024, 2816), (TOKENS, 4096, 11008)]  # (T, K, H)
ACTIVATIONS = ("silu", "gelu_tanh")
OP = "gated_linear_act"


def _eager(x, wg, wu, activation):
    from ampkernels import reference
    return reference.act_fwd(F.linear(x, wg), activation) * F.linear(x, wu)


def _providers(activation, quick, device):
    """name -> fn(x, wg, wu, w_packed) for one activation, in run order."""
    import ampkernels

    p = {"eager": lambda x, wg, wu, w: _eager(x, wg, wu, activation)}
    avail = ampkernels.available_backends()
    for backend in ("cuda", "triton"):
        # the ops live in the extension
        if avail[backend][0] and _extension.loaded() and (device == "cuda" or backend == "triton"):
            p[f"ampkernels-{backend}"] = (lambda b: lambda x, wg, wu, w: ampkernels.gated_linear_act(
                x, wg, wu, activation=activation, backend=b))(backend)
    if "ampkernels-cuda" in p or "ampkernels-triton" in p:  # what "auto" picks
        p["ampkernels"] = lambda x, wg, wu, w: ampkernels.gated_linear_act(x, wg, wu, activation=activation)
    if "ampkernels-cuda" in p:
        p["ampkernels-cuda-packed"] = lambda x, wg, wu, w: ampkernels.gated_linear_act(
            x, *w.chunk(2, 0), activation=activation, backend="cuda")
    if device == "cuda" and (not quick or activation == "silu"):
        compiled = torch.compile(lambda x, wg, wu: _eager(x, wg, wu, activation))
        p["compile"] = lambda x, wg, wu, w: compiled(x, wg, wu)
    return p


def _inputs(dtype, shape, dev):
    t, k, h = shape
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(t, k, device=dev, generator=g).to(dtype)
    w = (torch.randn(2 * h, k, device=dev, generator=g) / k**0.5).to(dtype)
    return types.SimpleNamespace(key=(dtype, shape), x=x, w=w, wg=w[:h].clone(), wu=w[h:].clone())


def _record(recorder, provider, pas, dtype, shape, activation, ms, flops, **extra):
    t, k, h = shape
    med, p20, p80 = ms
    return recorder.add(op=OP, provider=provider, **{"pass": pas}, dtype=str(dtype).replace("torch.", ""), T=t, K=k,
                        H=h, shape=f"{t}x{k}x{h}", activation=activation, metric="TFLOP/s",
                        value=round(flops / med / 1e9, 1), ms=round(med, 4), ms_p20=round(p20, 4),
                        ms_p80=round(p80, 4), **extra)


def _measure(recorder, name, fn, pas, inp, dtype, shape, activation, quick, ref):
    t, k, h = shape
    flops = (2 if pas == "fwd" else 6) * t * 2 * h * k
    reps = dict(warmup=10 if quick else 25, rep=40 if quick else 100)
    extra = {}
    if pas == "fwd":
        with torch.no_grad():
            extra["first_call_s"] = first_call_s(lambda: fn(inp.x, inp.wg, inp.wu, inp.w))
            if ref is not None:
                out = fn(inp.x, inp.wg, inp.wu, inp.w)
                extra["rel_err"] = round(float(((out.float() - ref).norm() / ref.norm()).item()), 6)
            ms = bench(lambda: fn(inp.x, inp.wg, inp.wu, inp.w), **reps)
    else:
        x, wg, wu, w = (v.detach().requires_grad_() for v in (inp.x, inp.wg, inp.wu, inp.w))
        out_cols = 2 * h if name == "matmul" else h
        dy = torch.randn(t, out_cols, dtype=dtype, device=x.device)

        def step():
            fn(x, wg, wu, w).backward(dy)

        extra["first_call_s"] = first_call_s(step)
        ms = bench(step, grad_to_none=[x, wg, wu, w], **reps)
    return _record(recorder, name, pas, dtype, shape, activation, ms, flops, **extra)


def _memory_row(recorder, name, fn, inp, dtype, shape, activation):
    """Bytes alive after a training forward beyond the inputs (saved tensors + output), in (T, H) tensors."""
    x, wg, wu, w = (v.detach().requires_grad_() for v in (inp.x, inp.wg, inp.wu, inp.w))
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    out = fn(x, wg, wu, w)
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - before
    t, k, h = shape
    recorder.add(op=OP, provider=name, **{"pass": "fwd_bwd"}, dtype=str(dtype).replace("torch.", ""), T=t, K=k, H=h,
                 shape=f"{t}x{k}x{h}", activation=activation, metric="(T, H) tensors held after forward",
                 value=round(held / (t * h * out.element_size()), 2), bytes=held)
    del out


def run(recorder, dtypes, quick, device="cuda", shapes=None):
    """Every provider side by side at shapes (T, K, H), default SHAPES (the first alone with
    quick). device="cpu" only smoke-tests this code (tests, TRITON_INTERPRET=1): no meaning."""
    from ampkernels import reference

    if device == "cuda" and not torch.cuda.is_available():
        print("bench_gated_linear_act: no CUDA device; nothing measured")
        return
    shapes = shapes or (SHAPES[:1] if quick else SHAPES)
    activations = ACTIVATIONS[:1] if quick else ACTIVATIONS
    cases = []
    for dtype in dtypes:
        for shape in shapes:
            cases += [(dtype, shape, "none", "matmul", pas) for pas in ("fwd", "fwd_bwd")]
            for activation in activations:
                names = list(_providers(activation, quick, device))
                cases += [(dtype, shape, activation, n, pas) for n in names for pas in ("fwd", "fwd_bwd")]
                if device == "cuda":
                    cases += [(dtype, shape, activation, n, "memory") for n in names if n != "compile"]
    inp = fns = ref = group = None
    for dtype, shape, activation, name, pas in progress(
            cases, OP, lambda c: f"{str(c[0])[6:]} {'x'.join(map(str, c[1]))} {c[2]} {c[3]} {c[4]}"):
        if inp is None or inp.key != (dtype, shape):
            inp = fns = ref = None
            if device == "cuda":
                torch.cuda.empty_cache()
            inp = _inputs(dtype, shape, device)
        if group != (dtype, shape, activation):
            group = (dtype, shape, activation)
            if activation == "none":
                fns, ref = {"matmul": lambda x, wg, wu, w: F.linear(x, w)}, None
            else:
                torch._dynamo.reset()  # torch.compile fresh per shape
                fns = _providers(activation, quick, device)
                ref = reference.gated_linear_act(inp.x.float(), inp.wg.float(), inp.wu.float(), None, None,
                                                 activation)
        if pas == "memory":
            guard(recorder, f"{OP} {name} memory", _memory_row, recorder, name, fns[name], inp, dtype, shape,
                  activation)
        else:
            guard(recorder, f"{OP} {name} {pas}", _measure, recorder, name, fns[name], pas, inp, dtype, shape,
                  activation, quick, ref)


def report(rows):
    """Per (dtype, shape, activation, pass): ours ("auto", else our best backend) against the packed
    matmul (the ceiling) and against eager and torch.compile, as ratios of times (the same FLOPs in
    every row of a shape); then the memory rows."""
    ms = {}
    for r in rows:
        if r.get("op") == OP and r.get("metric") == "TFLOP/s":
            ms[(r["provider"], r["pass"], r["dtype"], r["shape"], r["activation"])] = r["ms"]
    lines = []
    keys = sorted({(k[2], k[3], k[4], k[1]) for k in ms if k[4] != "none"})
    for dtype, shape, act, pas in keys:
        auto = ("ampkernels", pas, dtype, shape, act)
        ours = [(ms[k], k[0]) for k in ([auto] if auto in ms else [
            (p, pas, dtype, shape, act) for p in ("ampkernels-cuda", "ampkernels-cuda-packed", "ampkernels-triton")])
                if k in ms and ms[k] > 0]
        if not ours:
            continue
        best, who = min(ours)
        label = "fwd" if pas == "fwd" else "fwd+bwd"
        mm = ms.get(("matmul", pas, dtype, shape, "none"))
        if mm is not None:
            lines.append(f"gated_linear_act {label:7s} {act:9s} {dtype:8s} {shape:16s} {mm / best:5.3f} of the packed "
                         f"matmul's speed [{who}]")
        for base in ("eager", "compile"):
            b = ms.get((base, pas, dtype, shape, act))
            if b is not None:
                verdict = "PASS" if best <= b else "FALLS SHORT"
                lines.append(f"gated_linear_act {label:7s} {act:9s} {dtype:8s} {shape:16s} {b / best:5.3f}x {base} "
                             f"(>= 1.0) [{who}] {verdict}")
    for r in rows:
        if r.get("op") == OP and r.get("metric") == "(T, H) tensors held after forward":
            lines.append(f"gated_linear_act memory {r['provider']:24s} {r['activation']:9s} {r['dtype']:8s} "
                         f"{r['shape']:16s} {r['value']} (T, H) tensors held after a training forward")
    return lines


if __name__ == "__main__":
    raise SystemExit(standalone_main(OP, __doc__, run, report))
