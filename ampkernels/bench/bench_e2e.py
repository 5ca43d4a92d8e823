"""End to end: training steps of four models built from configs (nothing downloaded), on
synthetic data, side by side in FP32, AMP fp16 (+GradScaler), AMP bf16 and AMP +
ampkernels.nn.convert, each eager and under torch.compile.

    ampkernels bench --op e2e                                   # everything (GPU)
    ampkernels bench --op e2e --models gpt2 --no-compile        # one slice
    ampkernels bench --op e2e --models llama --compile-only --modes amp_bf16 amp_bf16_convert

Models: GPT-2 small (GPT2LMHeadModel, 12 x 768, 8 x 1024 tokens), a LLaMA-style model
(LlamaForCausalLM, 12 x 1024, SwiGLU 2816, 16 heads, vocab 32000, 8 x 1024), BERT-base MLM
(BertForMaskedLM, 32 x 512, 15% of tokens masked) and ViT-B/16 (timm vit_base_patch16_224,
else transformers' ViTForImageClassification; 64 images of 224^2, random labels). Attention
is SDPA. Dropout probabilities are 0 in every model, so that the only difference between
modes is the arithmetic: every mode starts from the same weights (one model built per run,
copied per mode) and sees the same batches, and the loss after N steps shows whether
converting changed accuracy. Fused AdamW.

Each unconverted mode is run beside its converted one: the first half of the steps mode after
mode, the timed second half in bursts of a few steps taking the two in turn, so that the host's
drift over a run (eager steps wait on the host) reaches both alike.

Rows (op "e2e"): model, mode, compiled, ms per step (median of the timed steps; CUDA events
around the whole step: forward, backward, GradScaler, optimizer), host ms (the median time the
host took to issue a step, until it waits for the GPU: near ms, the step waits on the host),
tokens/s (images/s for ViT), peak memory (the mode's own: max_memory_allocated over its
untimed steps, less what was allocated before its model was built), loss after the last step,
first-step time (compilation included), steps, and for convert modes the call made and how
many modules it replaced.

Without a GPU a tiny CPU version runs (tiny configs, 3 steps, eager, fp32 and bf16 autocast,
each with and without convert): it checks the machinery end to end; its times say nothing
about GPU speed.
"""
import copy
import dataclasses
import gc
import importlib
import itertools
import statistics
import time

import torch

from .common import guard, own_compiles, progress

MODELS = ("gpt2", "llama", "bert", "vit")
TITLES = {"gpt2": "GPT-2 small", "llama": "LLaMA-style", "bert": "BERT-base MLM", "vit": "ViT-B/16"}
# mode -> autocast dtype (None: no autocast) and whether convert() runs; fp32_convert is not in
# the default GPU list (the CPU demo's exactness check)
MODES = {"fp32": (None, False), "fp32_convert": (None, True), "amp_fp16": (torch.float16, False),
         "amp_fp16_convert": (torch.float16, True), "amp_bf16": (torch.bfloat16, False),
         "amp_bf16_convert": (torch.bfloat16, True)}
CPU_MODES = ("fp32", "fp32_convert", "amp_bf16", "amp_bf16_convert")
# every row has these fields (peak_mem_GiB is None on CPU, converted / convert_call on unconverted modes)
ROW_FIELDS = ("op", "model", "mode", "compiled", "provider", "pass", "dtype", "shape", "device", "metric", "value",
              "ms", "host_ms", "peak_mem_GiB", "final_loss", "first_step_s", "steps", "timed_steps", "converted", "convert_call",
              "fused_loss", "params_M", "library")

# per model and size: "full" is the benchmark, "quick" a smaller GPU run, "tiny" the CPU demo
SIZES = {
    "gpt2": {"full": dict(layers=12, hidden=768, heads=12, vocab=50257, batch=8, seq=1024),
             "quick": dict(layers=4, hidden=768, heads=12, vocab=50257, batch=8, seq=512),
             "tiny": dict(layers=2, hidden=64, heads=4, vocab=512, batch=2, seq=32)},
    "llama": {"full": dict(layers=12, hidden=1024, inter=2816, heads=16, vocab=32000, batch=8, seq=1024),
              "quick": dict(layers=4, hidden=1024, inter=2816, heads=16, vocab=32000, batch=8, seq=512),
              "tiny": dict(layers=2, hidden=64, inter=176, heads=4, vocab=512, batch=2, seq=32)},
    "bert": {"full": dict(layers=12, hidden=768, inter=3072, heads=12, vocab=30522, batch=32, seq=512),
             "quick": dict(layers=4, hidden=768, inter=3072, heads=12, vocab=30522, batch=16, seq=512),
             "tiny": dict(layers=2, hidden=64, inter=256, heads=4, vocab=512, batch=2, seq=32)},
    "vit": {"full": dict(layers=12, hidden=768, heads=12, image=224, patch=16, classes=1000, batch=64),
            "quick": dict(layers=4, hidden=768, heads=12, image=224, patch=16, classes=1000, batch=32),
            "tiny": dict(layers=2, hidden=64, heads=4, image=32, patch=8, classes=10, batch=4)},
}
STEPS = {"full": 30, "quick": 10, "tiny": 3}
BURST = 3  # timed steps of one mode before the next mode of its group takes its turn
MASK_ID = 103  # BERT's [MASK]


@dataclasses.dataclass
class Workload:
    """One model to train: built once, copied per mode."""
    name: str
    model: torch.nn.Module
    batches: list  # CPU tensors (tuples); step i uses batches[i % len(batches)]
    loss: object  # loss(forward, batch) -> scalar tensor
    items: int  # tokens (images for ViT) per step
    unit: str
    convert_kwargs: dict  # what a user of this model passes to the integration's apply (convert's options)
    shape: str
    library: str
    integration: str = "transformers"  # ampkernels.integrations.<this>.apply converts the model


def synthetic_batches(steps, batch, seq, vocab, seed=0):
    """Tokens from a fixed random bigram model (peaked, so there is something to learn): `steps`
    batches of (batch, seq), drawn at once (views of one tensor)."""
    g = torch.Generator().manual_seed(seed)
    next_tok = torch.randint(0, vocab, (vocab, 4), generator=g)  # each token has 4 likely successors
    rows = steps * batch
    t = torch.empty(rows, seq, dtype=torch.long)
    t[:, 0] = torch.randint(0, vocab, (rows,), generator=g)
    choice = torch.randint(0, 4, (rows, seq), generator=g)
    noise = torch.rand(rows, seq, generator=g) < 0.1
    rand_tok = torch.randint(0, vocab, (rows, seq), generator=g)
    for i in range(1, seq):
        t[:, i] = torch.where(noise[:, i], rand_tok[:, i], next_tok[t[:, i - 1], choice[:, i]])
    return list(t.view(steps, batch, seq))


def masked_batches(steps, batch, seq, vocab, seed=0, rate=0.15):
    """(input_ids, labels) for masked-LM training: `rate` of the positions replaced by [MASK]
    and labelled with their token, the rest labelled -100 (ignored by the loss)."""
    g = torch.Generator().manual_seed(seed + 1)
    out = []
    for ids in synthetic_batches(steps, batch, seq, vocab, seed):
        mask = torch.rand(ids.shape, generator=g) < rate
        out.append((torch.where(mask, MASK_ID, ids), torch.where(mask, ids, -100)))
    return out


def _lm_loss(fwd, ids):
    return fwd(input_ids=ids, labels=ids).loss


def _mlm_loss(fwd, batch):
    ids, labels = batch
    return fwd(input_ids=ids, labels=labels).loss


def _text(name, model, batches, s, convert_kwargs, shape):
    import transformers
    loss = _mlm_loss if name == "bert" else _lm_loss
    return Workload(name, model, batches, loss, s["batch"] * s["seq"], "tokens", convert_kwargs, shape,
                    f"transformers {transformers.__version__}")


def _small_vocab_ids(s):
    # the tiny configs' vocabularies are smaller than the default special-token ids
    return dict(bos_token_id=0, eos_token_id=0) if s["vocab"] < 1000 else {}


def build_gpt2(size, steps):
    import transformers
    s = SIZES["gpt2"][size]
    cfg = transformers.GPT2Config(n_embd=s["hidden"], n_layer=s["layers"], n_head=s["heads"], n_positions=s["seq"],
                                  vocab_size=s["vocab"], resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                  attn_implementation="sdpa", **_small_vocab_ids(s))
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    # every norm feeds only a matmul (attention, MLP, LM head): let it emit the autocast dtype
    return _text("gpt2", model, synthetic_batches(steps, s["batch"], s["seq"], s["vocab"]), s,
                 {"norm_out_dtype": "autocast"}, f"L={s['layers']},H={s['hidden']},B={s['batch']},S={s['seq']}")


def build_llama(size, steps):
    import transformers
    s = SIZES["llama"][size]
    cfg = transformers.LlamaConfig(hidden_size=s["hidden"], intermediate_size=s["inter"],
                                   num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
                                   num_key_value_heads=s["heads"], vocab_size=s["vocab"],
                                   max_position_embeddings=s["seq"], attention_dropout=0.0,
                                   attn_implementation="sdpa", **_small_vocab_ids(s))
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    # pre-norm: each RMSNorm feeds only projections (q/k/v, gate/up, LM head)
    return _text("llama", model, synthetic_batches(steps, s["batch"], s["seq"], s["vocab"]), s,
                 {"norm_out_dtype": "autocast"},
                 f"L={s['layers']},H={s['hidden']},I={s['inter']},B={s['batch']},S={s['seq']}")


def build_bert(size, steps):
    import transformers
    s = SIZES["bert"][size]
    cfg = transformers.BertConfig(hidden_size=s["hidden"], num_hidden_layers=s["layers"],
                                  num_attention_heads=s["heads"], intermediate_size=s["inter"],
                                  vocab_size=s["vocab"], max_position_embeddings=max(s["seq"], 512),
                                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                  attn_implementation="sdpa")
    torch.manual_seed(0)
    model = transformers.BertForMaskedLM(cfg)
    # post-LN: a norm's output is the residual stream itself, so convert keeps its dtype (default)
    return _text("bert", model, masked_batches(steps, s["batch"], s["seq"], s["vocab"]), s, {},
                 f"L={s['layers']},H={s['hidden']},B={s['batch']},S={s['seq']}")


def build_vit(size, steps):
    s = SIZES["vit"][size]
    torch.manual_seed(0)
    try:
        import timm
        model = timm.create_model("vit_base_patch16_224", pretrained=False, num_classes=s["classes"],
                                  img_size=s["image"], patch_size=s["patch"], embed_dim=s["hidden"],
                                  depth=s["layers"], num_heads=s["heads"], drop_rate=0.0, attn_drop_rate=0.0,
                                  proj_drop_rate=0.0, drop_path_rate=0.0)
        library, integration = f"timm {timm.__version__}", "timm"

        def loss(fwd, batch):
            return torch.nn.functional.cross_entropy(fwd(batch[0]), batch[1])
    except ImportError:
        import transformers
        cfg = transformers.ViTConfig(hidden_size=s["hidden"], num_hidden_layers=s["layers"],
                                     num_attention_heads=s["heads"], intermediate_size=4 * s["hidden"],
                                     image_size=s["image"], patch_size=s["patch"], num_labels=s["classes"],
                                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                     attn_implementation="sdpa")
        model = transformers.ViTForImageClassification(cfg)
        library = f"transformers {transformers.__version__} (timm not importable)"
        integration = "transformers"

        def loss(fwd, batch):
            return fwd(pixel_values=batch[0], labels=batch[1]).loss
    g = torch.Generator().manual_seed(0)
    # a few distinct batches, cycled: 30 batches of 64 images would hold 1.1 GiB of the GPU's memory
    batches = [(torch.randn(s["batch"], 3, s["image"], s["image"], generator=g),
                torch.randint(0, s["classes"], (s["batch"],), generator=g)) for _ in range(min(steps, 4))]
    # pre-norm: each norm feeds attention, the MLP or the head
    return Workload("vit", model, batches, loss, s["batch"], "images", {"norm_out_dtype": "autocast"},
                    f"L={s['layers']},H={s['hidden']},B={s['batch']},img={s['image']}", library, integration)


BUILDERS = {"gpt2": build_gpt2, "llama": build_llama, "bert": build_bert, "vit": build_vit}


def _to(batch, device):
    return tuple(t.to(device) for t in batch) if isinstance(batch, tuple) else batch.to(device)


def _convert_call(work):
    return (f"ampkernels.integrations.{work.integration}.apply(model" +
            "".join(f", {k}={v!r}" for k, v in work.convert_kwargs.items()) + ")")


class _StepTimer:
    """ms of one step: CUDA events around it on a GPU, the wall clock on the CPU."""

    def __init__(self, device):
        self.cuda = device == "cuda"

    def start(self):
        self.t0 = time.perf_counter()
        if self.cuda:
            self.events = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.events[0].record()

    def issued(self):
        """Host ms since start: call when the step's work is queued, before waiting for it."""
        return (time.perf_counter() - self.t0) * 1e3

    def stop(self):
        """(ms by the events or clock, wall seconds since start), after the step has finished."""
        if self.cuda:
            self.events[1].record()
            self.events[1].synchronize()
            return self.events[0].elapsed_time(self.events[1]), time.perf_counter() - self.t0
        wall = time.perf_counter() - self.t0
        return wall * 1e3, wall


def model_copy(work, converts, device):
    """(a copy of work.model on device, modules replaced, fused loss) -- converted as a user
    would in one line: convert, and for a causal LM the fused LM head + loss."""
    model = copy.deepcopy(work.model).to(device).train()
    if not converts:
        return model, None, None
    conv = importlib.import_module(f"ampkernels.integrations.{work.integration}").apply(model, **work.convert_kwargs)
    return model, len(conv.replaced), conv.fused_loss


def training_step(work, model, fwd, dtype, device):
    """step() -> loss: one training step of model (forward through fwd, the model or its
    compiled form; autocast to dtype unless None, GradScaler for fp16, fused AdamW), on the
    next of work.batches each call."""
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
    scaler = torch.amp.GradScaler(device, enabled=dtype == torch.float16)
    batches = [_to(b, device) for b in work.batches]
    calls = itertools.count()

    def step():
        batch = batches[next(calls) % len(batches)]
        with torch.autocast(device, dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            loss = work.loss(fwd, batch)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        return loss
    return step


class _Run:
    """One mode of one model, trained step by step: its copy of the model, optimizer and step
    function, and what its steps measured."""

    def __init__(self, work, mode, compiled, device):
        self.mode, self.compiled, self.device = mode, compiled, device
        self.cuda = device == "cuda"
        dtype, converts = MODES[mode]
        self.dtype, self.converts = dtype, converts
        # peak memory counts this run's own allocations: others of its group stay allocated
        self.base_bytes = torch.cuda.memory_allocated() if self.cuda else 0
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        self.model, self.replaced, self.fused_loss = model_copy(work, converts, device)
        self.step = training_step(work, self.model, torch.compile(self.model) if compiled else self.model, dtype,
                                  device)
        self.timer, self.times, self.host = _StepTimer(device), [], []
        self.first_s = self.loss = self.peak_GiB = None

    def run(self, n, timed):
        for _ in range(n):
            self.timer.start()
            self.loss = self.step()
            issued = self.timer.issued()
            ms, wall = self.timer.stop()
            if self.first_s is None:
                self.first_s = wall  # includes compilation under torch.compile
            if timed:
                self.times.append(ms)
                self.host.append(issued)
        if self.cuda and self.peak_GiB is None:  # after the untimed steps, before the next run is built
            self.peak_GiB = round((torch.cuda.max_memory_allocated() - self.base_bytes) / 2**30, 2)


def _started(work, mode, compiled, device, steps):
    run = _Run(work, mode, compiled, device)
    run.run(steps, timed=False)
    return run


def train_group(recorder, work, modes, compiled, steps, device):
    """Train a copy of work.model per mode for `steps` steps each; one row per mode.

    The first half of each mode's steps runs mode after mode (first-step time, peak memory);
    the timed second half runs in bursts of BURST steps taking the modes in turn, in alternating
    order (A B, B A, ...), so that a drift of the host's speed during the run reaches every mode
    alike: eager steps wait on the host, and the host's speed varies over seconds.

    Compiled groups run without the AOTAutograd cache (common.own_compiles): with it a bf16 group
    was served the graph compiled for the fp16 group before it (fp16 math, no loss scaling)
    wherever the two traced alike: LLaMA, BERT and ViT did, with a first step of 1-3 s."""
    if not compiled:
        return _train_group(recorder, work, modes, compiled, steps, device)
    with own_compiles():
        torch._dynamo.reset()
        try:
            return _train_group(recorder, work, modes, compiled, steps, device)
        finally:
            torch._dynamo.reset()


def _train_group(recorder, work, modes, compiled, steps, device):
    warm = max(1, steps // 2)
    runs = [guard(recorder, f"e2e {work.name} {mode}" + (" compile" if compiled else " eager"), _started, work, mode,
                  compiled, device, warm) for mode in modes]
    runs = [r for r in runs if r is not None]  # a mode that failed has its error row; the others go on
    timed_in_turn(runs, steps - warm)
    return [_row(recorder, work, r, steps) for r in runs]


def timed_in_turn(runs, steps):
    """`steps` timed steps of each run, in bursts of BURST taking the runs in turn, in alternating
    order (A B, B A, ...): a drift of the host's speed reaches every run alike."""
    left, turn = steps, 0
    while left > 0:
        n = min(BURST, left)
        for r in runs if turn % 2 == 0 else runs[::-1]:
            r.run(n, timed=True)
        left, turn = left - n, turn + 1


def _row(recorder, work, r, steps):
    ms = statistics.median(r.times)
    return recorder.add(
        op="e2e", model=work.name, mode=r.mode, compiled=r.compiled,
        provider=r.mode + ("_compile" if r.compiled else ""), **{"pass": "train_step"},
        dtype=str(r.dtype or torch.float32).replace("torch.", ""), shape=work.shape, device=r.device,
        metric="ms" if r.cuda else "ms (CPU, not a GPU number)", value=round(ms, 2), ms=ms,
        host_ms=round(statistics.median(r.host), 2), **{f"{work.unit}_per_s": round(work.items / ms * 1e3)},
        peak_mem_GiB=r.peak_GiB, final_loss=round(r.loss.item(), 4), first_step_s=round(r.first_s, 3), steps=steps,
        timed_steps=len(r.times), converted=r.replaced, convert_call=_convert_call(work) if r.converts else None,
        fused_loss=r.fused_loss, params_M=round(sum(p.numel() for p in r.model.parameters()) / 1e6, 1),
        library=work.library)


def groups(modes):
    """The modes in the groups whose timed steps interleave: each unconverted mode with its
    converted one (the pair a speed-up compares), any other mode alone; in the order given."""
    out, seen = [], set()
    for mode in modes:
        if mode in seen:
            continue
        base = mode.removesuffix("_convert")
        pair = [m for m in (base, base + "_convert") if m in modes and m not in seen]
        out.append(pair)
        seen.update(pair)
    return out


def add_arguments(p):
    """The e2e options of `ampkernels bench` (run.py registers them)."""
    g = p.add_argument_group("e2e (--op e2e)")
    g.add_argument("--models", nargs="+", choices=MODELS, default=None, help="models to train (default: all four)")
    g.add_argument("--modes", nargs="+", choices=list(MODES), default=None,
                   help="modes (default: fp32, then amp_<dtype> and amp_<dtype>_convert for each --dtype)")
    mode = g.add_mutually_exclusive_group()
    mode.add_argument("--no-compile", action="store_true", help="eager only")
    mode.add_argument("--compile-only", action="store_true", help="torch.compile only")
    g.add_argument("--steps", type=int, default=None,
                   help=f"training steps per mode, the second half timed (default {STEPS['full']}, "
                        f"--quick {STEPS['quick']})")


def options(args):
    """run()'s keyword arguments from parsed `ampkernels bench` arguments."""
    compile_modes = (False,) if args.no_compile else (True,) if args.compile_only else (False, True)
    return dict(models=args.models, modes=args.modes, compile_modes=compile_modes, steps=args.steps)


def run(recorder, dtypes, quick, models=None, modes=None, compile_modes=(False, True), steps=None, device=None):
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    size = "tiny" if device == "cpu" else "quick" if quick else "full"
    steps = steps or STEPS[size]
    if device == "cpu":
        print(f"NO GPU: the e2e benchmark runs TINY models on the CPU ({steps} steps, eager only). It checks the\n"
              "machinery end to end; its times and memory say nothing about GPU speed.\n", flush=True)
        modes, compile_modes = modes or CPU_MODES, (False,)
    if not modes:
        tags = {torch.float16: "fp16", torch.bfloat16: "bf16"}
        modes = ["fp32"] + [m for dt in dtypes for m in (f"amp_{tags[dt]}", f"amp_{tags[dt]}_convert")]
    try:
        import transformers
        transformers.logging.set_verbosity_error()  # config warnings, not ours to fix, once per model and mode
    except ImportError:
        pass
    for name in models or MODELS:
        work = guard(recorder, f"e2e {name} build", BUILDERS[name], size, steps)
        if work is None:
            continue
        cases = [(group, compiled) for compiled in compile_modes for group in groups(modes)]
        label = lambda c: " + ".join(c[0]) + (" compile" if c[1] else " eager")  # noqa: E731
        for group, compiled in progress(cases, f"e2e {name} {work.shape}", label):
            train_group(recorder, work, group, compiled, steps, device)
            gc.collect()
            if device == "cuda":
                torch.cuda.empty_cache()


# ---------------------------------------------------------------- reading rows back (report, plot, README table)
def e2e_rows(rows):
    """The e2e rows of `rows`, errors left out."""
    return [r for r in rows if r.get("op") == "e2e" and r.get("provider") != "error"
            and isinstance(r.get("ms"), (int, float))]


def index(rows):
    """{(model, shape): {(mode, compiled): row}}; a later row of one cell replaces an earlier one."""
    by = {}
    for r in e2e_rows(rows):
        by.setdefault((r["model"], r["shape"]), {})[(r["mode"], bool(r["compiled"]))] = r
    return by


def pairs(cells):
    """(dtype tag, base row or None, converted row or None, compiled) for each mode pair with a row."""
    for base in ("fp32", "amp_fp16", "amp_bf16"):
        for compiled in (False, True):
            b, c = cells.get((base, compiled)), cells.get((base + "_convert", compiled))
            if b or c:
                yield base, b, c, compiled


def ratio(num, den, fmt="{:.2f}x"):
    return fmt.format(num / den) if num and den else ""


def report(rows):
    """Per model: a side-by-side table, converted against unconverted in each dtype, eager and
    compiled: speed ratio (unconverted ms / converted ms), peak memory and loss delta."""
    lines = []
    for (model, shape), cells in index(rows).items():
        call = next((r["convert_call"] for r in cells.values() if r.get("convert_call")), None)
        replaced = next((r["converted"] for r in cells.values() if r.get("converted") is not None), None)
        cpu = next(iter(cells.values())).get("device") == "cpu"
        demo = ", CPU demo: tiny model, times mean nothing" if cpu else ""
        lines.append(f"e2e {TITLES.get(model, model)} ({shape}{demo})"
                     + (f"; {call} replaced {replaced} modules" if call else "") + ":")
        lines.append(f"  {'mode':<17} {'base ms':>9} {'convert ms':>10} {'speed':>7} {'host ms base->conv':>19} "
                     f"{'peak GiB base->conv':>21} {'loss base->conv (delta)':>30}")
        for base, b, c, compiled in pairs(cells):
            ms_b, ms_c = (b or {}).get("ms"), (c or {}).get("ms")
            mem_b, mem_c = (b or {}).get("peak_mem_GiB"), (c or {}).get("peak_mem_GiB")
            loss_b, loss_c = (b or {}).get("final_loss"), (c or {}).get("final_loss")
            speed = ratio(ms_b, ms_c)
            host = "->".join(_ms((r or {}).get("host_ms")) for r in (b, c))
            verdict = "" if cpu or not speed else " ok" if ms_b / ms_c >= 1.0 else " SLOWER"
            mem = f"{mem_b}->{mem_c} ({ratio(mem_c, mem_b)})" if mem_b and mem_c else ""
            loss = f"{loss_b}->{loss_c} ({loss_c - loss_b:+.4f})" if loss_b is not None and loss_c is not None else ""
            fp32 = cells.get(("fp32", compiled), {}).get("ms")
            seed = f"  AMP vs FP32 {ratio(fp32, ms_b)}" if base != "fp32" and fp32 and ms_b else ""
            lines.append(f"  {base + (' compile' if compiled else ' eager'):<17} {_ms(ms_b):>9} {_ms(ms_c):>10} "
                         f"{speed:>7} {host:>19} {mem:>21} {loss:>30}{verdict}{seed}")
    return lines


def _ms(v):
    return f"{v:.2f}" if v else "-"


if __name__ == "__main__":
    import sys
    from .run import main
    raise SystemExit(main(["--op", "e2e"] + sys.argv[1:]))
