"""`ampkernels doctor` and `ampkernels bench` as a user runs them."""
import csv
import json
import os
import subprocess
import sys
import types

import pytest
import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_cli(*args, timeout=600):
    env = {**os.environ, "PYTHONPATH": ROOT}
    return subprocess.run([sys.executable, "-m", "ampkernels", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env=env, check=False)


def test_doctor_json():
    proc = run_cli("doctor", "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert set(report["backends"]) == {"cuda", "triton", "torch"}
    assert report["versions"]["torch"] == torch.__version__
    assert report["verdict"]
    if not torch.cuda.is_available():
        assert report["gpu"] is None and report["verdict"].startswith("NO GPU")
        assert report["smoke"]["ok"] is None
    else:
        assert report["smoke"]["ok"] is True, report["smoke"]


def test_doctor_text_has_a_verdict():
    proc = run_cli("doctor")
    assert proc.returncode == 0, proc.stderr
    assert "verdict" in proc.stdout and "backend       torch" in proc.stdout


def test_version():
    import ampkernels
    proc = run_cli("--version")
    assert proc.returncode == 0 and proc.stdout.strip() == f"ampkernels {ampkernels.__version__}", proc.stderr


def test_help_and_unknown_command():
    assert run_cli("--help").returncode == 0
    proc = run_cli("frobnicate")
    assert proc.returncode == 2 and "unknown command 'frobnicate'" in proc.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU demo runs only without a GPU")
def test_bench_cpu_demo(tmp_path):
    proc = run_cli("bench", "--quick", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "NO GPU" in proc.stdout and "match the float64 reference" in proc.stdout
    assert "public providers: " in proc.stdout  # whatever discovery found (in CI: none), the demo ran
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert {r["op"] for r in rows} == {"layer_norm", "rms_norm", "linear_act", "linear_cross_entropy"}
    assert all(r["gpu"] == "cpu" and r["value"] > 0 for r in rows)
    with open(tmp_path / "results.csv", newline="") as f:  # the same rows as CSV, fixed columns first
        table = list(csv.DictReader(f))
    assert [(t["op"], t["provider"], float(t["value"])) for t in table] == \
        [(r["op"], r["provider"], r["value"]) for r in rows]
    assert all(json.loads(t["extra"]) is not None for t in table)


def test_bench_shape_lists():
    from ampkernels.bench.run import _shapes_for
    specs = ["768", "4096x768x3072", "16384x1024", "1536"]
    assert _shapes_for("bench_layer_norm", specs) == [768, 1536]
    assert _shapes_for("bench_linear_act", specs) == [(4096, 768, 3072)]
    assert _shapes_for("bench_mlp", specs) == [(16384, 1024)]
    assert _shapes_for("bench_e2e", specs) is None and _shapes_for("bench_mlp", None) is None


# ---------------------------------------------------------------- public providers (ampkernels/bench/providers.py)
# Fake libraries stand in for the real ones: modules in sys.modules that expose what each
# adapter calls, implemented with torch ops, so that discovery, rows and error rows are
# checked on the CPU in CI (where none of the real ones is installed).

PUBLIC = ("liger_kernel", "quack", "apex", "flash_attn")


def _only(monkeypatch, **modules):
    """Make exactly `modules` importable among the public libraries (None blocks an import)."""
    for name in PUBLIC:
        monkeypatch.setitem(sys.modules, name, None)
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)


def _module(name, **attrs):
    m = types.ModuleType(name)
    m.__dict__.update(attrs)
    return m


def _fake_liger(fail_layer_norm=False):
    def liger_layer_norm(X, W, B, eps):
        if fail_layer_norm:
            raise RuntimeError("liger kernel failed")
        return F.layer_norm(X, X.shape[-1:], W, B, eps)

    def liger_rms_norm(X, W, eps, offset=0.0, casting_mode="llama", in_place=True):
        assert not in_place, "the benchmark replays one dy: dx must not be written into it"
        return F.rms_norm(X, X.shape[-1:], W, eps)

    functional = _module("liger_kernel.transformers.functional", liger_layer_norm=liger_layer_norm,
                         liger_rms_norm=liger_rms_norm)
    transformers = _module("liger_kernel.transformers", functional=functional)
    return {"liger_kernel": _module("liger_kernel", __version__="9.9-fake", transformers=transformers),
            "liger_kernel.transformers": transformers, "liger_kernel.transformers.functional": functional}


def _fake_quack():
    """QuACK's functions: rmsnorm (autograd) and layernorm_fwd / layernorm_bwd (fp32 params)."""
    def layernorm_fwd(x, weight, bias=None, eps=1e-6, return_rstd=False, return_mean=False):
        assert weight.dtype == torch.float32 and x.dim() == 2
        xf = x.float()
        mean, rstd = xf.mean(-1), torch.rsqrt(xf.var(-1, unbiased=False) + eps)
        y = ((xf - mean[:, None]) * rstd[:, None] * weight + bias).to(x.dtype)
        return (y, rstd, mean) if return_rstd and return_mean else y

    def layernorm_bwd(x, weight, dout, rstd, mean, has_bias=True):
        xf = x.float()
        xhat = (xf - mean[:, None]) * rstd[:, None]
        g = dout.float() * weight
        dx = rstd[:, None] * (g - g.mean(-1, keepdim=True) - xhat * (g * xhat).mean(-1, keepdim=True))
        return dx.to(x.dtype), (dout.float() * xhat).sum(0), dout.float().sum(0) if has_bias else None

    rmsnorm = _module("quack.rmsnorm", rmsnorm=lambda x, w, eps=1e-6: F.rms_norm(x, x.shape[-1:], w, eps),
                      layernorm_fwd=layernorm_fwd, layernorm_bwd=layernorm_bwd)
    return {"quack": _module("quack", __version__="0.0-fake", rmsnorm=rmsnorm.rmsnorm), "quack.rmsnorm": rmsnorm}


def _fake_apex():
    """Apex with only its fused_dense extension built (no fused_layer_norm_cuda)."""
    fused_dense = _module("apex.fused_dense", FusedDenseFunc=types.SimpleNamespace(apply=F.linear))
    return {"apex": _module("apex", __version__="0.1-fake", fused_dense=fused_dense), "apex.fused_dense": fused_dense}


def _norm_bench(monkeypatch):
    from ampkernels.bench import bench_layer_norm as bln
    monkeypatch.setattr(bln, "TOTAL", 2**12)
    monkeypatch.setattr(bln, "QUICK_NS", (64, 128))
    return bln


def test_no_public_provider_installed(monkeypatch):
    from ampkernels.bench import providers
    _only(monkeypatch)
    assert providers.discover() == []
    assert set(providers.why_not) == {"liger", "quack", "apex", "flash_attn"}
    assert providers.describe([]).startswith("public providers: none; not importable: liger (")


def test_public_provider_rows_beside_ours(monkeypatch, capsys):
    from ampkernels.bench import providers
    from ampkernels.bench.common import Recorder
    _only(monkeypatch, **_fake_liger(), **_fake_quack())
    found = providers.discover()
    assert [(p.name, p.version) for p in found] == [("liger", "9.9-fake"), ("quack", "0.0-fake")]
    assert providers.discover("linear_act") == []
    bln = _norm_bench(monkeypatch)
    rec = Recorder(None)
    bln.run(rec, [torch.float32], quick=True, device="cpu")
    assert not [r for r in rec.rows if r["provider"] == "error"], rec.rows
    got = {(r["op"], r["provider"], r["pass"], r["N"], r.get("provider_version"), r.get("param_dtype"))
           for r in rec.rows}
    for n in (64, 128):
        for op in ("layer_norm", "rms_norm"):
            for pas in ("fwd", "bwd"):
                assert (op, "eager", pas, n, None, None) in got
                assert (op, "liger", pas, n, "9.9-fake", None) in got
        # QuACK's LayerNorm takes fp32 weight and bias only: timed with the AMP-case params
        assert ("layer_norm", "quack", "bwd", n, "0.0-fake", "float32") in got
        assert ("rms_norm", "quack", "fwd", n, "0.0-fake", None) in got
    # progress: not a terminal here, so one "[i/n]" line per (shape, op, provider, pass) case
    err = capsys.readouterr().err
    assert "[1/26] layer_norm/rms_norm: float32 N=64 copy copy fwd" in err and "[26/26]" in err


def test_quack_layer_norm_forward_and_backward_match_torch(monkeypatch):
    from ampkernels.bench import providers
    _only(monkeypatch, **_fake_quack())
    ln = providers.quack().ops["layer_norm"]
    assert ln.bwd and ln.fp32_params
    x = torch.randn(16, 64, requires_grad=True)
    w, b = (torch.rand(64) + 0.5).requires_grad_(), torch.randn(64).requires_grad_()
    dy = torch.randn(16, 64)
    grads = torch.autograd.grad(ln.fn(x, w, b, 1e-5), (x, w, b), dy)
    expected = torch.autograd.grad(F.layer_norm(x, (64,), w, b, 1e-5), (x, w, b), dy)
    for g, e in zip(grads, expected):
        torch.testing.assert_close(g, e)
    with torch.no_grad():
        torch.testing.assert_close(ln.fn(x, w, b, 1e-5), F.layer_norm(x, (64,), w, b, 1e-5))


def test_raising_provider_gives_error_rows_and_the_run_goes_on(monkeypatch):
    from ampkernels.bench.common import Recorder
    _only(monkeypatch, **_fake_liger(fail_layer_norm=True))
    bln = _norm_bench(monkeypatch)
    rec = Recorder(None)
    bln.run(rec, [torch.float32], quick=True, device="cpu")
    errors = [r for r in rec.rows if r["provider"] == "error"]
    assert {r["op"] for r in errors} == {"layer_norm liger fwd", "layer_norm liger bwd"}
    assert len(errors) == 4 and all("liger kernel failed" in r["value"] for r in errors)
    # everything after the failing provider was still measured, for both shapes
    assert {(r["op"], r["N"]) for r in rec.rows if r["provider"] == "liger"} == {("rms_norm", 64), ("rms_norm", 128)}
    assert {r["N"] for r in rec.rows if r["provider"] == "eager" and r["op"] == "rms_norm"} == {64, 128}


def test_public_linear_act_rows(monkeypatch):
    from ampkernels.bench import bench_linear_act as bl
    from ampkernels.bench import providers
    from ampkernels.bench.common import Recorder
    _only(monkeypatch, **_fake_apex())
    (apex,) = providers.discover()
    assert apex.name == "apex" and set(apex.ops) == {"linear_act"}  # no fused_layer_norm_cuda: no norms
    monkeypatch.setattr(bl, "SHAPES", [(32, 32, 32)])
    monkeypatch.setattr(bl, "ACTIVATIONS", ("gelu_tanh", "relu"))
    monkeypatch.setattr(bl, "COMPILE_SHAPE", (0, 0, 0))
    rec = Recorder(None)
    bl.run(rec, [torch.float16], quick=True, device="cpu")
    assert not [r for r in rec.rows if r["provider"] == "error"], rec.rows
    rows = [r for r in rec.rows if r["provider"] == "apex"]
    assert {(r["activation"], r["pass"]) for r in rows} == {(a, p) for a in ("gelu_tanh", "relu")
                                                            for p in ("fwd", "fwd_bwd")}
    assert all(r["provider_version"] == "0.1-fake" and "FusedDense" in r["note"] for r in rows)
    assert all(r["rel_err"] < 1e-2 for r in rows if r["pass"] == "fwd")


def test_reports_name_the_best_public_provider():
    from ampkernels.bench import bench_layer_norm as bln
    from ampkernels.bench import bench_linear_act as bl

    def norm(provider, value, **extra):
        return dict(op="layer_norm", provider=provider, dtype="bfloat16", N=1024, metric="TB/s", value=value,
                    **{"pass": "fwd"}, **extra)

    lines = bln.report([norm("ampkernels-cuda", 3.8), norm("liger", 3.5, provider_version="0.8.5"),
                        norm("quack", 4.0, provider_version="0.6.5", param_dtype="float32")])
    assert ("layer_norm fwd bfloat16 N=1024: best 3.80 vs best public quack (fp32 params) 4.00 TB/s (0.95x) "
            ">= 1x: FALLS SHORT") in lines, lines
    # a backend's called rate beside its kernels' rate from a CUDA graph, the verdict on the called one
    row = {**norm("ampkernels-triton", 2.1, graph_TBps=3.65), "pass": "bwd"}
    lines = bln.report([row])
    assert ("layer_norm bwd bfloat16 N=1024: ampkernels-triton 2.10 TB/s >= 85% of 3.2 (2.72): FALLS SHORT "
            "(its kernels from a CUDA graph: 3.65)") in lines, lines

    def lin(provider, value, **extra):
        return dict(op="linear_act", provider=provider, dtype="float16", shape="8192x1024x4096",
                    activation="gelu_tanh", metric="TFLOP/s", value=value, **{"pass": "fwd"}, **extra)

    lines = bl.report([lin("ampkernels-cuda", 600), lin("apex", 500, provider_version="0.1")])
    assert any("1.200x best public [apex] (>= 1.0) PASS" in line for line in lines), lines


def test_linear_act_auto_table_is_what_its_source_run_gives():
    # ampkernels/ops/linear_act.py's "auto" table, recomputed by its rule from the runs it names
    # (the tiny bucket's rows come from a run of their own): a hand edit of the table, or of the
    # rule, shows here
    from ampkernels.ops import linear_act as la
    from ampkernels.bench import bench_linear_act as bl
    runs = [os.path.join(ROOT, "benchmarks", "results", name) for name in
            ("h200-2026-12-01-9836fa4-linear-act.jsonl", "h100-2026-12-07-e81e387-linear-act-tiny.jsonl")]
    rows = []
    for run in runs:
        with open(run) as f:
            rows += [json.loads(line) for line in f]
    assert bl.auto_table(rows) == la._MEASURED
    table = [sys.executable, "-m", "ampkernels.bench.bench_linear_act", "--auto-table"]
    out = subprocess.run(table + runs, cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert '(torch.float16, "medium", False): (_C, _C, _T, _E),' in out and len(out.splitlines()) == 16
    # several runs of the same cases: their times add up; one run given twice is its own mean
    twice = subprocess.run(table + 2 * runs, cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert twice == out


def test_linear_act_plot_panels(tmp_path):
    # ampkernels/bench/plot.py: one panel per (activation, pass, dtype), bars per provider, the plain
    # matmul as a line; providers missing from a panel leave it, not the figure
    pytest.importorskip("matplotlib")
    from ampkernels.bench import plot

    rows = [dict(op="linear_act", provider=p, activation=a, dtype=d, M=m, K=k, N=n, metric="TFLOP/s", value=v,
                 gpu="cpu", torch="t", triton="tr", commit="abc", **{"pass": s})
            for d in ("float16", "bfloat16") for s in ("fwd", "fwd_bwd") for m, k, n in ((64, 32, 48), (128, 64, 96))
            for p, a, v in (("matmul", "none", 100.0), ("eager", "gelu", 80.0), ("ampkernels-triton", "gelu", 90.0),
                            ("eager", "relu", 85.0), ("addmm_act", "relu", 95.0))
            if not (p == "addmm_act" and s == "fwd_bwd")]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert plot.plot_all(str(path), str(tmp_path)) == [str(tmp_path / "linear_act.png")]
    assert (tmp_path / "linear_act.png").stat().st_size > 10_000
