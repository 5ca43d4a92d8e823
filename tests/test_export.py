"""Converted models export: torch.export gives a graph of plain aten ops (no ampkernels custom
ops, whatever backend the modules ask for), and the ONNX made of it (dynamo=True) runs in
onnxruntime with eager's outputs."""
import copy

import pytest
import torch

import ampkernels.nn as aknn
from tests.utils import assert_rel_close, needs_triton_ops


def _custom_ops(ep):
    return [str(n.target) for n in ep.graph.nodes if n.op == "call_function" and "ampkernels" in str(n.target)]


class _Logits(torch.nn.Module):  # HF returns a ModelOutput; export wants tensors
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(input_ids=ids, use_cache=False).logits


def _gpt2():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=2, n_positions=16, bos_token_id=0,
                                  eos_token_id=0)
    return _Logits(transformers.GPT2LMHeadModel(cfg)).eval(), (torch.randint(0, 64, (2, 8)),)


def _vit():
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, depth=2, img_size=32, patch_size=8,
                              num_classes=10)
    return model.eval(), (torch.randn(2, 3, 32, 32),)


def _converted(make):
    ref, args = make()
    model = copy.deepcopy(ref)
    _, report = aknn.convert(model)
    assert report.replaced, str(report)
    return ref, model, args


@pytest.mark.parametrize("make", [_gpt2, _vit], ids=["gpt2", "vit"])
def test_torch_export_matches_eager(make):
    ref, model, args = _converted(make)
    ep = torch.export.export(model, args)
    assert _custom_ops(ep) == []
    with torch.no_grad():
        assert_rel_close(ep.module()(*args), ref(*args), torch.float32, factor=10)


@needs_triton_ops
def test_explicit_backends_export_as_the_torch_path():
    # fp16 modules asking for Triton (the CPU interpreter runs it in eager): the exported graph
    # holds aten ops, and computes what the torch path computes
    model = torch.nn.Sequential(aknn.LayerNorm(32, backend="triton"), aknn.Linear(32, 48, activation="gelu",
                                backend="triton"), aknn.RMSNorm(48, backend="triton"),
                                aknn.Linear(48, 16, activation="silu", backend="triton"))
    model = model.half()
    x = torch.randn(4, 5, 32).half()
    ep = torch.export.export(model, (x,))
    assert _custom_ops(ep) == []
    torch_path = copy.deepcopy(model)
    for m in torch_path:
        m.backend = "torch"
    with torch.no_grad():
        assert_rel_close(ep.module()(x), torch_path(x), torch.float16, factor=4)
    if torch.cuda.is_available():
        return
    with torch.no_grad():  # and the eager model (Triton interpreter) agrees too
        assert_rel_close(model(x).float(), torch_path(x).float(), torch.float16, factor=4)


@pytest.mark.parametrize("make", [_gpt2, _vit], ids=["gpt2", "vit"])
def test_onnx_export_runs_in_onnxruntime(make, tmp_path):
    ort = pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    ref, model, args = _converted(make)
    batch = torch.export.Dim("batch", max=8)
    if make is _gpt2:  # dynamic batch and sequence length; run at another shape than traced
        dynamic, other = ({0: batch, 1: torch.export.Dim("seq", max=16)},), (torch.randint(0, 64, (3, 11)),)
    else:
        dynamic, other = ({0: batch},), (torch.randn(3, 3, 32, 32),)
    program = torch.onnx.export(model, args, dynamo=True, dynamic_shapes=dynamic, verbose=False)
    path = tmp_path / "model.onnx"
    program.save(str(path))
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for inputs in (args, other):
        feeds = {i.name: a.numpy() for i, a in zip(session.get_inputs(), inputs)}
        (got,) = session.run(None, feeds)
        with torch.no_grad():
            assert_rel_close(torch.from_numpy(got), ref(*inputs), torch.float32, factor=10)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", [None, "cuda", "triton"])
def test_gpu_converted_gpt2_exports_as_aten_ops(backend):
    # the kernels in eager, the torch path in the exported program: the same logits to bf16 rounding
    ref, args = _gpt2()
    ref = ref.cuda().to(torch.bfloat16)  # the reference: these bf16 weights, in float64
    model = copy.deepcopy(ref)
    _, report = aknn.convert(model, backend=backend)
    assert report.replaced
    args = tuple(a.cuda() for a in args)
    ep = torch.export.export(model, args)
    assert _custom_ops(ep) == []
    with torch.no_grad():
        exact = ref.double()(*args)
        assert_rel_close(ep.module()(*args), exact, torch.bfloat16, factor=4)
        assert_rel_close(model(*args), exact, torch.bfloat16, factor=4)
