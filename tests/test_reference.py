"""The references (the oracle of every other test) against independent float64 math."""
import pytest
import torch
import torch.nn.functional as F

from ampkernels import reference
from tests.utils import assert_rel_close, randn


@pytest.mark.parametrize("name", reference.ACTIVATIONS)
def test_act_grad_matches_autograd(name):
    z = torch.randn(4096, dtype=torch.float64) * 3
    z[:3] = torch.tensor([0.0, 1e-3, -1e-3], dtype=torch.float64)
    zr = z.clone().requires_grad_()
    reference.act_fwd(zr, name).sum().backward()
    assert_rel_close(reference.act_grad(z, name), zr.grad, torch.float64, what=name)


def test_act_fwd_matches_torch_modules():
    z = torch.randn(1000, dtype=torch.float64)
    assert torch.equal(reference.act_fwd(z, "gelu"), torch.nn.GELU()(z))
    assert torch.equal(reference.act_fwd(z, "gelu_tanh"), torch.nn.GELU("tanh")(z))
    assert torch.equal(reference.act_fwd(z, "silu"), torch.nn.SiLU()(z))
    assert torch.equal(reference.act_fwd(z, "squared_relu"), torch.relu(z) ** 2)


def test_unknown_activation_names_choices():
    with pytest.raises(ValueError, match="activation must be one of .*gelu_tanh.*'swish'"):
        reference.activation_id("swish")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 7), (3, 5, 1000), (64, 1536)])
def test_layer_norm_vs_float64(dtype, shape):
    n = shape[-1]
    x = randn(*shape, dtype=dtype, offset=3.0)
    w, b = randn(n) * 0.5 + 1, randn(n)  # fp32 params: the AMP case
    out = reference.layer_norm(x, (n,), w, b, 1e-5)
    assert out.dtype == dtype
    expected = F.layer_norm(x.double(), (n,), w.double(), b.double(), 1e-5)
    assert_rel_close(out, expected, dtype)
    assert reference.layer_norm(x, (n,), w, b, out_dtype=torch.float32).dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_rms_norm_vs_float64(dtype):
    x = randn(2, 9, 768, dtype=dtype)
    w = randn(768) + 1
    out = reference.rms_norm(x, 768, w)
    eps = torch.finfo(torch.float32).eps  # eps=None: the fp32 compute type's epsilon, as torch uses
    assert_rel_close(out, F.rms_norm(x.double(), (768,), w.double(), eps), dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_rms_norm_default_eps_matches_torch_for_small_inputs(dtype):
    # torch's rms_norm(eps=None) uses the epsilon of its fp32 compute type, not finfo(bf16).eps
    # (0.0078), which would dominate mean(x^2) for small activations
    x = randn(4, 128, dtype=dtype, scale=0.05)
    assert_rel_close(reference.rms_norm(x, 128), F.rms_norm(x.float(), (128,)).double(), dtype, factor=2)
    assert_rel_close(reference.rms_norm(x, 128), F.rms_norm(x, (128,)).double(), dtype, factor=8)


def test_norm_over_two_trailing_dims():
    x = randn(4, 6, 10)
    w = randn(6, 10)
    assert_rel_close(reference.layer_norm(x, (6, 10), w), F.layer_norm(x.double(), (6, 10), w.double()), torch.float32)
    with pytest.raises(ValueError, match="normalized_shape"):
        reference.layer_norm(x, (5, 10))


@pytest.mark.parametrize("residual_in_fp32", [False, True])
def test_residual_sum_contract(residual_in_fp32):
    x, r = randn(8, 256, dtype=torch.float16), randn(8, 256, dtype=torch.float16)
    out, s = reference.layer_norm(x, 256, residual=r, residual_in_fp32=residual_in_fp32)
    assert s.dtype == (torch.float32 if residual_in_fp32 else torch.float16)
    exact = x.double() + r.double()
    assert_rel_close(s, exact, s.dtype)
    assert_rel_close(out, F.layer_norm(exact, (256,)), torch.float16)


def test_stats_are_fp32_and_row_shaped():
    x = randn(5, 300, dtype=torch.bfloat16)
    out, s, mean, rstd = reference.norm_forward(x, None, None, 1e-5)
    assert s is None and mean.dtype == rstd.dtype == torch.float32 and mean.shape == rstd.shape == (5,)
    assert_rel_close(mean, x.double().mean(-1), torch.float32)
    _, _, mean, rstd = reference.norm_forward(x, None, None, 1e-5, is_rms=True)
    assert mean is None and rstd.shape == (5,)


def test_all_zero_row_is_finite():
    out = reference.layer_norm(torch.zeros(2, 64, dtype=torch.float16), 64)
    assert torch.isfinite(out).all() and (out == 0).all()


@pytest.mark.parametrize("activation", reference.ACTIVATIONS)
def test_linear_act_vs_float64(activation):
    x, w, b = randn(3, 5, 40, dtype=torch.float16), randn(24, 40, dtype=torch.float16) * 0.2, randn(24)
    out = reference.linear_act(x, w, b, activation)
    assert out.dtype == torch.float16
    expected = reference.act_fwd(F.linear(x.double(), w.double(), b.double()), activation)
    assert_rel_close(out, expected, torch.float16)


def test_linear_act_ignores_autocast():
    x, w = randn(8, 16), randn(4, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = reference.linear_act(x, w, None, "identity")
    assert out.dtype == torch.float32
    assert_rel_close(out, F.linear(x.double(), w.double()), torch.float32)


@pytest.mark.parametrize("activation", reference.ACTIVATIONS)
def test_bias_act_reference_and_backward(activation):
    z, b = randn(33, 70, dtype=torch.float16), randn(70)
    y, pre = reference.bias_act(z, b, activation)
    assert y.dtype == pre.dtype == torch.float16
    pre64 = (z.double() + b.double()).requires_grad_()
    expected = reference.act_fwd(pre64, activation)
    assert_rel_close(y, expected, torch.float16)
    dy = randn(33, 70, dtype=torch.float16)
    expected.backward(dy.double())
    dz, db = reference.bias_act_backward(dy, pre, activation, torch.float32)
    assert_rel_close(dz, pre64.grad, torch.float16)
    assert_rel_close(db, pre64.grad.sum(0), torch.float16)
