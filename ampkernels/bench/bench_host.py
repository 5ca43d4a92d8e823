"""Host time per call: what each ampkernels op costs the CPU against the torch op(s) it
replaces, forward and backward apart (issue 32: an op must cost the host no more).

    ampkernels bench --op host

Cases, all under autocast with fp32 parameters and (but for the last two) 16-bit x, at tiny shapes
(8 rows of 256) so that the GPU never holds the host back:
- layer_norm / rms_norm, with and without a residual, against F.layer_norm / F.rms_norm
  (after x + residual);
- linear_act (gelu_tanh, relu) against F.linear followed by the activation;
- FusedMLP (256 -> 1024 -> 256, gelu_tanh) against the Linear-GELU-Linear it is;
- the norm modules as convert(model, norm_out_dtype="autocast") puts them in a pre-norm
  transformer whose residual stream is fp32 (timm's ViT): 3-D fp32 x (2 x 4 rows of 256),
  ampkernels.nn.LayerNorm / RMSNorm against torch.nn's, the module call included; and LayerNorm's
  forward_residual(16-bit branch, stream), as FusedResidualBlocks calls it, against the add and
  torch.nn.LayerNorm;
- rotary_embedding of q and k (1 x 4 heads x 8 positions x 64, 16-bit; cos/sin fp32, as Hugging
  Face's LLaMA makes them) against Hugging Face's apply_rotary_pos_emb formula;
- gated_linear_act (SwiGLU, 256 -> 1024) against F.silu(F.linear(x, Wg)) * F.linear(x, Wu);
- linear_cross_entropy (8 rows of 256, vocab 1024) against F.cross_entropy(F.linear(x, W).float(), t)
  ("auto" runs that composite itself at this size; cuda and triton the chunked op).

Each call runs in its own autocast region (a step's forward casts each parameter once; one
region around all calls would let torch reuse its cached casts). Host time of a call: the wall
time of CALLS back-to-back calls without synchronisation, divided by CALLS, after warm-up; the
median of REPEATS such runs, the providers of a case taking turns run by run (the host's drift
reaches each alike). A backward is timed on graphs built beforehand (one forward each), so that
its time holds no forward. Each ampkernels backend is timed ("cuda", "triton", "auto"). Rows:
op, case, pass (fwd|bwd), provider, host_us; the report adds each case's fwd+bwd.

Without a GPU the torch reference path runs (a CPU demo: there the time is the CPU's
whole work, not host overhead beside a GPU).
"""
import statistics
import time

import torch
import torch.nn.functional as F

from .common import guard, progress

ROWS, HIDDEN, FFN = 8, 256, 1024
CALLS, REPEATS, WARMUP = 200, 11, 20
CPU_CALLS, CPU_REPEATS, CPU_WARMUP = 10, 3, 2


def _activation(device, dtype):
    """A (ROWS, HIDDEN) 16-bit input that wants its gradient."""
    return torch.randn(ROWS, HIDDEN, device=device, dtype=dtype, requires_grad=True)


def _weight(device):
    """An fp32 (FFN, HIDDEN) master weight, scaled as nn.Linear initialises it."""
    return (torch.randn(FFN, HIDDEN, device=device) * HIDDEN ** -0.5).requires_grad_()


def _norm_case(op, residual):
    import ampkernels

    def setup(device, dtype):
        x = _activation(device, dtype)
        r = _activation(device, dtype)
        w = (torch.rand(HIDDEN, device=device) + 0.5).requires_grad_()
        b = torch.randn(HIDDEN, device=device).requires_grad_()
        inputs = (x, r, w) if op == "rms_norm" else (x, r, w, b)
        if not residual:
            inputs = inputs[:1] + inputs[2:]

        def ours(backend):
            kw = dict(residual=r if residual else None, backend=backend)
            if op == "rms_norm":
                return lambda: ampkernels.rms_norm(x, (HIDDEN,), w, 1e-6, **kw)
            return lambda: ampkernels.layer_norm(x, (HIDDEN,), w, b, 1e-5, **kw)

        def eager():
            s = x + r if residual else x
            out = F.rms_norm(s, (HIDDEN,), w, 1e-6) if op == "rms_norm" else F.layer_norm(s, (HIDDEN,), w, b, 1e-5)
            return (out, s) if residual else out
        return inputs, eager, ours
    return setup


def _linear_case(activation):
    import ampkernels
    torch_act = {"gelu_tanh": lambda z: F.gelu(z, approximate="tanh"), "relu": F.relu}[activation]

    def setup(device, dtype):
        x = _activation(device, dtype)
        w = _weight(device)
        b = torch.zeros(FFN, device=device).requires_grad_()
        return (x, w, b), (lambda: torch_act(F.linear(x, w, b))), \
            (lambda backend: lambda: ampkernels.linear_act(x, w, b, activation, backend=backend))
    return setup


def _mlp_case(device, dtype):
    import ampkernels.nn as aknn
    mlp = aknn.FusedMLP(HIDDEN, FFN, activation="gelu_tanh").to(device)
    x = _activation(device, dtype)

    def ours(backend):
        mlp.backend = backend
        return lambda: mlp(x)
    # FusedMLP is the nn.Sequential(Linear, GELU, Linear) it replaces: Sequential.forward runs that
    return (x, *mlp.parameters()), (lambda: torch.nn.Sequential.forward(mlp, x)), ours


def _norm_module_case(op, residual=False):
    """The module on an fp32 stream x (as a converted transformer calls it); with `residual`, its
    forward_residual(branch, x) against torch's x + branch, then the module (a pre-norm step)."""
    import ampkernels.nn as aknn

    def setup(device, dtype):
        x = torch.randn(2, ROWS // 2, HIDDEN, device=device, requires_grad=True)  # fp32: the stream
        branch = None if not residual else torch.randn(2, ROWS // 2, HIDDEN, device=device, dtype=dtype,
                                                       requires_grad=True)
        theirs, ours = (torch.nn.LayerNorm, aknn.LayerNorm) if op == "layer_norm" else (torch.nn.RMSNorm, aknn.RMSNorm)
        module, eager = ours(HIDDEN, out_dtype="autocast").to(device), theirs(HIDDEN).to(device)
        for name, p in module.named_parameters():
            setattr(eager, name, p)  # one set of parameters: both calls differentiate the same inputs

        def call(backend):
            module.backend = backend
            return (lambda: module.forward_residual(branch, x)) if residual else (lambda: module(x))

        def torch_call():
            s = x + branch
            return eager(s), s
        inputs = (x, branch, *module.parameters()) if residual else (x, *module.parameters())
        return inputs, (torch_call if residual else (lambda: eager(x))), call
    return setup


def _rotary_case(device, dtype):
    import ampkernels
    from ampkernels import reference
    heads, seq, head_dim = 4, ROWS, 64
    q, k = (torch.randn(1, seq, heads, head_dim, device=device, dtype=dtype).transpose(1, 2).requires_grad_()
            for _ in range(2))
    angle = torch.randn(1, seq, head_dim, device=device)
    cos, sin = angle.cos(), angle.sin()
    return (q, k), (lambda: reference.rotary_embedding(q, k, cos, sin)), \
        (lambda backend: lambda: ampkernels.rotary_embedding(q, k, cos, sin, backend=backend))


def _gated_case(device, dtype):
    import ampkernels
    x = _activation(device, dtype)
    wg, wu = _weight(device), _weight(device)
    return (x, wg, wu), (lambda: F.silu(F.linear(x, wg)) * F.linear(x, wu)), \
        (lambda backend: lambda: ampkernels.gated_linear_act(x, wg, wu, activation="silu", backend=backend))


def _lce_case(device, dtype):
    import ampkernels
    x = _activation(device, dtype)
    w = _weight(device)
    t = torch.randint(0, FFN, (ROWS,), device=device)
    return (x, w), (lambda: F.cross_entropy(F.linear(x, w).float(), t)), \
        (lambda backend: lambda: ampkernels.linear_cross_entropy(x, w, t, backend=backend))


CASES = {"layer_norm": ("layer_norm", _norm_case("layer_norm", False)),
         "layer_norm+residual": ("layer_norm", _norm_case("layer_norm", True)),
         "rms_norm": ("rms_norm", _norm_case("rms_norm", False)),
         "rms_norm+residual": ("rms_norm", _norm_case("rms_norm", True)),
         "linear_act gelu_tanh": ("linear_act", _linear_case("gelu_tanh")),
         "linear_act relu": ("linear_act", _linear_case("relu")),
         "fused_mlp": ("fused_mlp", _mlp_case),
         "layer_norm module (fp32 stream)": ("layer_norm", _norm_module_case("layer_norm")),
         "rms_norm module (fp32 stream)": ("rms_norm", _norm_module_case("rms_norm")),
         "layer_norm module + residual (fp32 stream)": ("layer_norm", _norm_module_case("layer_norm", residual=True)),
         "rotary_embedding": ("rotary_embedding", _rotary_case),
         "gated_linear_act silu": ("gated_linear_act", _gated_case),
         "linear_cross_entropy": ("linear_cross_entropy", _lce_case)}


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def host_once(fn, calls, device, prepare=None):
    """The wall time of `calls` unsynchronised calls of fn, us per call. prepare(calls) -> the
    calls' arguments, made before the clock starts (for backward: graphs)."""
    args = prepare(calls) if prepare else [()] * calls
    _sync(device)
    t0 = time.perf_counter()
    for a in args:
        fn(*a)
    us = (time.perf_counter() - t0) / calls * 1e6
    _sync(device)
    return us


def timers(fwd, inputs, device, warmup=WARMUP):
    """(forward timer, backward timer) of fwd() -> tensor or tuple, gradients to inputs: each
    timer(calls) is one host_once of that pass."""
    def outputs():
        out = fwd()
        return out if isinstance(out, tuple) else (out,)

    grads = [torch.randn_like(o) for o in outputs()]
    step = lambda outs: torch.autograd.grad(outs, inputs, grads)  # noqa: E731
    for _ in range(warmup):  # compiles, autotunes, fills caches
        step(outputs())
    return (lambda calls: host_once(fwd, calls, device),
            lambda calls: host_once(step, calls, device, prepare=lambda n: [(outputs(),) for _ in range(n)]))


def _providers(device):
    if device != "cuda":
        return ["torch"]  # the reference path: all the CPU runs
    from ampkernels import available_backends
    return [b for b in ("cuda", "triton") if available_backends()[b][0]] + ["auto"]


def run(recorder, dtypes, quick, device=None):
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    calls, repeats = (CALLS, REPEATS) if device == "cuda" else (CPU_CALLS, CPU_REPEATS)
    if quick:
        calls, repeats = max(calls // 4, 10), max(repeats // 2, 3)
    if device != "cuda":
        print("NO GPU: host-time benchmark of the torch reference path on the CPU (a CPU demo): these times are\n"
              "the CPU's whole work, not the host's overhead beside a GPU; run it on a CUDA machine.\n", flush=True)
        dtypes = [torch.bfloat16]
    cells = [(dt, case) for dt in dtypes for case in CASES]
    label = lambda c: f"{str(c[0]).replace('torch.', '')} {c[1]}"  # noqa: E731
    for dtype, case in progress(cells, "host", label):
        _cell(recorder, dtype, case, ["eager"] + _providers(device), calls, repeats, device)


def _cell(recorder, dtype, case, providers, calls, repeats, device):
    """One case, every provider: the providers' runs interleaved, repeat by repeat, so that the
    host's drift (clocks, other processes) reaches each alike; the median of each one's runs."""
    op, setup = CASES[case]
    runs = {}  # provider -> (inputs, fwd timer, bwd timer)
    for provider in providers:
        def prepare(provider=provider):
            inputs, eager, ours = setup(device, dtype)
            call = eager if provider == "eager" else ours(provider)

            def fn():
                # one autocast region per call, as a training step has one per forward: autocast
                # caches its casts of leaf tensors (here the parameters and x) until the region
                # closes, and one region around all calls would time torch's ops without their casts
                with torch.autocast(device, dtype=dtype):
                    return call()
            return (inputs, *timers(fn, inputs, device, WARMUP if device == "cuda" else CPU_WARMUP))
        got = guard(recorder, f"host {case} {provider}", prepare)
        if got is not None:
            runs[provider] = got
    times = {provider: ([], []) for provider in runs}
    for _ in range(repeats):
        for provider, (_, fwd, bwd) in list(runs.items()):
            got = guard(recorder, f"host {case} {provider}", lambda: (fwd(calls), bwd(calls)))
            if got is None:
                del runs[provider]
                continue
            times[provider][0].append(got[0])
            times[provider][1].append(got[1])
    for provider, (inputs, _, _) in runs.items():
        name = "torch" if provider == "eager" else f"ampkernels-{provider}"
        for pss, us in zip(("fwd", "bwd"), map(statistics.median, times[provider])):
            recorder.add(op=op, case=case, provider=name, **{"pass": pss}, dtype=str(dtype).replace("torch.", ""),
                         shape="x".join(map(str, inputs[0].shape)), device=device, bench="host",
                         metric="host us" if device == "cuda" else "host us (CPU demo)", value=round(us, 1),
                         host_us=us, calls=calls, repeats=repeats)


def report(rows):
    """Per (case, pass, dtype): torch's host us and each ampkernels provider's, at or above it;
    then per (case, dtype) the two passes together (a training call's host time: an op may move
    work between them, as linear_cross_entropy computes its gradients in the forward)."""
    by, device = {}, {}
    for r in rows:
        if r.get("bench") == "host":
            by.setdefault((r["case"], r["pass"], r["dtype"]), {})[r["provider"]] = r["host_us"]
            device[r["case"], r["dtype"]] = r.get("device")
    for (case, pss, dtype), cell in list(by.items()):
        bwd = by.get((case, "bwd", dtype)) if pss == "fwd" else None
        if bwd:
            by[(case, "fwd+bwd", dtype)] = {p: us + bwd[p] for p, us in cell.items() if p in bwd}
    lines = []
    for (case, pss, dtype), cell in by.items():
        ref = cell.get("torch")
        if not ref:
            continue
        demo = " (CPU demo)" if device[case, dtype] != "cuda" else ""
        ours = [f"{p} {us:.1f} ({us / ref:.2f}x) {'AT OR BELOW' if us <= ref else 'ABOVE'}"
                for p, us in cell.items() if p != "torch"]
        lines.append(f"host {case} {pss} {dtype}{demo}: torch {ref:.1f} us; " + ", ".join(ours))
    return lines


if __name__ == "__main__":
    import sys
    from .run import main
    raise SystemExit(main(["--op", "host"] + sys.argv[1:]))
