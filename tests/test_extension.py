"""The compiled extension: built, importable, schemas registered, clear errors on CPU tensors.

CI builds ampkernels._C with nvcc (no GPU there), so these run on the CPU tier; on a
machine that installed without the extension they skip and say why.
"""
import pytest
import torch

from ampkernels import _build_env, _extension, reference

loaded = _extension.load()
needs_ext = pytest.mark.skipif(not loaded, reason=f"extension not built here: {_extension.status()[1]}")


@needs_ext
def test_build_info_names_archs():
    info = _extension.build_info()
    assert info["archs"] and all(isinstance(a, int) and a >= 60 for a in info["archs"])
    assert info["cuda_runtime"] >= 11000


@needs_ext
@pytest.mark.parametrize("name", ["bias_act_fwd_cuda", "bias_act_bwd_cuda", "build_info_cuda", "probe_device_cuda"])
def test_schemas_registered(name):
    op = getattr(torch.ops.ampkernels, name)
    assert op.default._schema.name == f"ampkernels::{name}"


@needs_ext
def test_cpu_tensor_is_a_clear_error():
    with pytest.raises(RuntimeError, match="bias_act_fwd_cuda: z must be a CUDA tensor, got a tensor on cpu"):
        torch.ops.ampkernels.bias_act_fwd_cuda(torch.randn(3, 4), None, 0, False)


@needs_ext
def test_activation_enum_matches_reference():
    # the C++ enum rejects ids past the last activation; the reference names them in order
    with pytest.raises(RuntimeError, match="must be a CUDA tensor|unknown activation"):
        torch.ops.ampkernels.bias_act_fwd_cuda(torch.randn(3, 4), None, len(reference.ACTIVATIONS), False)


def test_missing_extension_is_reported_not_raised():
    loaded_now, reason, how = _extension.status()
    assert isinstance(reason, str) and reason
    assert loaded_now == loaded and (how is not None) == bool(loaded)


def test_user_arch_list_is_honoured(monkeypatch):
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.6")
    archs, which = _build_env.arch_list()
    assert archs == "8.6" and "TORCH_CUDA_ARCH_LIST" in which


@pytest.mark.skipif(torch.cuda.device_count() > 0, reason="the no-GPU build machine's case")
def test_build_without_a_visible_gpu_picks_archs_torch_accepts(monkeypatch):
    # unset, torch's cpp_extension has no GPU to take architectures from and fails on the empty list
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    archs, which = _build_env.arch_list()
    assert archs == _build_env.NO_GPU_ARCH_LIST and which.startswith(f"no visible GPU: building for {archs}")
    from torch.utils import cpp_extension
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", archs)
    flags = " ".join(cpp_extension._get_cuda_arch_flags())
    assert "code=sm_80" in flags and "code=sm_90" in flags and "code=compute_90" in flags, flags


@pytest.mark.gpu
def test_kernel_image_runs_on_this_gpu():
    assert loaded, _extension.status()[1]
    assert torch.ops.ampkernels.probe_device_cuda() == ""
