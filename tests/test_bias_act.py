"""bias_act: the extension's fused bias + activation kernel (GPU) and its torch path (CPU)."""
import pytest
import torch

import ampkernels
from ampkernels import reference
from tests.utils import assert_rel_close, randn

DTYPES = [torch.float16, torch.bfloat16, torch.float32]


def _check(z, bias, activation, backend):
    """Forward and both gradients against float64 math."""
    z = z.detach().requires_grad_()
    bias = None if bias is None else bias.detach().requires_grad_()
    y = ampkernels.bias_act(z, bias, activation, backend=backend)
    assert y.dtype == z.dtype and y.shape == z.shape
    z64 = z.detach().double().requires_grad_()
    b64 = None if bias is None else bias.detach().double().requires_grad_()
    y64 = reference.act_fwd(z64 if b64 is None else z64 + b64, activation)
    assert_rel_close(y, y64, z.dtype, what="y")
    dy = torch.randn_like(y)
    y.backward(dy)
    y64.backward(dy.double())
    assert_rel_close(z.grad, z64.grad, z.dtype, factor=2, what="dz")
    if bias is not None:
        assert bias.grad.dtype == bias.dtype
        assert_rel_close(bias.grad, b64.grad, z.dtype, factor=2, what="dbias")


@pytest.mark.parametrize("activation", reference.ACTIVATIONS)
def test_torch_backend_matches_float64(activation):
    _check(randn(3, 17, 40), randn(40), activation, "torch")


def test_unsupported_dtype_falls_back_to_reference():
    z = torch.randn(4, 8, dtype=torch.float64)
    assert_rel_close(ampkernels.bias_act(z, None, "silu"), torch.nn.functional.silu(z), torch.float64)


def test_bad_bias_shape_is_a_clear_error():
    with pytest.raises(ValueError, match=r"bias must have shape \(8,\)"):
        ampkernels.bias_act(torch.randn(2, 8), torch.randn(7))


def test_opcheck_cpu():
    z, b = randn(6, 10), randn(10)
    fwd = torch.ops.ampkernels.bias_act_fwd.default
    torch.library.opcheck(fwd, (z, b, "gelu", True, "torch"))
    torch.library.opcheck(fwd, (z.detach().requires_grad_(), b.detach().requires_grad_(), "silu", True, "torch"))
    torch.library.opcheck(torch.ops.ampkernels.bias_act_bwd.default, (z, z.clone(), "gelu", torch.float32, "torch"))


def test_compile_fullgraph_cpu():
    # the same op and autograd eager and traced
    z, b = randn(5, 24, requires_grad=True), randn(24, requires_grad=True)
    fn = torch.compile(lambda z, b: ampkernels.bias_act(z, b, "gelu_tanh", backend="torch").square().sum(),
                       fullgraph=True, backend="aot_eager")
    torch._dynamo.reset()
    fn(z, b).backward()
    got = z.grad.clone(), b.grad.clone()
    z.grad = b.grad = None
    ampkernels.bias_act(z, b, "gelu_tanh", backend="torch").square().sum().backward()
    assert torch.equal(got[0], z.grad) and torch.equal(got[1], b.grad)


def test_inference_keeps_no_pre():
    z, b = randn(4, 16), randn(16)
    with torch.no_grad():
        y = ampkernels.bias_act(z, b, "gelu")
    assert y.grad_fn is None
    assert_rel_close(y, torch.nn.functional.gelu(z + b), torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", reference.ACTIVATIONS)
@pytest.mark.parametrize("shape", [(1, 7), (257, 1000), (4, 33, 4096)])
def test_cuda_backend_matches_float64(dtype, activation, shape):
    z = randn(*shape, dtype=dtype, device="cuda", scale=2)
    _check(z, randn(shape[-1], device="cuda"), activation, "cuda")  # fp32 bias: the AMP case
    _check(z, randn(shape[-1], dtype=dtype, device="cuda"), activation, "cuda")
    _check(z, None, activation, "cuda")


@pytest.mark.gpu
def test_cuda_unaligned_and_strided_inputs():
    base = randn(65 * 64 + 1, dtype=torch.float16, device="cuda")
    z = base[1:].view(65, 64)  # storage offset of 2 bytes: the scalar path
    _check(z, randn(64, device="cuda"), "gelu_tanh", "cuda")
    _check(randn(64, 130, dtype=torch.bfloat16, device="cuda")[:, ::2], None, "relu", "cuda")


@pytest.mark.gpu
def test_cuda_dbias_is_deterministic():
    z = randn(8192, 768, dtype=torch.float16, device="cuda", requires_grad=True)
    b = randn(768, device="cuda", requires_grad=True)
    dy = torch.randn_like(z)
    grads = []
    for _ in range(2):
        b.grad = None
        ampkernels.bias_act(z, b, "gelu", backend="cuda").backward(dy)
        grads.append(b.grad.clone())
    assert torch.equal(grads[0], grads[1])


@pytest.mark.gpu
def test_cuda_under_autocast_and_compile():
    z = randn(64, 256, dtype=torch.float16, device="cuda", requires_grad=True)
    b = randn(256, device="cuda", requires_grad=True)
    with torch.autocast("cuda", dtype=torch.float16):
        y = ampkernels.bias_act(z, b, "silu", backend="cuda")
    assert y.dtype == torch.float16
    compiled = torch.compile(lambda z, b: ampkernels.bias_act(z, b, "silu", backend="cuda"), fullgraph=True)
    assert_rel_close(compiled(z, b), y, torch.float16)


@pytest.mark.gpu
def test_cuda_nan_propagates():
    z = randn(4, 64, dtype=torch.float16, device="cuda")
    z[1, 3] = float("nan")
    for activation in reference.ACTIVATIONS:
        y = ampkernels.bias_act(z, None, activation, backend="cuda")
        assert torch.isnan(y[1, 3]) and torch.isfinite(y[0]).all(), activation
