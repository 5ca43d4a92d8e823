"""Plots from benchmark rows (results.jsonl): one PNG per op, ceilings drawn.

    python -m benchmarks.plot benchmarks/results/h200.jsonl benchmarks/results/

- norms (metric TB/s): bandwidth vs N per provider, one panel per (pass, dtype), with the
  copy bandwidth measured in the same run as a dashed line;
- linear_act (metric TFLOP/s): throughput per shape and provider, one panel per (pass, dtype),
  with the plain matmul as the reference line;
- mlp_block / e2e_gpt2 (metric ms): step time per provider.
"""
import collections
import json
import os
import sys


def load(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _is_copy(r):
    return "copy" in str(r.get("provider", "")) or r.get("op") == "copy"


def _panels(rows):
    panels = collections.defaultdict(list)
    for r in rows:
        panels[(r.get("pass"), r.get("dtype"))].append(r)
    return dict(sorted(panels.items(), key=lambda kv: str(kv[0])))


def _grid(plt, count, title):
    cols = min(count, 2)
    rows = (count + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(7 * cols, 4.2 * rows), squeeze=False)
    fig.suptitle(title)
    return fig, [ax for line in axes for ax in line]


def _env_line(rows):
    r = rows[0]
    return f"{r.get('gpu')} | torch {r.get('torch')} | triton {r.get('triton')}"


def _commits(rows):
    return ",".join(sorted({str(r.get("commit")) for r in rows}))


def plot_norm(plt, op, rows, ceiling, path):
    panels = _panels([r for r in rows if not _is_copy(r)])
    fig, axes = _grid(plt, len(panels), f"{op}: effective bandwidth ({_env_line(rows)})")
    # one colour per provider across the panels, so a line keeps its colour from fwd to bwd
    names = sorted({r["provider"] for r in rows if not _is_copy(r)})
    colour = {name: f"C{i % 10}" for i, name in enumerate(names)}
    for ax, ((pss, dtype), prs) in zip(axes, panels.items()):
        by = collections.defaultdict(list)
        for r in prs:
            by[r["provider"]].append((r["N"], r["value"]))
        for provider, pts in sorted(by.items()):
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=provider, color=colour[provider],
                    ls="--" if provider.endswith("autocast") else "-")
        if ceiling:
            ax.axhline(ceiling, ls="--", color="k", label=f"copy {ceiling:.2f} TB/s")
        ax.set_xscale("log", base=2)
        ax.set(title=f"{pss} {dtype} (commit {_commits(prs)})", xlabel="N (hidden size)", ylabel="TB/s")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_linear(plt, rows, path):
    panels = _panels(rows)
    fig, axes = _grid(plt, len(panels), f"linear_act: TFLOP/s ({_env_line(rows)})")
    for ax, ((pss, dtype), prs) in zip(axes, panels.items()):
        shapes = sorted({(r["M"], r["K"], r["N"]) for r in prs})
        providers = sorted({(r["provider"], r.get("activation")) for r in prs}, key=str)
        width = 0.8 / max(len(providers), 1)
        for i, (provider, act) in enumerate(providers):
            vals = [next((r["value"] for r in prs if (r["M"], r["K"], r["N"]) == s and r["provider"] == provider
                          and r.get("activation") == act), 0) for s in shapes]
            label = provider if act in (None, "identity", "none") else f"{provider} {act}"
            kw = {"color": "k", "alpha": 0.35} if "matmul" in provider else {}
            ax.bar([j + i * width for j in range(len(shapes))], vals, width, label=label, **kw)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(shapes))], [f"{m}x{k}x{n}" for m, k, n in shapes],
                      fontsize=7)
        ax.set(title=f"{pss} {dtype} (commit {_commits(prs)})", ylabel="TFLOP/s")
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_steps(plt, op, rows, path):
    shapes = sorted({r.get("shape") for r in rows}, key=str)
    fig, axes = _grid(plt, len(shapes), f"{op}: time per training step ({_env_line(rows)})")
    for ax, shape in zip(axes, shapes):
        prs = [r for r in rows if r.get("shape") == shape]
        ax.barh([r["provider"] for r in prs], [r["ms"] for r in prs])
        for i, r in enumerate(prs):
            mem = r.get("peak_extra_MiB", r.get("peak_mem_GiB"))
            ax.text(r["ms"], i, f" {r['ms']:.2f} ms, mem {mem}", va="center", fontsize=7)
        ax.set(title=f"{shape} (commit {_commits(prs)})", xlabel="ms per step (lower is better)")
        ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_all(jsonl, out_dir):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in load(jsonl) if isinstance(r.get("value"), (int, float)) and r.get("provider") != "error"]
    os.makedirs(out_dir, exist_ok=True)
    written = []
    copies = [r["value"] for r in rows if _is_copy(r) and r.get("metric") == "TB/s"]
    ceiling = max(copies) if copies else None
    for op in ("layer_norm", "rms_norm"):
        op_rows = [r for r in rows if r.get("op") == op and r.get("metric") == "TB/s" and "N" in r]
        if op_rows:
            written.append(os.path.join(out_dir, f"{op}.png"))
            plot_norm(plt, op, op_rows, ceiling, written[-1])
    lin = [r for r in rows if r.get("op") == "linear_act" and r.get("metric") == "TFLOP/s"]
    if lin:
        written.append(os.path.join(out_dir, "linear_act.png"))
        plot_linear(plt, lin, written[-1])
    for op in ("mlp_block", "e2e_gpt2"):
        op_rows = [r for r in rows if r.get("op") == op and "ms" in r]
        if op_rows:
            written.append(os.path.join(out_dir, f"{op}.png"))
            plot_steps(plt, op, op_rows, written[-1])
    for p in written:
        print("wrote", p)
    return written


if __name__ == "__main__":
    plot_all(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else os.path.dirname(sys.argv[1]) or ".")
