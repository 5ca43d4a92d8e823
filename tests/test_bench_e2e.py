"""The e2e benchmark's machinery on the CPU (tiny models), the host-time benchmark's CPU demo,
the e2e plot and the README-table generator. Numbers here mean nothing for GPU speed."""
import argparse
import json
import os
import sys

import pytest
import torch

from ampkernels.bench import bench_e2e, bench_host, readme_table
from ampkernels.bench.common import Recorder

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
H200 = os.path.join(ROOT, "benchmarks", "results", "h200-2026-12-04-bb091ed-e2e.jsonl")


@pytest.fixture(scope="module")
def e2e_run(tmp_path_factory):
    """The tiny CPU e2e over all four models, as `ampkernels bench --op e2e` runs it without a GPU."""
    out = tmp_path_factory.mktemp("e2e")
    if torch.cuda.is_available():
        rec = Recorder(str(out))
        bench_e2e.run(rec, [torch.bfloat16], quick=True, device="cpu")
    else:
        from ampkernels.bench.run import main
        assert main(["--op", "e2e", "--quick", "--out", str(out)]) == 0
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    return out, rows


def test_e2e_rows_have_every_field(e2e_run):
    _, rows = e2e_run
    assert not [r for r in rows if r["provider"] == "error"], rows
    assert {(r["model"], r["mode"]) for r in rows} == {(m, mode) for m in bench_e2e.MODELS
                                                      for mode in bench_e2e.CPU_MODES}
    for r in rows:
        assert set(bench_e2e.ROW_FIELDS) <= set(r), set(bench_e2e.ROW_FIELDS) - set(r)
        assert r["op"] == "e2e" and r["device"] == "cpu" and r["compiled"] is False and "CPU" in r["metric"]
        assert r["ms"] > 0 and r["steps"] == 3 and r["timed_steps"] == 2 and r["first_step_s"] > 0
        assert r["peak_mem_GiB"] is None  # no allocator statistics on the CPU
        assert r[("images" if r["model"] == "vit" else "tokens") + "_per_s"] > 0
        assert r["gpu"] == "cpu" and r["commit"] and r["torch"] == torch.__version__
        if r["mode"].endswith("_convert"):
            assert r["convert_call"].startswith("ampkernels.integrations.") and r["converted"] > 0
            assert r["fused_loss"] == (r["model"] in ("gpt2", "llama", "bert"))  # the LMs' head + loss
        else:
            assert r["converted"] is None and r["convert_call"] is None and r["fused_loss"] is None
    calls = {r["model"]: r["convert_call"] for r in rows if r["convert_call"]}
    assert calls["bert"] == "ampkernels.integrations.transformers.apply(model)"
    assert calls["gpt2"] == "ampkernels.integrations.transformers.apply(model, norm_out_dtype='autocast')"


def test_e2e_converted_losses_match(e2e_run):
    _, rows = e2e_run
    loss = {(r["model"], r["mode"]): r["final_loss"] for r in rows}
    for m in bench_e2e.MODELS:
        assert loss[(m, "fp32_convert")] == pytest.approx(loss[(m, "fp32")], abs=1e-3), m
        assert loss[(m, "amp_bf16_convert")] == pytest.approx(loss[(m, "amp_bf16")], abs=2e-2), m


def test_e2e_report_is_a_table_per_model(e2e_run):
    out, rows = e2e_run
    lines = bench_e2e.report(rows)
    heads = [line for line in lines if line.startswith("e2e ")]
    assert len(heads) == 4 and all("CPU demo" in h for h in heads)
    assert any("apply(model) replaced" in h for h in heads if h.startswith("e2e BERT"))
    assert sum(line.strip().startswith("fp32 eager") for line in lines) == 4
    assert sum(line.strip().startswith("amp_bf16 eager") and "AMP vs FP32" in line for line in lines) == 4
    if not torch.cuda.is_available():  # the CLI wrote the same lines into report.txt
        assert "e2e GPT-2 small" in (out / "report.txt").read_text()


def test_e2e_vit_without_timm(monkeypatch):
    monkeypatch.setitem(sys.modules, "timm", None)  # import timm raises ImportError
    work = bench_e2e.build_vit("tiny", 2)
    assert type(work.model).__name__ == "ViTForImageClassification" and "timm not importable" in work.library
    rec = Recorder(None)
    [row] = bench_e2e.train_group(rec, work, ["fp32"], False, 2, "cpu")
    assert row["model"] == "vit" and row["images_per_s"] > 0 and row["final_loss"] > 0


def test_e2e_groups_pair_each_mode_with_its_converted_one():
    assert bench_e2e.groups(["fp32", "amp_bf16", "amp_bf16_convert", "amp_fp16_convert", "amp_fp16"]) == \
        [["fp32"], ["amp_bf16", "amp_bf16_convert"], ["amp_fp16", "amp_fp16_convert"]]
    assert bench_e2e.groups(["amp_bf16_convert"]) == [["amp_bf16_convert"]]


def test_e2e_timed_steps_take_turns(monkeypatch):
    # untimed steps mode after mode, then bursts in alternating order; a mode that fails to
    # start leaves an error row and the rest of its group runs
    calls = []

    class FakeRun:
        def __init__(self, work, mode, compiled, device):
            if mode == "fp32_convert":
                raise RuntimeError("no")
            self.mode = mode

        def run(self, n, timed):
            calls.append((self.mode, n, timed))

    monkeypatch.setattr(bench_e2e, "_Run", FakeRun)
    monkeypatch.setattr(bench_e2e, "_row", lambda rec, work, r, steps: r.mode)
    rec = Recorder(None)
    work = argparse.Namespace(name="m")
    assert bench_e2e.train_group(rec, work, ["amp_bf16", "amp_bf16_convert"], False, 20, "cpu") == \
        ["amp_bf16", "amp_bf16_convert"]
    a, b = "amp_bf16", "amp_bf16_convert"
    assert calls == [(a, 10, False), (b, 10, False), (a, 3, True), (b, 3, True), (b, 3, True), (a, 3, True),
                     (a, 3, True), (b, 3, True), (b, 1, True), (a, 1, True)]
    assert bench_e2e.train_group(rec, work, ["fp32", "fp32_convert"], False, 4, "cpu") == ["fp32"]
    assert [r["op"] for r in rec.rows] == ["e2e m fp32_convert eager"] and "no" in rec.rows[0]["value"]


def test_compiled_groups_run_without_the_aot_autograd_cache(monkeypatch):
    # torch 2.11 keys its AOTAutograd cache without the ambient autocast dtype: a compiled bf16
    # group must not be served the graph of the fp16 group before it (pytorch#181564)
    import torch._functorch.config as functorch_config
    seen = []
    monkeypatch.setattr(bench_e2e, "_train_group",
                        lambda *a: seen.append((a[3], functorch_config.enable_autograd_cache)) or [])
    before = functorch_config.enable_autograd_cache
    for compiled in (True, False):
        bench_e2e.train_group(Recorder(None), argparse.Namespace(name="m"), ["amp_bf16"], compiled, 2, "cpu")
    assert seen == [(True, False), (False, before)] and functorch_config.enable_autograd_cache == before


def test_e2e_slicing_options():
    p = argparse.ArgumentParser()
    bench_e2e.add_arguments(p)
    opts = bench_e2e.options(p.parse_args(["--models", "gpt2", "bert", "--compile-only", "--steps", "6",
                                           "--modes", "amp_bf16", "amp_bf16_convert"]))
    assert opts == dict(models=["gpt2", "bert"], modes=["amp_bf16", "amp_bf16_convert"], compile_modes=(True,),
                        steps=6)
    assert bench_e2e.options(p.parse_args(["--no-compile"]))["compile_modes"] == (False,)
    assert bench_e2e.options(p.parse_args([]))["compile_modes"] == (False, True)
    with pytest.raises(SystemExit):
        p.parse_args(["--no-compile", "--compile-only"])


def _with_compiled_rows(rows):
    """The CPU rows plus made-up compiled ones and a peak memory, to fill every column."""
    out = []
    for r in rows:
        out += [{**r, "peak_mem_GiB": 2.0 if r["mode"].endswith("convert") else 2.5},
                {**r, "compiled": True, "ms": r["ms"] / 2, "peak_mem_GiB": 1.0}]
    return out


def test_readme_table(e2e_run, tmp_path, capsys):
    _, rows = e2e_run
    path = tmp_path / "run.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in _with_compiled_rows(rows)))
    block = readme_table.table(readme_table.load([str(path), H200]), [str(path), "benchmarks/results/x.jsonl"])
    lines = block.splitlines()
    assert lines[0].startswith("| model | dtype | FP32 ms (AMP speed-up) | eager AMP ms |")
    body = [line for line in lines[2:] if line.startswith("| ")]
    # models in their order, a model's shapes sorted: each H200 row before the tiny CPU one
    assert [(line[2:].split(" (")[0], line.split(" | ")[1]) for line in body] == \
        [(m, dt) for m in ("GPT-2 small", "LLaMA-style", "BERT-base MLM", "ViT-B/16")
         for dt in ("fp16", "bf16", "bf16")]
    assert any(line.startswith("| GPT-2 small (L=12,H=768,B=8,S=1024) | bf16 | 171.6 (3.00x) | 57.3 | 28.7 (1.99x) | "
                               "23.8 | 22.8 (1.04x) | 0.38 / 0.69 | +0.0007 / +0.0001 |") for line in body), body
    vit = next(line for line in body if line.startswith("| ViT-B/16 (L=2"))
    cells = vit.strip("| ").split(" | ")
    assert cells[7] == "0.80 / 1.00" and cells[6].endswith("x)") and cells[8].count("/") == 1
    commits = block.split("commit ", 1)[1].split(", 2026")[0].split(", ")
    assert "NVIDIA H200, cpu" in block and "bb091ed" in commits
    assert "[x.jsonl](benchmarks/results/x.jsonl)" in block

    readme = tmp_path / "README.md"
    readme.write_text("# title\n\nbefore\n<!-- results:begin -->\nold table\n<!-- results:end -->\nafter\n")
    assert readme_table.main([str(path), "--readme", str(readme)]) == 0
    once = readme.read_text()
    assert "old table" not in once and once.startswith("# title\n\nbefore\n<!-- results:begin -->\n| model |")
    assert once.endswith("\n<!-- results:end -->\nafter\n") and f"]({path})" in once
    assert readme_table.main([str(path), "--readme", str(readme)]) == 0
    assert readme.read_text() == once  # idempotent
    capsys.readouterr()
    assert readme_table.main([str(path)]) == 0  # no --readme: printed
    assert capsys.readouterr().out.strip() == readme_table.table(readme_table.load([str(path)]), [str(path)])
    readme.write_text("no markers\n")
    assert readme_table.main([str(path), "--readme", str(readme)]) == 1 and readme.read_text() == "no markers\n"


def test_e2e_plot(e2e_run, tmp_path):
    pytest.importorskip("matplotlib")
    from ampkernels.bench import plot
    _, rows = e2e_run
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in _with_compiled_rows(rows)))
    assert plot.plot_all(str(path), str(tmp_path)) == [str(tmp_path / "e2e.png")]
    assert (tmp_path / "e2e.png").stat().st_size > 10_000


def test_host_cpu_demo(capsys):
    rec = Recorder(None)
    bench_host.run(rec, [torch.bfloat16], quick=True, device="cpu")
    assert "NO GPU" in capsys.readouterr().out
    assert not [r for r in rec.rows if r["provider"] == "error"], rec.rows
    got = {(r["case"], r["pass"], r["provider"]) for r in rec.rows}
    assert got == {(c, p, prov) for c in bench_host.CASES for p in ("fwd", "bwd")
                   for prov in ("torch", "ampkernels-torch")}
    assert all(r["host_us"] > 0 and r["metric"] == "host us (CPU demo)" for r in rec.rows)
    lines = bench_host.report(rec.rows)
    assert len(lines) == 3 * len(bench_host.CASES)
    assert sum(" fwd+bwd " in line for line in lines) == len(bench_host.CASES)
    assert all("(CPU demo): torch " in line and ("AT OR BELOW" in line or "ABOVE" in line) for line in lines)
