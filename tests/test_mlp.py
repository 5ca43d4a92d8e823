"""fused_mlp (the op behind nn.FusedMLP): its custom ops and autograd on CPU, kernels on GPU."""
import pytest
import torch
import torch.nn.functional as F

from ampkernels import reference
from ampkernels.ops.mlp import FusedMLPFunction, fused_mlp
from tests.utils import assert_rel_close


def _inputs(m, k, h, n, dtype=torch.float32, device="cpu", bias=True):
    t = lambda *s, scale=1.0: (torch.randn(*s, device=device) * scale).to(dtype).requires_grad_()  # noqa: E731
    return (t(m, k), t(h, k, scale=k**-0.5), t(h) if bias else None, t(n, h, scale=h**-0.5), t(n) if bias else None)


def _eager64(x, w1, b1, w2, b2, activation):
    d = lambda v: None if v is None else v.detach().double().requires_grad_()  # noqa: E731
    args = [d(v) for v in (x, w1, b1, w2, b2)]
    out = F.linear(reference.act_fwd(F.linear(args[0], args[1], args[2]), activation), args[3], args[4])
    return out, args


def _check(backend, activation, dtype, device, bias=True, m=37, factor=4):
    x, w1, b1, w2, b2 = _inputs(m, 48, 136, 40, dtype, device, bias)
    out = FusedMLPFunction.apply(x, w1, b1, w2, b2, activation, backend)
    ref, args = _eager64(x, w1, b1, w2, b2, activation)
    assert_rel_close(out, ref, dtype, factor=factor, what="out")
    dy = torch.randn_like(out)
    out.backward(dy)
    ref.backward(dy.double())
    for name, ours, theirs in zip(("dx", "dw1", "db1", "dw2", "db2"), (x, w1, b1, w2, b2), args):
        if ours is not None:
            assert ours.grad.dtype == ours.dtype
            assert_rel_close(ours.grad, theirs.grad, dtype, factor=factor, what=name)


@pytest.mark.parametrize("activation", reference.ACTIVATIONS)
def test_custom_ops_and_autograd_cpu(activation):
    _check("torch", activation, torch.float32, "cpu", factor=10)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tier: Triton interpreter")
@pytest.mark.parametrize("activation", ["gelu_tanh", "relu"])
def test_triton_interpreter_cpu(activation):
    _check("triton", activation, torch.float16, "cpu", m=19, factor=4)


def test_no_bias_cpu():
    _check("torch", "gelu", torch.float32, "cpu", bias=False, factor=10)


def test_opcheck_cpu():
    x, w1, b1, w2, b2 = (t.detach() for t in _inputs(8, 16, 32, 16))
    torch.library.opcheck(torch.ops.ampkernels.fused_mlp_fwd.default, (x, w1, b1, w2, b2, "silu", "torch"))
    pre = F.linear(x, w1, b1)
    dout = torch.randn(8, 16)
    torch.library.opcheck(torch.ops.ampkernels.fused_mlp_bwd.default,
                          (dout, x, w1, w2, pre, "silu", torch.float32, None, "torch"))


def test_functional_validates_shapes_and_falls_back():
    x, w1, b1, w2, b2 = _inputs(4, 16, 32, 8)
    with pytest.raises(ValueError, match="shapes do not chain"):
        fused_mlp(x, w1, b1, w2.t(), b2)
    out = fused_mlp(x.double(), w1.double(), b1.double(), w2.double(), b2.double(), "relu")  # fp64: eager path
    assert out.dtype == torch.float64 and out.shape == (4, 8)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cuda", "triton"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("activation", reference.ACTIVATIONS)
def test_kernels_gpu(backend, dtype, activation):
    _check(backend, activation, dtype, "cuda", factor=4)
    _check(backend, activation, dtype, "cuda", bias=False, m=1, factor=4)


@pytest.mark.gpu
def test_autocast_fp32_params_gpu():
    x, w1, b1, w2, b2 = _inputs(256, 64, 256, 64, torch.float32, "cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = fused_mlp(x.view(4, 64, 64), w1, b1, w2, b2, "gelu_tanh")
    assert out.dtype == torch.bfloat16 and out.shape == (4, 64, 64)
    out.float().sum().backward()
    assert w1.grad.dtype == torch.float32 and torch.isfinite(w1.grad).all()
