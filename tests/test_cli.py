"""`ampkernels doctor` and `ampkernels bench` as a user runs them."""
import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_cli(*args, timeout=600):
    env = {**os.environ, "PYTHONPATH": ROOT}
    return subprocess.run([sys.executable, "-m", "ampkernels", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env=env)


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


def test_help_and_unknown_command():
    assert run_cli("--help").returncode == 0
    proc = run_cli("frobnicate")
    assert proc.returncode == 2 and "unknown command 'frobnicate'" in proc.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU demo runs only without a GPU")
def test_bench_cpu_demo(tmp_path):
    proc = run_cli("bench", "--quick", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "NO GPU" in proc.stdout and "match the float64 reference" in proc.stdout
    rows = [json.loads(line) for line in open(tmp_path / "results.jsonl")]
    assert {r["op"] for r in rows} == {"layer_norm", "rms_norm", "linear_act"}
    assert all(r["gpu"] == "cpu" and r["value"] > 0 for r in rows)
