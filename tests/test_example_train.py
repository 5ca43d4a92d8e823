"""examples/train_causal_lm.py runs: --tiny on CPU, with and without ampkernels (the same losses
in fp32), under bf16 autocast, and as 2 DDP processes (gloo) through torchrun."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "train_causal_lm.py"


def _run(tmp_path, *args, launcher=(), tag="run", device="cpu"):
    out = tmp_path / f"{tag}.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, *launcher, str(SCRIPT), "--tiny", "--device", device, "--json", str(out), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout


def test_tiny_fp32_converted_and_unconverted_give_the_same_losses(tmp_path):
    conv, stdout = _run(tmp_path, "--dtype", "fp32", "--steps", "3", tag="conv")
    plain, _ = _run(tmp_path, "--dtype", "fp32", "--steps", "3", "--no-ampkernels", tag="plain")
    assert "ampkernels.nn.convert: 7 module(s) replaced" in stdout  # 5 LayerNorms, 2 c_fc + GELU
    assert "tokens/s" in stdout and "peak memory" in stdout
    assert conv["ampkernels"] and not plain["ampkernels"]
    assert len(conv["losses"]) == 3 and conv["losses"] == pytest.approx(plain["losses"], rel=1e-5)
    assert conv["median_step_ms"] > 0 and conv["tokens_per_s"] > 0 and conv["peak_memory_GiB"] > 0


def test_tiny_llama_bf16_autocast(tmp_path):
    s, _ = _run(tmp_path, "--model", "llama", "--dtype", "bf16", "--steps", "3")
    assert s["dtype"] == "bf16" and all(math.isfinite(v) for v in s["losses"])
    assert abs(s["losses"][0] - math.log(256)) < 0.5  # random tokens over a 256 vocabulary, at init


def test_torchrun_two_processes_gloo(tmp_path):
    launcher = ("-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2")
    s, stdout = _run(tmp_path, "--steps", "2", "--dtype", "fp16", launcher=launcher)  # fp16: the GradScaler path
    assert s["world_size"] == 2 and len(s["losses"]) == 2 and all(math.isfinite(v) for v in s["losses"])
    assert "2 process(es)" in stdout


@pytest.mark.gpu
@pytest.mark.parametrize("extra", [("--dtype", "bf16"), ("--dtype", "fp16"), ("--dtype", "bf16", "--compile")],
                         ids=["bf16", "fp16", "bf16-compile"])
def test_gpu_tiny_run_matches_unconverted(tmp_path, extra):
    conv, _ = _run(tmp_path, "--steps", "6", *extra, tag="conv", device="cuda")
    plain, _ = _run(tmp_path, "--steps", "6", "--no-ampkernels", *extra, tag="plain", device="cuda")
    assert conv["device"].startswith("cuda") and conv["peak_memory_kind"] == "max_memory_allocated"
    assert conv["losses"] == pytest.approx(plain["losses"], abs=2e-2)  # AMP rounding over 6 steps

