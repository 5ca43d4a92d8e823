"""The README's results table, generated from e2e rows (ampkernels bench --op e2e).

    python -m ampkernels.bench.readme_table benchmarks/results/RUN.jsonl [...] --readme README.md
    python -m ampkernels.bench.readme_table benchmarks/results/RUN.jsonl      # print it

With --readme, the text between the lines `<!-- results:begin -->` and `<!-- results:end -->`
is replaced by the table (running it twice gives the same README). One line per model and
dtype: FP32 and eager AMP step time (the FP32-vs-AMP speed-up), AMP + convert (its speed-up
over AMP), torch.compile and convert + compile (its speed-up over compile alone), peak
memory and loss of the converted runs against the unconverted ones; then where the numbers
come from (GPU, versions, commit, date) and a link to each results file, as given. Where
several rows fill one cell, the last one given wins.
"""
import argparse
import json
import sys

from .bench_e2e import MODELS, TITLES, index, ratio

BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"
HEADER = ("model", "dtype", "FP32 ms (AMP speed-up)", "eager AMP ms", "+ convert ms (speed-up)", "compile ms",
          "convert + compile ms (vs compile)", "peak memory, convert ÷ AMP (eager / compile)",
          "loss, convert − AMP (eager / compile)")


def load(paths):
    rows = []
    for p in paths:
        with open(p) as f:
            rows += [json.loads(line) for line in f if line.strip()]
    return rows


def _cell(ms, ref=None):
    if not ms:
        return "—"
    return f"{ms:.1f} ({ratio(ref, ms)})" if ref else f"{ms:.1f}"


def _both(eager, compiled):
    return " / ".join(v or "—" for v in (eager, compiled))


def _delta(base, conv):
    if not (base and conv and base.get("final_loss") is not None and conv.get("final_loss") is not None):
        return ""
    return f"{conv['final_loss'] - base['final_loss']:+.4f}"


def _mem(base, conv):
    return ratio((conv or {}).get("peak_mem_GiB"), (base or {}).get("peak_mem_GiB"), "{:.2f}")


def table(rows, paths):
    """The Markdown block: the table, a provenance line, the links."""
    by = index(rows)
    if not by:
        raise ValueError("no e2e rows in " + ", ".join(paths))
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    order = sorted(by, key=lambda k: (MODELS.index(k[0]) if k[0] in MODELS else len(MODELS), k))
    for model, shape in order:
        cells = by[(model, shape)]
        ms = lambda mode, compiled: cells.get((mode, compiled), {}).get("ms")  # noqa: E731
        for tag, dtype in (("fp16", "float16"), ("bf16", "bfloat16")):
            amp, conv = f"amp_{tag}", f"amp_{tag}_convert"
            if not any((m, c) in cells for m in (amp, conv) for c in (False, True)):
                continue
            line = [f"{TITLES.get(model, model)} ({shape})", tag,
                    _cell(ms("fp32", False)) + (f" ({ratio(ms('fp32', False), ms(amp, False))})"
                                                      if ms("fp32", False) and ms(amp, False) else ""),
                    _cell(ms(amp, False)), _cell(ms(conv, False), ms(amp, False)), _cell(ms(amp, True)),
                    _cell(ms(conv, True), ms(amp, True))]
            pair = [(cells.get((amp, c)), cells.get((conv, c))) for c in (False, True)]
            line += [_both(*(_mem(b, v) for b, v in pair)), _both(*(_delta(b, v) for b, v in pair))]
            lines.append("| " + " | ".join(line) + " |")
    e2e = [r for cells in by.values() for r in cells.values()]

    def values(key, fmt=str):
        return ", ".join(sorted({fmt(r.get(key)) for r in e2e}))
    demo = " — a CPU demo of tiny models: the times mean nothing" if values("gpu") == "cpu" else ""
    lines += ["", f"Training step (forward, backward, fused AdamW), median ms; speed-up = the unconverted "
                  f"mode's ms ÷ this one's. Measured on {values('gpu')}, torch {values('torch')}, "
                  f"triton {values('triton')}, commit {values('commit')}, {values('time', lambda t: str(t)[:10])}"
                  f"{demo}.",
              "Rows: " + ", ".join(f"[{p.replace(chr(92), '/').rsplit('/', 1)[-1]}]({p})" for p in paths) + "."]
    return "\n".join(lines)


def replace_block(text, block):
    """text with what lies between BEGIN and END replaced by block."""
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise ValueError(f"the README needs the lines {BEGIN} and {END} (in that order)")
    return text[:start + len(BEGIN)] + "\n" + block + "\n" + text[end:]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results", nargs="+", help="results.jsonl files of e2e runs (linked as given)")
    p.add_argument("--readme", default=None, help="README to update in place (else print the table)")
    args = p.parse_args(argv)
    try:
        block = table(load(args.results), args.results)
        if args.readme is None:
            print(block)
            return 0
        with open(args.readme) as f:
            text = f.read()
        new = replace_block(text, block)
    except ValueError as e:
        print(f"readme_table: {e}", file=sys.stderr)
        return 1
    if new != text:
        with open(args.readme, "w") as f:
            f.write(new)
    print(f"{args.readme}: results table {'updated' if new != text else 'already up to date'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
