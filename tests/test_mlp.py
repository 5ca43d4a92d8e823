"""fused_mlp (the op behind nn.FusedMLP): its custom ops and autograd on CPU, kernels on GPU."""
import pytest
import torch
import torch.nn.functional as F

from ampkernels import _extension, reference
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


def _check(backend, activation, dtype, device, bias=True, m=37, factor=4, khn=(48, 136, 40), lead=None):
    """Forward and every gradient against float64 eager; lead: run x as (lead, m // lead, k)
    through the functional API (3-D input) instead of the 2-D autograd Function."""
    k, h, n = khn
    x, w1, b1, w2, b2 = _inputs(m, k, h, n, dtype, device, bias)
    if lead:
        x = x.detach().reshape(lead, m // lead, k).requires_grad_()
        out = fused_mlp(x, w1, b1, w2, b2, activation, backend=backend)
    else:
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


needs_ext = pytest.mark.skipif(not _extension.load(), reason=f"extension not built: {_extension.status()[1]}")


@needs_ext
@pytest.mark.parametrize("name", ["linear_dact_cuda", "linear_dact_lt_plans_cuda"])
def test_extension_schemas(name):
    assert getattr(torch.ops.ampkernels, name).default._schema.name == f"ampkernels::{name}"


@needs_ext
def test_linear_dact_cpu_tensor_is_a_clear_error():
    dy, w, pre = torch.randn(4, 8).half(), torch.randn(8, 16).half(), torch.randn(4, 16).half()
    with pytest.raises(RuntimeError, match="linear_dact_cuda: dy must be a CUDA tensor, got a tensor on cpu"):
        torch.ops.ampkernels.linear_dact_cuda(dy, w, pre, reference.activation_id("gelu_tanh"), True, True)


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


# ---------------------------------------------------------------- cuda gelu_tanh: DGELU_BGRAD backward
# Each case's shape (M in particular, the GEMM's n) is used by no other test, so its first
# call builds a fresh cuBLASLt plan, and linear_dact_lt_plans_cuda shows whether the fused
# DGELU(_BGRAD) GEMM ran: +1 when fused, +0 on the explicit fallback.

_DGELU_CASES = {  # name: (m, (k, h, n), lead, fused)
    "aligned": (304, (256, 512, 128), None, True),
    "3d_input": (4 * 77, (64, 256, 96), 4, True),
    "hidden_not_multiple_of_8": (72, (64, 130, 64), None, False),  # aux_ld = hidden must be a multiple of 8
    "out_not_multiple_of_8": (88, (64, 128, 36), None, False),     # dout's leading dim N
}


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(_DGELU_CASES))
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cuda_gelu_tanh_backward_fused_gpu(case, bias, dtype):
    m, khn, lead, fused = _DGELU_CASES[case]
    before = torch.ops.ampkernels.linear_dact_lt_plans_cuda()
    _check("cuda", "gelu_tanh", dtype, "cuda", bias=bias, m=m, factor=4, khn=khn, lead=lead)
    assert torch.ops.ampkernels.linear_dact_lt_plans_cuda() - before == int(fused), \
        "fused DGELU GEMM expected" if fused else "fallback expected"


def _dact64(dy, w, pre, activation):
    dz = (dy.double() @ w.double()) * reference.act_grad(pre.double(), activation)
    return dz, dz.sum(0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("activation", ["gelu_tanh", "silu"])
def test_linear_dact_op_gpu(dtype, activation):
    m, n, h = 200, 96, 384
    dy = torch.randn(m, n, device="cuda").to(dtype)
    w = (torch.randn(n, h, device="cuda") * n**-0.5).to(dtype)
    pre = torch.randn(m, h, device="cuda").to(dtype)
    ref_dz, ref_db = _dact64(dy, w, pre, activation)
    aid = reference.activation_id(activation)
    before = torch.ops.ampkernels.linear_dact_lt_plans_cuda()
    for fuse in (True, False):
        dz, db = torch.ops.ampkernels.linear_dact_cuda(dy, w, pre, aid, True, fuse)
        assert dz.dtype == db.dtype == dtype
        assert_rel_close(dz, ref_dz, dtype, factor=4, what=f"dz fuse={fuse}")
        assert_rel_close(db, ref_db, dtype, factor=4, what=f"db fuse={fuse}")
        dz, db = torch.ops.ampkernels.linear_dact_cuda(dy, w, pre, aid, False, fuse)
        assert db.numel() == 0
        assert_rel_close(dz, ref_dz, dtype, factor=4, what=f"dz without db, fuse={fuse}")
    # only gelu_tanh has a cuBLASLt epilogue: one DGELU_BGRAD and one DGELU plan
    assert torch.ops.ampkernels.linear_dact_lt_plans_cuda() - before == (2 if activation == "gelu_tanh" else 0)


@pytest.mark.gpu
def test_linear_dact_misaligned_and_empty_gpu():
    m, n, h, dtype = 40, 64, 128, torch.bfloat16
    aid = reference.activation_id("gelu_tanh")
    dy = torch.randn(m, n, device="cuda").to(dtype)
    w = (torch.randn(n, h, device="cuda") * n**-0.5).to(dtype)
    pre = torch.randn(m * h + 1, device="cuda").to(dtype)[1:].view(m, h)  # contiguous, 2 bytes off 16
    before = torch.ops.ampkernels.linear_dact_lt_plans_cuda()
    dz, db = torch.ops.ampkernels.linear_dact_cuda(dy, w, pre, aid, True, True)
    assert torch.ops.ampkernels.linear_dact_lt_plans_cuda() == before  # misaligned aux: explicit fallback
    ref_dz, ref_db = _dact64(dy, w, pre, "gelu_tanh")
    assert_rel_close(dz, ref_dz, dtype, factor=4, what="dz")
    assert_rel_close(db, ref_db, dtype, factor=4, what="db")
    # no rows: empty dz, zero bias gradient; N = 0: dy @ w is zero
    dz, db = torch.ops.ampkernels.linear_dact_cuda(dy[:0], w, pre[:0], aid, True, True)
    assert dz.shape == (0, h) and torch.equal(db, torch.zeros_like(db)) and db.shape == (h,)
    dz, db = torch.ops.ampkernels.linear_dact_cuda(dy[:, :0].contiguous(), w[:0], pre, aid, True, True)
    assert torch.equal(dz, torch.zeros_like(dz)) and torch.equal(db, torch.zeros_like(db))
    with pytest.raises(RuntimeError, match="linear_dact_cuda: pre must have shape"):
        torch.ops.ampkernels.linear_dact_cuda(dy, w, pre[:, :-8].contiguous(), aid, True, True)
