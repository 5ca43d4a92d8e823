"""Soak: a long AMP fp16 training run of a small GPT-2 converted to ampkernels, against the same
run of the unconverted model.

    python3 scripts/soak.py [--steps 10000] [--out DIR_OR_FILE.json] [--layers 2] [--hidden 256]
                            [--seq 128] [--batch 8] [--backend auto] [--overflow-steps 2500,5000]

Both runs start from one initialisation and see the same batches (synthetic bigram batches,
ampkernels.bench.bench_e2e.synthetic_batches; by default a fresh batch every step, so the loss
settles at the data's entropy instead of a memorised near-zero, where two runs' tails cannot be
compared). Per run, checked:
- forced overflows: at --overflow-steps an inf is written into one gradient after backward; the
  GradScaler must skip that step (the parameters and AdamW's step count unchanged) and halve its
  scale;
- memory (GPU): torch.cuda.memory_allocated after warm-up against the end (growth at most
  --mem-slack bytes), and max_memory_allocated of the first and second halves after warm-up
  (equal within --mem-slack);
- host syncs (GPU): at the first step after warm-up each region of the step (forward, backward,
  scaler.step, scaler.update, zero_grad) runs under torch.cuda.set_sync_debug_mode("warn") and
  the regions that sync are recorded (for the report: which calls sync); every later step runs
  the regions that did not sync in the unconverted model under set_sync_debug_mode("error"), so
  a sync that conversion adds fails the run at once. Losses stay on the device until the end
  (no .item() in the loop).
- loss: the mean loss of the last 10% of steps, converted against unconverted, within
  --loss-rtol (relative).
On CPU (no GPU) the same loop runs (autocast fp16 on CPU, the torch backends) without the sync
and memory checks: `--steps 20` is a smoke check (tests/test_soak.py).
Prints a summary and writes it as JSON (--out: a .json path, or a directory for soak.json in it).
"""
import argparse
import copy
import json
import math
import os
import sys
import time
import warnings

import torch

SYNC_WARNING = "synchroniz"  # torch's sync-debug warning: "called a synchronizing CUDA operation"
REGIONS = ("forward", "backward", "scaler_step", "scaler_update", "zero_grad")


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=10000)
    p.add_argument("--out", default=None, help="a .json path, or a directory (soak.json in it)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--pool", type=int, default=None, help="distinct batches, cycled (default: one per step)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--backend", default=None, help="ampkernels backend of the converted modules (default auto)")
    p.add_argument("--overflow-steps", default=None, help="comma-separated; default: 1/4 and 1/2 of --steps")
    p.add_argument("--warmup", type=int, default=None, help="default: min(200, steps // 10)")
    p.add_argument("--mem-slack", type=int, default=1 << 20, help="bytes")
    p.add_argument("--loss-rtol", type=float, default=0.02)
    p.add_argument("--no-baseline", action="store_true", help="skip the unconverted run (and the loss check)")
    return p.parse_args(argv)


class SyncProbe:
    """Runs step regions under the sync-debug mode: "warn" recording which regions sync, or
    "error" for the regions in `strict` (a sync there raises). A no-op without CUDA."""

    def __init__(self, cuda):
        self.cuda, self.mode, self.strict, self.synced = cuda, None, set(), {}

    def region(self, name, fn):
        if not self.cuda or self.mode is None:
            return fn()
        if self.mode == "warn":
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    return fn()
                finally:
                    torch.cuda.set_sync_debug_mode("default")
                    msgs = [str(w.message) for w in caught if SYNC_WARNING in str(w.message)]
                    if msgs:
                        self.synced[name] = len(msgs)
        if name not in self.strict:
            return fn()
        torch.cuda.set_sync_debug_mode("error")
        try:
            return fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")


def train(name, base, batches, args, device, dtype, convert, overflow_steps, strict=None):
    """One run; returns its summary dict (losses as a list)."""
    import ampkernels.nn as aknn

    model = copy.deepcopy(base).to(device).train()
    if convert:
        _, report = aknn.convert(model, backend=args.backend, norm_out_dtype="autocast")
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, fused=device == "cuda")
    scaler = torch.amp.GradScaler(device)
    cuda = device == "cuda"
    probe = SyncProbe(cuda)
    warmup = args.warmup if args.warmup is not None else min(200, args.steps // 10)
    losses = torch.zeros(args.steps, device=device)
    probe_param = next(p for p in model.parameters() if p.requires_grad)
    overflow_results, mem = [], {}
    t0 = time.time()
    for i in range(args.steps):
        ids = batches[i % len(batches)]
        if cuda and i == warmup:  # the step after warm-up: which regions sync (probe), then memory baselines
            torch.cuda.synchronize()
            mem["after_warmup"] = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            probe.mode = "warn"
        elif cuda and i == warmup + 1:
            probe.strict = set(REGIONS) - set(probe.synced) if strict is None else strict
            probe.mode = "error"
        if cuda and i == warmup + (args.steps - warmup) // 2:
            mem["peak_first_half"] = torch.cuda.max_memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        forced = i in overflow_steps
        if forced:  # outside the hot path: syncs are fine here
            scale_before = scaler.get_scale()
            param_before = probe_param.detach().cpu()  # on the host: no GPU memory in the peak check
            step_before = _adam_step(opt, probe_param)

        def fwd():
            with torch.autocast(device, dtype=dtype):
                return model(ids, labels=ids).loss

        loss = probe.region("forward", fwd)
        losses[i] = loss.detach().float()
        probe.region("backward", lambda: scaler.scale(loss).backward())
        if forced:
            probe_param.grad.view(-1)[0] = float("inf")
        probe.region("scaler_step", lambda: scaler.step(opt))
        probe.region("scaler_update", lambda: scaler.update())
        probe.region("zero_grad", lambda: opt.zero_grad(set_to_none=True))
        if forced:
            scale_after = scaler.get_scale()
            overflow_results.append(dict(
                step=i, scale_before=scale_before, scale_after=scale_after,
                skipped=bool(torch.equal(param_before, probe_param.detach().cpu())) and _adam_step(opt, probe_param) ==
                step_before, scale_halved=math.isclose(scale_after, scale_before * scaler.get_backoff_factor())))
    if cuda:
        torch.cuda.synchronize()
        mem["end"] = torch.cuda.memory_allocated()
        mem["peak_second_half"] = torch.cuda.max_memory_allocated()
    elapsed = time.time() - t0
    losses = losses.cpu()
    skipped = {o["step"] for o in overflow_results}
    tail = [v for j, v in enumerate(losses.tolist()) if j >= args.steps - max(1, args.steps // 10) and j not in skipped]
    out = dict(name=name, converted=convert, steps=args.steps, seconds=round(elapsed, 1),
               ms_per_step=round(1e3 * elapsed / args.steps, 2), first_loss=losses[0].item(),
               tail_mean_loss=sum(tail) / len(tail), loss_curve=_curve(losses, skipped), finite=bool(torch.isfinite(losses).all()),
               overflows=overflow_results, memory=mem, synced_regions=probe.synced,
               strict_regions=sorted(probe.strict), final_scale=scaler.get_scale())
    if convert:
        out["converted_modules"] = str(report)
    return out, set(probe.synced)


def _curve(losses, skipped, points=50):
    """The loss curve: means of `points` runs of consecutive steps (forced-overflow steps left out)."""
    vals = [(k, v) for k, v in enumerate(losses.tolist()) if k not in skipped]
    size = max(1, -(-len(vals) // points))
    return [round(sum(v for _, v in vals[i:i + size]) / len(vals[i:i + size]), 4) for i in range(0, len(vals), size)]


def _adam_step(opt, p):
    step = opt.state.get(p, {}).get("step")
    return None if step is None else float(step)


def checks(run, args):
    """(name, ok, detail) for one run."""
    res = [("losses finite", run["finite"], "")]
    for o in run["overflows"]:
        res.append((f"overflow at step {o['step']} skipped", o["skipped"], ""))
        res.append((f"overflow at step {o['step']} halved the scale", o["scale_halved"],
                    f"{o['scale_before']} -> {o['scale_after']}"))
    mem = run["memory"]
    if mem:
        grow = mem["end"] - mem["after_warmup"]
        res.append(("no memory growth", grow <= args.mem_slack, f"{grow} bytes after warm-up"))
        dpeak = mem["peak_second_half"] - mem["peak_first_half"]
        res.append(("peak memory stable", abs(dpeak) <= args.mem_slack, f"{dpeak:+d} bytes second half vs first"))
    return res


def main(argv=None):
    args = parse(argv)
    import transformers
    from ampkernels.bench.bench_e2e import synthetic_batches

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.float16
    overflow_steps = ({int(s) for s in args.overflow_steps.split(",")} if args.overflow_steps
                      else {args.steps // 4, args.steps // 2})
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_embd=args.hidden, n_layer=args.layers, n_head=args.heads, n_positions=args.seq,
                                  vocab_size=args.vocab, bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    base = transformers.GPT2LMHeadModel(cfg)
    batches = [b.to(device) for b in synthetic_batches(min(args.pool or args.steps, args.steps), args.batch, args.seq, args.vocab)]
    runs, results = [], []
    baseline_synced = None
    if not args.no_baseline:
        run, baseline_synced = train("eager", base, batches, args, device, dtype, False, overflow_steps)
        runs.append(run)
    # the converted run is held to the baseline's regions: a region that did not sync there must not here
    strict = None if baseline_synced is None else set(REGIONS) - baseline_synced
    run, _ = train("ampkernels", base, batches, args, device, dtype, True, overflow_steps, strict)
    runs.append(run)
    for r in runs:
        results += [(f"{r['name']}: {n}", ok, d) for n, ok, d in checks(r, args)]
    if len(runs) == 2:
        a, b = runs[0]["tail_mean_loss"], runs[1]["tail_mean_loss"]
        rel = abs(a - b) / abs(a)
        results.append(("tail loss converted vs eager", rel <= args.loss_rtol, f"{b:.4f} vs {a:.4f} ({rel:.2%})"))
        new = sorted(set(runs[1]["synced_regions"]) - set(runs[0]["synced_regions"]))
        results.append(("no sync added by conversion", not new, ", ".join(new)))
    ok = all(r[1] for r in results)
    from ampkernels.bench.common import environment
    summary = dict(ok=ok, device=torch.cuda.get_device_name() if device == "cuda" else "cpu",
                   **environment(), time=time.strftime("%Y-%m-%dT%H:%M:%S%z"), config=vars(args),
                   overflow_steps=sorted(overflow_steps), runs=runs,
                   checks=[dict(check=n, ok=o, detail=d) for n, o, d in results])
    for r in runs:
        print(f"{r['name']}: {r['steps']} steps in {r['seconds']} s ({r['ms_per_step']} ms/step), loss "
              f"{r['first_loss']:.3f} -> tail mean {r['tail_mean_loss']:.4f}, final scale {r['final_scale']}, "
              f"regions that sync: {r['synced_regions'] or 'none'}, memory {r['memory'] or 'not checked (cpu)'}")
    for n, o, d in results:
        print(f"  {'ok  ' if o else 'FAIL'} {n}{': ' + d if d else ''}")
    if args.out:
        path = os.path.join(args.out, "soak.json") if not args.out.endswith(".json") else args.out
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(summary, f, indent=1)
        print(f"wrote {path}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
