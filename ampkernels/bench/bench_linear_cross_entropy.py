"""The LM head + loss: cross_entropy(x @ W^T, target), forward + backward, side by side.

Providers, each on the same x (tokens, hidden) 16-bit activations requiring grad, W (vocab,
hidden) requiring grad, in two weight setups: fp32 master weights under autocast ("w=fp32") and
16-bit weights ("w=bf16"/"w=fp16"):
- eager: F.cross_entropy(F.linear(x, W).float(), target), the logits upcast to fp32 as
  Hugging Face's ForCausalLMLoss does;
- compile: torch.compile of the same function;
- liger: LigerFusedLinearCrossEntropyLoss (when liger-kernel imports; ampkernels.bench.providers);
- ampkernels_cuda, ampkernels_triton: ampkernels.linear_cross_entropy(backend=...).
Rows: median ms of one training step (zeroed grads, loss forward, backward: pass "fwd_bwd") and
of the forward alone under no_grad (pass "fwd"), and peak extra memory of a training step: what
torch.cuda.max_memory_allocated reaches above the memory held before it (the inputs x, W,
target; so the gradients of x and W count, for every provider alike), with the size of the full
16-bit logits for reference.

    python -m ampkernels.bench.bench_linear_cross_entropy --out DIR [--quick] [--dtype bfloat16]
    ampkernels bench --op linear_cross_entropy [--quick] [--shapes TxHxV ...]
"""
import math

import torch
import torch.nn.functional as F

from . import providers
from .common import bench, cuda_step_peak, first_call_s, guard, progress, standalone_main

SHAPES = [(8192, 768, 50257), (8192, 4096, 128256)]  # (tokens, hidden, vocab): GPT-2 and Llama-3 8B heads


def _eager(x, w, t):
    return F.cross_entropy(F.linear(x, w).float(), t)


def _providers():
    import ampkernels

    out = [("eager", _eager), ("compile", "compile")]
    found = {p.name: p for p in providers.discover("linear_cross_entropy")}
    if "liger" in found:
        impl = found["liger"].ops["linear_cross_entropy"].fn
        out.append(("liger", lambda x, w, t: impl(x, w, t, None)))
    for backend in ("cuda", "triton"):
        out.append((f"ampkernels_{backend}",
                    lambda x, w, t, backend=backend: ampkernels.linear_cross_entropy(x, w, t, backend=backend)))
    return out, found


def _inputs(tokens, hidden, vocab, dtype, weight_dtype):
    torch.manual_seed(0)
    x = torch.randn(tokens, hidden, device="cuda").to(dtype).requires_grad_()
    w = (torch.randn(vocab, hidden, device="cuda") / math.sqrt(hidden)).to(weight_dtype).requires_grad_()
    t = torch.randint(0, vocab, (tokens,), device="cuda")
    t[::17] = -100  # some ignored tokens, as with padding and prompts
    return x, w, t


def _measure(recorder, name, fn, tokens, hidden, vocab, dtype, weight_dtype, quick, fields):
    if fn == "compile":
        torch._dynamo.reset()
        fn = torch.compile(_eager)
    x, w, t = _inputs(tokens, hidden, vocab, dtype, weight_dtype)
    autocast = weight_dtype != dtype

    def loss():
        with torch.autocast("cuda", dtype=dtype, enabled=autocast):
            return fn(x, w, t)

    def step():
        x.grad = w.grad = None
        loss().backward()

    def forward():
        with torch.no_grad():
            loss()

    compile_s = first_call_s(step)
    peak = cuda_step_peak(step, warmup=2) / 2**20
    rep = 30 if quick else 100
    wname = "fp32" if autocast else str(dtype).replace("torch.", "").replace("float", "fp").replace("bfp", "bf")
    common = dict(op="linear_cross_entropy", provider=name, dtype=str(dtype).replace("torch.", ""),
                  weight_dtype=wname, shape=f"T={tokens},H={hidden},V={vocab},w={wname}", T=tokens, H=hidden,
                  V=vocab, **fields)
    ms, p20, p80 = bench(step, rep=rep)
    recorder.add(**common, **{"pass": "fwd_bwd"}, metric="ms", value=round(ms, 4), ms=ms, ms_p20=p20, ms_p80=p80,
                 peak_extra_MiB=round(peak, 1), logits_MiB=round(tokens * vocab * 2 / 2**20, 1),
                 first_call_s=compile_s, tokens_per_s=round(tokens / ms * 1e3))
    ms, p20, p80 = bench(forward, rep=rep)
    recorder.add(**common, **{"pass": "fwd"}, metric="ms", value=round(ms, 4), ms=ms, ms_p20=p20, ms_p80=p80)


def run(recorder, dtypes, quick, shapes=None):
    """shapes: (tokens, hidden, vocab) triples, default SHAPES (the first alone with quick)."""
    shapes = shapes or (SHAPES[:1] if quick else SHAPES)
    provs, found = _providers()
    for tokens, hidden, vocab in shapes:
        cases = [(p, dt, wdt) for dt in dtypes for wdt in (torch.float32, dt) for p in provs]
        for (name, fn), dtype, wdt in progress(cases, f"linear_cross_entropy T={tokens} H={hidden} V={vocab}",
                                               lambda c: f"{c[0][0]} {c[1]} w={c[2]}"):
            fields = found[name].fields("linear_cross_entropy") if name in found else {}
            guard(recorder, f"linear_cross_entropy {name} T={tokens} H={hidden} V={vocab} {dtype} w={wdt}",
                  _measure, recorder, name, fn, tokens, hidden, vocab, dtype, wdt, quick, fields)
            torch.cuda.empty_cache()


def report(rows):
    """Per shape and setup: each provider's step time and peak memory against eager's."""
    lines = []
    steps = [r for r in rows if r.get("op") == "linear_cross_entropy" and r.get("pass") == "fwd_bwd"]
    for key in dict.fromkeys(r["shape"] + " " + r["dtype"] for r in steps):
        group = {r["provider"]: r for r in steps if r["shape"] + " " + r["dtype"] == key}
        eager = group.get("eager")
        if not eager:
            continue
        parts = []
        for name, r in group.items():
            if name == "eager":
                continue
            mem = r["peak_extra_MiB"] / max(eager["peak_extra_MiB"], 1e-9)
            parts.append(f"{name} {r['ms']:.2f} ms ({eager['ms'] / r['ms']:.2f}x), {r['peak_extra_MiB']:.0f} MiB ({mem:.0%})")
        lines.append(f"linear_cross_entropy {key}: eager {eager['ms']:.2f} ms, {eager['peak_extra_MiB']:.0f} MiB; "
                     + "; ".join(parts))
    return lines


if __name__ == "__main__":
    raise SystemExit(standalone_main("linear_cross_entropy", __doc__, run, report))
