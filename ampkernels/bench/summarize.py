"""Markdown tables from benchmark rows, for README (claims point at these rows).

    python -m ampkernels.bench.summarize benchmarks/results/*.jsonl
"""
import collections
import json
import sys


def _load(paths):
    rows = []
    for p in paths:
        with open(p) as f:
            rows += [json.loads(line) for line in f if line.strip()]
    return [r for r in rows if r.get("provider") != "error" and isinstance(r.get("value"), (int, float))]


def _table(header, lines):
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(str(c) for c in line) + " |" for line in lines]
    return "\n".join(out)


def norms(rows):
    """TB/s per N for each provider, one table per (op, pass, dtype)."""
    out = []
    copy = {(r["dtype"], r["N"]): r["value"] for r in rows if r.get("op") == "copy"}
    groups = collections.defaultdict(dict)
    for r in rows:
        if r.get("op") in ("layer_norm", "rms_norm") and r.get("metric") == "TB/s":
            groups[(r["op"], r["pass"], r["dtype"])][(r["provider"], r["N"])] = r["value"]
    for (op, pss, dtype), vals in sorted(groups.items()):
        providers = sorted({p for p, _ in vals}, key=lambda p: (p.startswith("ampkernels"), p))
        ns = sorted({n for _, n in vals})
        lines = [[n, copy.get((dtype, n), "")] + [vals.get((p, n), "") for p in providers] for n in ns]
        out.append(f"**{op} {pss}, {dtype}** (TB/s; {commits(rows, op)})\n\n" + _table(["N", "copy"] + providers, lines))
    return out


def linear(rows):
    """Best ampkernels backend as a fraction of plain matmul, per shape and activation."""
    out = []
    lin = [r for r in rows if r.get("op") == "linear_act" and r.get("metric") == "TFLOP/s"]
    groups = collections.defaultdict(dict)
    for r in lin:
        groups[(r["pass"], r["dtype"])][(r["provider"], r.get("activation"), (r["M"], r["K"], r["N"]))] = r["value"]
    for (pss, dtype), vals in sorted(groups.items()):
        shapes = sorted({s for _, _, s in vals})
        acts = sorted({a for _, a, _ in vals if a not in (None, "none")})
        lines = []
        for a in acts:
            cells = []
            for s in shapes:
                mm = vals.get(("matmul", "none", s))
                ours = max((v for (p, aa, ss), v in vals.items() if p.startswith("ampkernels") and aa == a and ss == s
                            and "recompute" not in p and "ptr" not in p), default=None)
                eager = vals.get(("eager", a, s))
                cells.append(f"{ours / mm:.2f} ({ours / eager:.2f}x eager)" if mm and ours and eager else "")
            lines.append([a] + cells)
        out.append(f"**linear_act {pss}, {dtype}**: best ampkernels backend / plain matmul "
                   f"({commits(rows, 'linear_act')})\n\n" + _table(["activation"] + ["x".join(map(str, s)) for s in shapes],
                                                                  lines))
    return out


def steps(rows, op):
    prs = [r for r in rows if r.get("op") == op]
    if not prs:
        return []
    lines = []
    for shape in sorted({r["shape"] for r in prs}):
        base = {r["dtype"]: r["ms"] for r in prs if r["shape"] == shape and r["provider"].startswith("amp_")
                and r["provider"].count("_") == 1}
        for r in (r for r in prs if r["shape"] == shape):
            ref = base.get(r["dtype"])
            lines.append([shape, r["provider"], f"{r['ms']:.3f}", f"{ref / r['ms']:.2f}x" if ref else "",
                          r.get("peak_extra_MiB")])
    return [f"**{op}** (ms per training step; speed-up vs eager AMP of the same dtype; {commits(rows, op)})\n\n" +
            _table(["shape", "provider", "ms", "vs eager AMP", "peak extra MiB"], lines)]


def commits(rows, op):
    rs = [r for r in rows if r.get("op") == op]
    return f"{rs[0]['gpu']}, torch {rs[0]['torch']}, triton {rs[0]['triton']}, commit " + \
        ",".join(sorted({r["commit"] for r in rs})) if rs else ""


def main(paths):
    rows = _load(paths)
    print("\n\n".join(norms(rows) + linear(rows) + steps(rows, "mlp_block")))


if __name__ == "__main__":
    main(sys.argv[1:])
