"""Backend selection: explicit requests, AMPKERNELS_BACKEND, auto, and clear errors."""
import logging

import pytest
import torch

import ampkernels
from ampkernels import backends


def test_available_backends_shape():
    avail = ampkernels.available_backends()
    assert set(avail) == {"cuda", "triton", "torch"}
    for name, (ok, reason) in avail.items():
        assert isinstance(ok, bool) and isinstance(reason, str) and reason, name
    assert avail["torch"][0]


def test_unknown_backend_names_the_choices(monkeypatch):
    with pytest.raises(ValueError, match="backend must be one of .*'cuda'.*got 'cudnn'"):
        backends.select("op", "cudnn", torch.device("cpu"), ("cuda",))
    monkeypatch.setenv("AMPKERNELS_BACKEND", "fast")
    with pytest.raises(ValueError, match="AMPKERNELS_BACKEND must be one of"):
        backends.select("op", None, torch.device("cpu"), ("cuda",))


def test_cpu_tensors_take_the_reference():
    assert backends.select("op", None, torch.device("cpu"), ("cuda", "triton")) == "torch"
    assert backends.select("op", "auto", torch.device("cpu"), ("cuda", "triton")) == "torch"


def test_explicit_cuda_on_cpu_tensors_is_a_clear_error():
    with pytest.raises(RuntimeError, match=r"ampkernels.bias_act: backend 'cuda' needs CUDA tensors, got tensors on cpu"):
        ampkernels.bias_act(torch.randn(2, 8), None, "relu", backend="cuda")


def test_explicit_triton_on_cpu_tensors_names_the_device_not_the_dtype(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    x, w = torch.randn(4, 8), torch.randn(16, 8)  # fp32: the kernels would not take the dtype either
    with pytest.raises(RuntimeError, match="backend 'triton' needs CUDA tensors, got tensors on cpu"):
        ampkernels.linear_act(x, w, None, "relu", backend="triton")


@pytest.mark.parametrize("name", ["cuda", "triton"])
def test_env_request_that_cannot_run_falls_back_with_one_log_line(monkeypatch, caplog, name):
    monkeypatch.setenv("AMPKERNELS_BACKEND", name)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(backends, "_logged", set())
    with caplog.at_level(logging.WARNING, logger="ampkernels"):
        for _ in range(3):
            assert backends.select("op", None, torch.device("cpu"), ("cuda",)) == "torch"
    lines = [r.getMessage() for r in caplog.records if f"AMPKERNELS_BACKEND={name}" in r.getMessage()]
    assert len(lines) == 1 and "needs CUDA tensors" in lines[0], lines


def test_select_is_marked_constant_for_dynamo_without_importing_it():
    # backends.assume_constant_result stands in for torch.compiler.assume_constant_result, whose
    # import of torch._dynamo costs most of `import ampkernels`: both must mark a function alike
    def probe():
        return 0
    torch.compiler.assume_constant_result(probe)
    assert vars(probe) == vars(backends.assume_constant_result(lambda: 0)) == {"_dynamo_marked_constant": True}
    assert backends.select._dynamo_marked_constant


def test_unsupported_input_uses_torch_or_errors_when_explicit():
    assert backends.select("op", None, torch.device("cpu"), ("cuda",), unsupported="dtype float64") == "torch"
    with pytest.raises(RuntimeError, match="dtype float64"):
        backends.select("op", "triton", torch.device("cpu"), ("triton",), unsupported="dtype float64")


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU interpreter mode (conftest sets TRITON_INTERPRET=1)")
def test_triton_runs_on_cpu_only_in_interpreter_mode(monkeypatch):
    cpu = torch.device("cpu")
    assert backends._can_run("triton", cpu) is None
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert "needs CUDA tensors" in backends._can_run("triton", cpu)
