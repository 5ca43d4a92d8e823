"""The pre-LN transformer MLP block trained under AMP:
y = x + MLP(LayerNorm(x)), loss = mean(y^2), x fp32 (the residual stream), one training
step = forward + backward.

Providers: fp32 eager, AMP fp16/bf16 eager, AMP fp16 torch.compile, and ampkernels under
AMP: the eager block after nn.convert() (LayerNorm + fused Linear/GELU), and LayerNorm +
nn.FusedMLP (one hidden-sized tensor saved), the latter also on the Triton backend (bf16);
both norms emit the autocast dtype
(out_dtype="autocast"), since their output only feeds the first matmul. Rows: ms per step, peak extra memory (MiB
above the inputs and weights, measured over one untimed step), the memory the forward leaves for backward
(held_after_fwd_MiB, incl. the fp32 y), tokens/s.
"""
import contextlib
import copy

import torch

from .common import bench, cuda_step_peak, guard, own_compiles, progress, standalone_main

SHAPES = [(16384, 1024), (8192, 4096)]


def _eager_block(hidden):
    return torch.nn.Sequential(torch.nn.LayerNorm(hidden), torch.nn.Linear(hidden, 4 * hidden),
                               torch.nn.GELU(approximate="tanh"), torch.nn.Linear(4 * hidden, hidden))


def _providers(hidden):
    import ampkernels.nn as aknn

    torch.manual_seed(0)
    eager = _eager_block(hidden).cuda()
    converted = copy.deepcopy(eager)
    aknn.convert(converted, norm_out_dtype="autocast")  # the norm feeds a matmul: emit fp16/bf16
    fused = torch.nn.Sequential(aknn.LayerNorm(hidden, out_dtype="autocast"),
                                aknn.FusedMLP(hidden, 4 * hidden, activation="gelu_tanh"))
    fused.load_state_dict(fused_block_state_dict(eager.state_dict()))
    fused.cuda()
    fused_triton = copy.deepcopy(fused)
    fused_triton[1].backend = "triton"
    return [("fp32", eager, None), ("amp_fp16", eager, torch.float16), ("amp_bf16", eager, torch.bfloat16),
            ("amp_fp16_compile", "compile", torch.float16),
            ("ampkernels_convert_fp16", converted, torch.float16),
            ("ampkernels_convert_bf16", converted, torch.bfloat16),
            ("ampkernels_fusedmlp_fp16", fused, torch.float16),
            ("ampkernels_fusedmlp_bf16", fused, torch.bfloat16),
            ("ampkernels_fusedmlp_triton_bf16", fused_triton, torch.bfloat16)], eager


def fused_block_state_dict(sd):
    """Sequential(LN, Linear, act, Linear)'s state_dict keyed for Sequential(LN, FusedMLP)."""
    return {("0." + k[2:]) if k.startswith("0.") else f"1.{int(k[0]) - 1}.{k[2:]}": v for k, v in sd.items()}


def run(recorder, dtypes, quick, shapes=None):
    """shapes: (tokens, hidden) pairs, default SHAPES (the first alone with quick)."""
    shapes = shapes or (SHAPES[:1] if quick else SHAPES)
    for tokens, hidden in shapes:
        providers, eager = _providers(hidden)
        chosen = [p for p in providers if p[2] is None or p[2] in dtypes or "fp32" in p[0]]
        for name, block, dtype in progress(chosen, f"mlp_block T={tokens} H={hidden}", lambda p: p[0]):
            with own_compiles() if block == "compile" else contextlib.nullcontext():
                guard(recorder, f"mlp_block {name} T={tokens} H={hidden}", _step_time, recorder, name, block, eager,
                      dtype, tokens, hidden, quick)
            torch.cuda.empty_cache()


def make_step(block, eager, dtype, tokens, hidden):
    """(forward, step) of one provider on a fresh fp32 x (tokens, hidden) that requires grad:
    forward() returns y = x + block(x) under autocast to dtype (None: fp32, autocast off), step()
    is forward and backward of mean(y^2). block "compile": torch.compile of a copy of eager."""
    if block == "compile":
        torch._dynamo.reset()
        block = torch.compile(copy.deepcopy(eager))
    x = torch.randn(tokens, hidden, device="cuda", requires_grad=True)

    def forward():
        with torch.autocast("cuda", dtype=dtype or torch.float16, enabled=dtype is not None):
            return x + block(x)

    def step():
        forward().float().square().mean().backward()

    return forward, step


def _step_time(recorder, name, block, eager, dtype, tokens, hidden, quick):
    """One provider: ms per training step of y = x + block(x) and its peak extra memory."""
    forward, step = make_step(block, eager, dtype, tokens, hidden)
    peak = cuda_step_peak(step, warmup=3) / 2**20
    base = torch.cuda.memory_allocated()
    y = forward()
    held = (torch.cuda.memory_allocated() - base) / 2**20  # saved for backward, + y itself
    y.float().square().mean().backward()
    del y
    ms, p20, p80 = bench(step, rep=200 if not quick else 50)
    recorder.add(op="mlp_block", provider=name, **{"pass": "train_step"},
                 dtype=str(dtype).replace("torch.", "") if dtype else "fp32",
                 shape=f"T={tokens},H={hidden}", T=tokens, H=hidden, metric="ms", value=round(ms, 4),
                 ms=ms, ms_p20=p20, ms_p80=p80, peak_extra_MiB=round(peak, 1), held_after_fwd_MiB=round(held, 1),
                 tokens_per_s=round(tokens / ms * 1e3))


def report(rows):
    lines = []
    by = {(r.get("provider"), r.get("T"), r.get("H")): r for r in rows if r.get("op") == "mlp_block"}
    for (tokens, hidden), need in (((16384, 1024), 1.35), ((8192, 4096), 1.08)):
        for dt in ("fp16", "bf16"):
            eager = by.get((f"amp_{dt}", tokens, hidden))
            best = min((by[k] for k in by if k[0] and k[0].startswith("ampkernels") and k[0].endswith(dt)
                        and k[1:] == (tokens, hidden)), key=lambda r: r["ms"], default=None)
            if not eager or not best:
                continue
            speedup = eager["ms"] / best["ms"]
            lines.append(f"{'PASS' if speedup >= need else 'FALLS SHORT'}: MLP block T={tokens} H={hidden} {dt}: "
                         f"{best['provider']} {speedup:.2f}x eager AMP (target >= {need}x)")
            leanest = min((by[k] for k in by if k[0] and k[0].startswith("ampkernels") and k[0].endswith(dt)
                           and k[1:] == (tokens, hidden)), key=lambda r: r["peak_extra_MiB"])
            mem = leanest["peak_extra_MiB"] / eager["peak_extra_MiB"]
            lines.append(f"{'PASS' if mem <= 0.75 else 'FALLS SHORT'}: MLP block T={tokens} H={hidden} {dt}: "
                         f"{leanest['provider']} peak activation memory {mem:.0%} of eager AMP (target <= 75%)")
            if leanest.get("held_after_fwd_MiB") and eager.get("held_after_fwd_MiB"):
                lines.append(f"  (memory held from forward to backward: {leanest['held_after_fwd_MiB']:.0f} MiB vs "
                             f"eager {eager['held_after_fwd_MiB']:.0f} MiB, "
                             f"{leanest['held_after_fwd_MiB'] / eager['held_after_fwd_MiB']:.0%})")
    return lines


if __name__ == "__main__":
    raise SystemExit(standalone_main("mlp", __doc__, run, report))
