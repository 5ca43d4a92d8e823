"""End to end: a GPT-2-small-sized language model (transformers' GPT2LMHeadModel, built
from a config; nothing downloaded) trained on synthetic tokens, in FP32, AMP fp16 +
GradScaler, AMP bf16, AMP + ampkernels.nn.convert, AMP + torch.compile, and both.

Every mode starts from the same weights and sees the same batches, so the loss after N
steps shows whether accuracy changed. Rows: ms per step (median of the timed steps),
tokens/s, peak memory, final loss.
"""
import copy
import time

import torch

from .common import guard, progress, standalone_main


def synthetic_batches(steps, batch, seq, vocab, seed=0):
    """Tokens from a fixed random bigram model (peaked, so there is something to learn)."""
    g = torch.Generator().manual_seed(seed)
    next_tok = torch.randint(0, vocab, (vocab, 4), generator=g)  # each token has 4 likely successors
    out = []
    for _ in range(steps):
        t = torch.empty(batch, seq, dtype=torch.long)
        t[:, 0] = torch.randint(0, vocab, (batch,), generator=g)
        choice = torch.randint(0, 4, (batch, seq), generator=g)
        noise = torch.rand(batch, seq, generator=g) < 0.1
        rand_tok = torch.randint(0, vocab, (batch, seq), generator=g)
        for i in range(1, seq):
            t[:, i] = torch.where(noise[:, i], rand_tok[:, i], next_tok[t[:, i - 1], choice[:, i]])
        out.append(t)
    return out


def run(recorder, dtypes, quick):
    import transformers

    layers, batch, seq = (4, 8, 512) if quick else (12, 8, 1024)
    steps, timed = (8, 4) if quick else (30, 15)
    cfg = transformers.GPT2Config(n_embd=768, n_layer=layers, n_head=12, n_positions=seq, vocab_size=50257,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    base = transformers.GPT2LMHeadModel(cfg)
    data = [b.cuda() for b in synthetic_batches(steps, batch, seq, cfg.vocab_size)]
    modes = [("fp32", None, None)]
    for dt in dtypes:
        tag = "fp16" if dt == torch.float16 else "bf16"
        modes += [(f"amp_{tag}", dt, None), (f"amp_{tag}_ampkernels", dt, "convert"),
                  (f"amp_{tag}_compile", dt, "compile"), (f"amp_{tag}_ampkernels_compile", dt, "convert+compile")]
    shape = f"L={layers},B={batch},S={seq}"
    for name, dtype, variant in progress(modes, "e2e_gpt2", lambda m: m[0]):
        guard(recorder, f"e2e {name}", _train, recorder, base, data, name, dtype, variant, timed, shape)
        torch.cuda.empty_cache()


def _train(recorder, base, data, name, dtype, variant, timed, shape):
    """One mode: train a copy of `base` on `data`; a row with the median step time of the last
    `timed` steps, peak memory and the final loss."""
    import ampkernels.nn as aknn

    model = copy.deepcopy(base).cuda().train()
    if variant in ("convert", "convert+compile"):  # GPT-2's norms feed only matmuls: emit the autocast dtype
        aknn.convert(model, norm_out_dtype="autocast")
    fwd = model
    if variant in ("compile", "convert+compile"):  # our ops are custom ops: compile keeps them whole
        torch._dynamo.reset()
        fwd = torch.compile(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
    scaler = torch.amp.GradScaler("cuda", enabled=dtype == torch.float16)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times, loss, steps = [], None, len(data)
    for i, ids in enumerate(data):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.time()
        start.record()
        with torch.autocast("cuda", dtype=dtype or torch.float16, enabled=dtype is not None):
            loss = fwd(ids, labels=ids).loss
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        end.record()
        end.synchronize()
        if i == 0:
            first_s = time.time() - t0  # includes compilation for torch.compile
        if i >= steps - timed:
            times.append(start.elapsed_time(end))
    times.sort()
    ms = times[len(times) // 2]
    batch, seq = data[0].shape
    recorder.add(op="e2e_gpt2", provider=name, **{"pass": "train_step"},
                 dtype=str(dtype).replace("torch.", "") if dtype else "fp32",
                 shape=shape, metric="ms", value=round(ms, 2), ms=ms,
                 tokens_per_s=round(batch * seq / ms * 1e3), peak_mem_GiB=round(
                     torch.cuda.max_memory_allocated() / 2**30, 2),
                 final_loss=round(loss.item(), 4), steps=steps, first_step_s=round(first_s, 1))


def report(rows):
    by = {r["provider"]: r for r in rows if r.get("op") == "e2e_gpt2"}
    lines = []
    for tag in ("fp16", "bf16"):
        amp, ours = by.get(f"amp_{tag}"), by.get(f"amp_{tag}_ampkernels")
        if amp and ours:
            lines.append(f"INFO: GPT-2 e2e {tag}: ampkernels {amp['ms'] / ours['ms']:.2f}x AMP eager step time, "
                         f"peak memory {ours['peak_mem_GiB']} vs {amp['peak_mem_GiB']} GiB, "
                         f"final loss {ours['final_loss']} vs {amp['final_loss']}")
        compiled, both = by.get(f"amp_{tag}_compile"), by.get(f"amp_{tag}_ampkernels_compile")
        if compiled and both:
            lines.append(f"INFO: GPT-2 e2e {tag} under torch.compile: ampkernels {compiled['ms'] / both['ms']:.2f}x "
                         f"compile alone, peak memory {both['peak_mem_GiB']} vs {compiled['peak_mem_GiB']} GiB")
    return lines


if __name__ == "__main__":
    raise SystemExit(standalone_main("e2e", __doc__, run, report))
