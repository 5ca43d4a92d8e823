"""Train a causal LM (GPT-2 or LLaMA from transformers, built from a config) on synthetic tokens
with AMP, with ampkernels converting the model in one line, and print step time, tokens/s and
peak memory.

    python examples/train_causal_lm.py --model gpt2 --dtype bf16           # one GPU
    python examples/train_causal_lm.py --model llama --dtype fp16 --compile
    python examples/train_causal_lm.py --model gpt2 --no-ampkernels        # the same run, unconverted
    torchrun --nproc_per_node 8 examples/train_causal_lm.py --model llama  # DDP (nccl; gloo on CPU)
    python examples/train_causal_lm.py --tiny --device cpu --steps 5       # seconds, on CPU

fp16 uses a GradScaler; bf16 does not need one. The data is random tokens (the loss falls only
as the model learns their unigram statistics): the point is the cost of a step, and that
converted and unconverted runs from the same seed give the same losses.
"""
import argparse
import contextlib
import gc
import json
import os
import resource
import time

import torch
import torch.distributed as dist

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", choices=("gpt2", "llama"), default="gpt2")
    p.add_argument("--tiny", action="store_true", help="a 2-layer, 64-wide model and short sequences (CPU: seconds)")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="bf16", help="autocast dtype (fp32: no autocast)")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--warmup", type=int, default=None, help="steps left out of the timing (default: steps // 5)")
    p.add_argument("--batch-size", type=int, default=None, help="per process (default 8; tiny: 4)")
    p.add_argument("--seq-len", type=int, default=None, help="default 1024; tiny: 32")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compile", action="store_true", help="torch.compile the model (after converting it)")
    p.add_argument("--no-ampkernels", action="store_true", help="leave the model unconverted, to compare")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--json", default=None, help="write a summary (losses, times, memory) to this file (rank 0)")
    return p.parse_args(argv)


def build_model(name, tiny):
    import transformers
    if name == "gpt2":
        size = dict(n_embd=64, n_layer=2, n_head=4) if tiny else dict(n_embd=768, n_layer=12, n_head=12)
        cfg = transformers.GPT2Config(vocab_size=256 if tiny else 50257, n_positions=1024, resid_pdrop=0.0,
                                      embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, **size)
        return transformers.GPT2LMHeadModel(cfg)
    size = dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2) if tiny else \
        dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=12, num_attention_heads=16,
             num_key_value_heads=16)
    cfg = transformers.LlamaConfig(vocab_size=256 if tiny else 32000, max_position_embeddings=1024,
                                   bos_token_id=0, eos_token_id=0, **size)
    return transformers.LlamaForCausalLM(cfg)


def setup_distributed(device_arg):
    """(rank, world size, device): from torchrun's environment when WORLD_SIZE > 1."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    use_cuda = torch.cuda.is_available() if device_arg is None else device_arg.startswith("cuda")
    if world == 1:
        return 0, 1, torch.device(device_arg or ("cuda" if use_cuda else "cpu"))
    local = int(os.environ["LOCAL_RANK"])
    if use_cuda:
        torch.cuda.set_device(local)
    dist.init_process_group("nccl" if use_cuda else "gloo")
    return dist.get_rank(), world, torch.device(f"cuda:{local}" if use_cuda else "cpu")


def peak_memory_gib(device):
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # the process's peak RSS (KiB on Linux)


def main(argv=None):
    args = parse_args(argv)
    rank, world, device = setup_distributed(args.device)
    summary = train(args, rank, world, device)
    if world > 1:
        # every rank past its last collective, and its DDP model (whose reducer holds the group's
        # work objects) freed with train's frame, before any rank tears the group down: a rank
        # aborted in gloo's teardown ("terminate called without an active exception") after
        # complete 2-process runs
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()
    return summary


def train(args, rank, world, device):
    """The training loop; returns the run's summary (written to --json by rank 0)."""
    say = print if rank == 0 else (lambda *a, **k: None)
    batch = args.batch_size or (4 if args.tiny else 8)
    seq = args.seq_len or (32 if args.tiny else 1024)
    warmup = args.steps // 5 if args.warmup is None else args.warmup
    amp_dtype = DTYPES[args.dtype]
    if amp_dtype is torch.float16 and device.type == "cpu":
        say("note: fp16 autocast on CPU is slow and rarely what you want; bf16 is the CPU choice")

    torch.manual_seed(args.seed)  # the same initial weights on every rank and with or without ampkernels
    model = build_model(args.model, args.tiny).to(device).train()
    vocab = model.config.vocab_size
    if not args.no_ampkernels:
        from ampkernels.integrations import transformers as ak_hf
        report = ak_hf.apply(model)
        say(report)
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, fused=device.type == "cuda")
    if world > 1:
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda"
                                                          else None)
    if args.compile:
        model = torch.compile(model)
    scaler = torch.amp.GradScaler(device.type, enabled=amp_dtype is torch.float16)
    autocast = (lambda: torch.autocast(device.type, dtype=amp_dtype)) if amp_dtype else contextlib.nullcontext
    gen = torch.Generator().manual_seed(args.seed * 1000 + rank)  # each rank its own batches
    say(f"{args.model}{' (tiny)' if args.tiny else ''}: {n_params / 1e6:.2f} M parameters, {world} process(es) "
        f"on {device}, {args.dtype}{' + compile' if args.compile else ''}, "
        f"{'unconverted' if args.no_ampkernels else 'ampkernels'}; {batch} x {seq} tokens per process per step")

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    losses, times = [], []
    for step in range(args.steps):
        ids = torch.randint(0, vocab, (batch, seq), generator=gen).to(device, non_blocking=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        with autocast():
            loss = model(input_ids=ids, labels=ids).loss
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        value = loss.detach()
        if world > 1:
            dist.all_reduce(value, op=dist.ReduceOp.AVG if device.type == "cuda" else dist.ReduceOp.SUM)
            value = value if device.type == "cuda" else value / world  # gloo has no AVG
        value = value.item()  # synchronises: the step is done
        times.append(time.perf_counter() - t0)
        losses.append(value)
        if step % args.log_every == 0 or step == args.steps - 1:
            say(f"step {step:4d}  loss {value:.4f}  {times[-1] * 1e3:8.1f} ms  "
                f"{batch * seq * world / times[-1]:10.0f} tokens/s")

    timed = times[warmup:] or times
    step_s = sorted(timed)[len(timed) // 2]
    summary = {"model": args.model, "tiny": args.tiny, "dtype": args.dtype, "compile": args.compile,
               "ampkernels": not args.no_ampkernels, "world_size": world, "device": str(device),
               "steps": args.steps, "timed_steps": len(timed), "median_step_ms": step_s * 1e3,
               "tokens_per_s": batch * seq * world / step_s, "peak_memory_GiB": peak_memory_gib(device),
               "peak_memory_kind": "max_memory_allocated" if device.type == "cuda" else "process peak RSS",
               "losses": losses}
    say(f"median step {summary['median_step_ms']:.1f} ms over {len(timed)} steps, "
        f"{summary['tokens_per_s']:.0f} tokens/s, peak memory {summary['peak_memory_GiB']:.2f} GiB "
        f"({summary['peak_memory_kind']}, rank 0), final loss {losses[-1]:.4f}")
    if args.json and rank == 0:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    return summary


if __name__ == "__main__":
    main()
