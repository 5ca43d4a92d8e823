"""Plots from benchmark rows (results.jsonl): one PNG per op, ceilings drawn.

    python -m ampkernels.bench.plot benchmarks/results/h200.jsonl benchmarks/results/

- norms (metric TB/s): bandwidth vs N per provider, one panel per (pass, dtype), with the
  copy bandwidth measured in the same run as a dashed line;
- linear_act (metric TFLOP/s): throughput per shape and provider, one panel per (pass, dtype),
  with the plain matmul as the reference line;
- mlp_block (metric ms): step time per provider;
- e2e (the four models): e2e.png, one panel per model, ms per step for each mode, eager and
  torch.compile side by side.
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


# providers in the order their bars stand, the baselines first; others (public kernels) after
_LINEAR_ORDER = ("eager", "compile", "addmm_act", "ampkernels-cuda", "ampkernels-triton", "ampkernels-triton-ptr")


def plot_linear(plt, rows, path):
    """One panel per (activation, pass, dtype): TFLOP/s per shape, one bar per provider (one
    colour each across the panels, one legend), the plain matmul as a black line over each shape."""
    acts = sorted({r.get("activation") for r in rows} - {None, "none", "identity"})
    cols = sorted({(r["pass"], r["dtype"]) for r in rows})
    names = {r["provider"] for r in rows} - {"matmul"}
    providers = [p for p in _LINEAR_ORDER if p in names] + sorted(names - set(_LINEAR_ORDER))
    colour = {p: f"C{i % 10}" for i, p in enumerate(providers)}
    value = {(r["provider"], r.get("activation"), r["pass"], r["dtype"], (r["M"], r["K"], r["N"])): r["value"]
             for r in rows}
    fig, axes = plt.subplots(len(acts), len(cols), figsize=(4.4 * len(cols), 2.9 * len(acts) + 1), squeeze=False,
                             sharey=True)
    fig.suptitle(f"linear_act: TFLOP/s per shape (M x K x N), black line: plain matmul ({_env_line(rows)}, "
                 f"commit {_commits(rows)})")
    handles = {}
    for ax_row, act in zip(axes, acts):
        for ax, (pss, dtype) in zip(ax_row, cols):
            shapes = sorted({(r["M"], r["K"], r["N"]) for r in rows if r["pass"] == pss and r["dtype"] == dtype})
            here = [p for p in providers if any((p, act, pss, dtype, s) in value for s in shapes)]
            width = 0.8 / max(len(here), 1)
            for i, p in enumerate(here):
                bars = ax.bar([x + i * width for x in range(len(shapes))],
                              [value.get((p, act, pss, dtype, s), 0) for s in shapes], width, color=colour[p])
                handles.setdefault(p, bars)
            for x, s in enumerate(shapes):
                mm = value.get(("matmul", "none", pss, dtype, s))
                if mm:
                    handles.setdefault("plain matmul", ax.hlines(mm, x - width / 2, x + 0.8 - width / 2, colors="k"))
            ax.set_xticks([x + 0.4 - width / 2 for x in range(len(shapes))], [f"{m}x{k}x{n}" for m, k, n in shapes],
                          fontsize=6)
            ax.set_title(f"{act} {pss} {dtype}", fontsize=9)
            ax.grid(alpha=0.3, axis="y")
    for ax_row in axes:
        ax_row[0].set_ylabel("TFLOP/s")
    order = [p for p in providers if p in handles] + [p for p in ("plain matmul",) if p in handles]
    fig.legend([handles[p] for p in order], order, loc="lower center", ncol=min(len(order), 8), fontsize=8)
    fig.tight_layout(rect=(0, 0.04, 1, 0.97))
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


def plot_e2e(plt, rows, path):
    """One panel per (model, shape): a group of bars per mode (FP32, AMP, AMP + convert in each
    dtype), eager and compiled side by side, ms per step written over each bar."""
    from .bench_e2e import MODES, TITLES, index

    models = index(rows)
    demo = ", CPU demo: tiny models, times mean nothing" if rows[0].get("device") == "cpu" else ""
    fig, axes = _grid(plt, len(models), f"e2e: ms per training step, lower is better ({_env_line(rows)}{demo})")
    for ax, ((model, shape), cells) in zip(axes, models.items()):
        modes = [m for m in MODES if any((m, c) in cells for c in (False, True))]
        for j, (compiled, label) in enumerate(((False, "eager"), (True, "torch.compile"))):
            xs = [i + (j - 0.5) * 0.4 for i in range(len(modes))]
            ms = [cells[(m, compiled)]["ms"] if (m, compiled) in cells else 0 for m in modes]
            bars = ax.bar(xs, ms, 0.4, label=label, color=f"C{j}")
            for bar, v in zip(bars, ms):
                if v:
                    ax.text(bar.get_x() + bar.get_width() / 2, v, f"{v:.1f}", ha="center", va="bottom", fontsize=6)
        ax.set_xticks(range(len(modes)), [m.replace("_convert", "\n+convert") for m in modes], fontsize=7)
        ax.set(title=f"{TITLES.get(model, model)} {shape} (commit {_commits(list(cells.values()))})",
               ylabel="ms / step")
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=7)
    for ax in axes[len(models):]:
        ax.set_visible(False)
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
    op_rows = [r for r in rows if r.get("op") == "mlp_block" and "ms" in r]
    if op_rows:
        written.append(os.path.join(out_dir, "mlp_block.png"))
        plot_steps(plt, "mlp_block", op_rows, written[-1])
    if any(r.get("op") == "e2e" for r in rows):
        written.append(os.path.join(out_dir, "e2e.png"))
        plot_e2e(plt, [r for r in rows if r.get("op") == "e2e"], written[-1])
    for p in written:
        print("wrote", p)
    return written


if __name__ == "__main__":
    plot_all(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else os.path.dirname(sys.argv[1]) or ".")
