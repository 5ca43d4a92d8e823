"""scripts/soak.py on CPU for a few steps (the GPU run is the lead's: docs/reliability.md)."""
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))


def test_soak_smoke_cpu(tmp_path):
    pytest.importorskip("transformers")
    import soak
    rc = soak.main(["--steps", "8", "--layers", "1", "--hidden", "64", "--heads", "2", "--seq", "32", "--batch", "2",
                    "--vocab", "256", "--overflow-steps", "3", "--out", str(tmp_path)])
    summary = json.loads((tmp_path / "soak.json").read_text())
    assert rc == 0 and summary["ok"], summary["checks"]
    names = [c["check"] for c in summary["checks"]]
    assert "ampkernels: overflow at step 3 skipped" in names and "tail loss converted vs eager" in names
    assert "LayerNorm" in summary["runs"][1]["converted_modules"]
    assert summary["gpu"] == summary["device"] and summary["torch"] and summary["commit"]  # the result's provenance
