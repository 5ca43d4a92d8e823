"""linear_act benchmark: y = act(x @ W^T + b) side by side in one run.

Providers, per shape (M, K, N), dtype and activation:
  matmul            F.linear(x, W) without bias: the ceiling (fwd and fwd+bwd)
  eager             F.linear(x, W, b) then the activation (the unfused baseline)
  addmm_act         torch._addmm_activation (cuBLASLt GELU/ReLU epilogue; relu and gelu_tanh)
  compile           torch.compile of eager (fresh per shape: torch._dynamo.reset())
  ampkernels-cuda, ampkernels-triton (and ampkernels-triton-ptr: the pointer kernel, TMA off)
Passes: "fwd" = inference (no grad, nothing saved); "fwd_bwd" = training forward + backward
(dx, dW, db). Rows: TFLOP/s (2MNK fwd, 6MNK fwd+bwd) with median/p20/p80 ms, the relative
error of each provider's output against an fp32 reference, and the bytes each provider keeps
alive after a training forward (saved tensors + output).

    python -m benchmarks.bench_linear_act --out DIR [--quick]
"""
import os

import torch
import torch.nn.functional as F

from .common import bench, guard, standalone_main

SHAPES = [(4096, 768, 3072), (8192, 1024, 4096), (8192, 4096, 4096), (8192, 4096, 16384)]
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


def _providers(activation):
    import ampkernels

    def ours(backend, **kw):
        return lambda x, w, b: ampkernels.linear_act(x, w, b, activation, backend=backend, **kw)

    p = {"eager": lambda x, w, b: _eager(x, w, b, activation)}
    if activation in ("relu", "gelu_tanh"):
        p["addmm_act"] = lambda x, w, b: _addmm(x, w, b, activation)
    avail = ampkernels.available_backends()
    if avail["cuda"][0]:
        p["ampkernels-cuda"] = ours("cuda")
    if avail["triton"][0]:
        p["ampkernels-triton"] = ours("triton")
    return p


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


def _measure(recorder, name, fn, pas, x, w, b, dtype, shape, activation, quick, ref=None):
    m, k, n = shape
    flops = (2 if pas == "fwd" else 6) * m * n * k
    extra = {}
    if pas == "fwd":
        with torch.no_grad():
            if ref is not None:
                extra["rel_err"] = round(_rel_err(fn(x, w, b), ref), 6)
            ms = _timed(lambda: fn(x, w, b), quick)
    else:
        xs, ws, bs = (t.detach().requires_grad_() for t in (x, w, b))
        dy = torch.randn(m, n, dtype=dtype, device=x.device)

        def step():
            fn(xs, ws, bs).backward(dy)

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


def run(recorder, dtypes, quick, device="cuda"):
    """Measure every provider side by side. device="cpu" is only a smoke test of this code
    (tests use it with tiny shapes under TRITON_INTERPRET=1); its numbers mean nothing."""
    from ampkernels import reference

    if device == "cuda" and not torch.cuda.is_available():
        print("bench_linear_act: no CUDA device; nothing measured (see benchmarks/run.py for the CPU demo)")
        return
    dev = device
    for dtype in dtypes:
        for shape in SHAPES:
            m, k, n = shape
            g = torch.Generator(device=dev).manual_seed(0)
            x = torch.randn(m, k, device=dev, generator=g).to(dtype)
            w = (torch.randn(n, k, device=dev, generator=g) / k**0.5).to(dtype)
            b = (torch.randn(n, device=dev, generator=g) * 0.5).to(dtype)
            guard(recorder, "matmul fwd", lambda: _measure(recorder, "matmul", lambda x, w, b: F.linear(x, w), "fwd",
                                                            x, w, b, dtype, shape, "none", quick))
            guard(recorder, "matmul fwd_bwd", lambda: _measure(recorder, "matmul", lambda x, w, b: F.linear(x, w),
                                                                "fwd_bwd", x, w, b, dtype, shape, "none", quick))
            for activation in ACTIVATIONS:
                ref = reference.linear_act(x, w, b, activation).float()
                provs = _providers(activation)
                if activation == "gelu_tanh" and (not quick or shape == COMPILE_SHAPE):
                    # the pointer kernel, for comparison with the default TMA kernel
                    def ptr(x, w, b):
                        import ampkernels
                        os.environ["AMPKERNELS_TRITON_TMA"] = "0"
                        try:
                            return ampkernels.linear_act(x, w, b, activation, backend="triton")
                        finally:
                            os.environ.pop("AMPKERNELS_TRITON_TMA", None)
                    if "ampkernels-triton" in provs:
                        provs["ampkernels-triton-ptr"] = ptr
                if activation == "gelu_tanh" and (not quick or shape == COMPILE_SHAPE):
                    torch._dynamo.reset()
                    provs["compile"] = torch.compile(lambda x, w, b: _eager(x, w, b, activation))
                for name, fn in provs.items():
                    guard(recorder, f"{name} fwd", lambda: _measure(recorder, name, fn, "fwd", x, w, b, dtype, shape,
                                                                     activation, quick, ref))
                    if name != "addmm_act":
                        guard(recorder, f"{name} fwd_bwd", lambda: _measure(recorder, name, fn, "fwd_bwd", x, w, b,
                                                                             dtype, shape, activation, quick))
                if shape == COMPILE_SHAPE and activation in ("gelu_tanh", "relu") and dev == "cuda":
                    mem = {"eager": provs["eager"]}
                    for backend in ("cuda", "triton"):
                        if f"ampkernels-{backend}" in provs:
                            mem[f"ampkernels-{backend}"] = provs[f"ampkernels-{backend}"]
                    if "ampkernels-cuda" in provs:
                        import ampkernels
                        mem["ampkernels-cuda-recompute"] = lambda x, w, b: ampkernels.linear_act(
                            x, w, b, activation, backend="cuda", recompute=True)
                    for name, fn in mem.items():
                        guard(recorder, f"{name} memory", lambda: _memory_row(recorder, name, fn, x, w, b, dtype,
                                                                               shape, activation))
                del ref
            del x, w, b
            if dev == "cuda":
                torch.cuda.empty_cache()


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


def report(rows):
    """One line per target: measured ratio, threshold, PASS or FALLS SHORT; then the fastest
    backend per (dtype, activation, shape) for ampkernels/ops/linear_act.py's "auto" table."""
    idx = _index(rows)
    lines = []
    keys = sorted({(k[2], k[3], k[4]) for k in idx if k[4] in FWD_TARGET},
                  key=lambda t: (t[0], [int(v) for v in t[1].split("x")], t[2]))
    verdict = lambda ok: "PASS" if ok else "FALLS SHORT"  # noqa: E731
    for dtype, shape, act in keys:
        best, who = _best_ours(idx, "fwd", dtype, shape, act)
        mm = idx.get(("matmul", "fwd", dtype, shape, "none"))
        if best and mm:
            r = best / mm
            lines.append(f"linear_act fwd {act:9s} {dtype:8s} {shape:15s} {r:5.3f} of matmul (>= {FWD_TARGET[act]}) "
                         f"[{who}] {verdict(r >= FWD_TARGET[act])}")
        addmm = idx.get(("addmm_act", "fwd", dtype, shape, act if act in ("relu", "gelu_tanh") else "gelu_tanh"))
        if best and addmm:
            r = best / addmm
            lines.append(f"linear_act fwd {act:9s} {dtype:8s} {shape:15s} {r:5.3f} of _addmm_activation (>= 1.0) "
                         f"{verdict(r >= 1.0)}")
        best_t, who_t = _best_ours(idx, "fwd_bwd", dtype, shape, act)
        mm_t = idx.get(("matmul", "fwd_bwd", dtype, shape, "none"))
        if best_t and mm_t:
            r = best_t / mm_t
            lines.append(f"linear_act fwd+bwd {act:9s} {dtype:8s} {shape:15s} {r:5.3f} of matmul (>= 0.95) "
                         f"[{who_t}] {verdict(r >= 0.95)}")
        eager_t = idx.get(("eager", "fwd_bwd", dtype, shape, act))
        if best_t and eager_t and shape == "x".join(map(str, COMPILE_SHAPE)) and act in ("gelu", "gelu_tanh"):
            r = best_t / eager_t
            lines.append(f"linear_act fwd+bwd {act:9s} {dtype:8s} {shape:15s} {r:5.3f}x eager (>= 1.15) "
                         f"{verdict(r >= 1.15)}")
        eager_f = idx.get(("eager", "fwd", dtype, shape, act))
        if best and eager_f:
            lines.append(f"linear_act fwd {act:9s} {dtype:8s} {shape:15s} {best / eager_f:5.3f}x eager (>= 1.0) "
                         f"{verdict(best >= eager_f)}")
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


if __name__ == "__main__":
    raise SystemExit(standalone_main("linear_act", __doc__, run, report))
