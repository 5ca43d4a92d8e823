"""Property tests (hypothesis): random shapes, dtypes, strides, storage offsets, bias or
not, activations and eps; every backend matches the float64 reference or raises its
documented error. The CPU tier runs the Triton kernels under TRITON_INTERPRET=1 (few,
small examples); the GPU tier runs many more, on every live backend."""
import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ampkernels
from ampkernels import reference
from tests.utils import TOL, assert_rel_close, rel_err

HAS_CUDA = torch.cuda.is_available()
CPU = settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
# print_blob: a failing example's report carries the @reproduce_failure line that replays it
GPU = settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), print_blob=True)


@st.composite
def tensors(draw, rows, cols, dtype, device):
    """A (rows, cols) tensor that may be a strided view or start at a storage offset."""
    layout = draw(st.sampled_from(["contiguous", "offset", "col_stride", "transposed"]))
    if layout == "offset":
        base = torch.randn(rows * cols + 1, device=device).to(dtype)
        return base[1:].view(rows, cols)
    if layout == "col_stride":
        return torch.randn(rows, 2 * cols, device=device).to(dtype)[:, ::2]
    if layout == "transposed":
        return torch.randn(cols, rows, device=device).to(dtype).t()
    return torch.randn(rows, cols, device=device).to(dtype)


def _norm_case(data, backend, device, dtypes):
    dtype = data.draw(st.sampled_from(dtypes))
    rows = data.draw(st.integers(1, 40))
    n = data.draw(st.integers(1, 300))
    x = data.draw(tensors(rows, n, dtype, device)) * data.draw(st.sampled_from([1.0, 30.0])) + \
        data.draw(st.sampled_from([0.0, 100.0]))
    x = x.to(dtype)
    param_dtype = data.draw(st.sampled_from([dtype, torch.float32]))
    w = torch.randn(n, device=device).to(param_dtype) if data.draw(st.booleans()) else None
    b = torch.randn(n, device=device).to(param_dtype) if data.draw(st.booleans()) else None
    eps = data.draw(st.sampled_from([1e-5, 1e-6, 1e-2]))
    is_rms = data.draw(st.booleans())
    before = x.clone()
    xg = x.detach().requires_grad_()
    if is_rms:
        out = ampkernels.rms_norm(xg, (n,), w, eps, backend=backend)
        ref = reference.rms_norm(x.double(), (n,), None if w is None else w.double(), eps)
    else:
        out = ampkernels.layer_norm(xg, (n,), w, b, eps, backend=backend)
        ref = reference.layer_norm(x.double(), (n,), None if w is None else w.double(),
                                   None if b is None else b.double(), eps)
    assert out.dtype == dtype and out.shape == x.shape
    assert_rel_close(out, ref, dtype, factor=4 if n > 1 else 1)
    out.backward(torch.randn_like(out))
    assert torch.isfinite(xg.grad).all()
    assert torch.equal(x, before)  # input untouched


def _linear_case(data, backend, device, dtypes):
    dtype = data.draw(st.sampled_from(dtypes))
    m, k, n = data.draw(st.integers(1, 50)), data.draw(st.integers(1, 70)), data.draw(st.integers(1, 70))
    x = data.draw(tensors(m, k, dtype, device))
    w = (data.draw(tensors(n, k, dtype, device)).float() * k**-0.5).to(dtype)
    bias = torch.randn(n, device=device).to(dtype) if data.draw(st.booleans()) else None
    activation = data.draw(st.sampled_from(reference.ACTIVATIONS))
    xg = x.detach().requires_grad_()
    try:
        out = ampkernels.linear_act(xg, w, bias, activation, backend=backend)
    except RuntimeError as e:  # documented: the kernels take fp16/bf16 only
        assert dtype not in (torch.float16, torch.bfloat16) and "dtype" in str(e), e
        return
    ref = reference.linear_act(x.double(), w.double(), None if bias is None else bias.double(), activation)
    assert out.dtype == dtype and out.shape == (m, n)
    assert_rel_close(out, ref, dtype, factor=4)
    out.float().sum().backward()
    assert torch.isfinite(xg.grad).all()


def _mlp_case(data, backend, device, dtype):
    """fused_mlp forward and every gradient against float64 eager, on shapes that TMA can and
    cannot describe (the act'-epilogue GEMM then declines and the two-step path runs). The
    bound: 4x the dtype's tolerance, or 4x the error of the eager block run in the same dtype,
    whichever is larger: with a few terms per output (x of 1 x 1) the 16-bit rounding of the
    hidden gradient that both make can leave no correct digit after cancellation."""
    from ampkernels.ops.mlp import fused_mlp
    from tests.test_mlp import _eager64, _inputs
    aligned_or_not = lambda top: st.one_of(st.integers(1, top // 8).map(lambda v: 8 * v), st.integers(1, top))
    m, k, h, n = (data.draw(st.integers(1, 40)), data.draw(st.integers(1, 48)), data.draw(aligned_or_not(80)),
                  data.draw(aligned_or_not(48)))
    args = _inputs(m, k, h, n, dtype, device, bias=data.draw(st.booleans()))
    activation = data.draw(st.sampled_from(reference.ACTIVATIONS))
    eager_args = [None if a is None else a.detach().clone().requires_grad_() for a in args]
    x, w1, b1, w2, b2 = eager_args
    eager = F.linear(reference.act_fwd(F.linear(x, w1, b1), activation), w2, b2)
    out = fused_mlp(*args, activation, backend=backend)
    ref, ref_args = _eager64(*args, activation)
    dout = torch.randn_like(out)
    for t, grad in ((out, dout), (eager, dout), (ref, dout.double())):
        t.backward(grad)
    what = f"({m}x{k}x{h}x{n} {activation})"
    for name, ours, same_dtype, exact in zip(("out", "dx", "dw1", "db1", "dw2", "db2"), (out, *args),
                                             (eager, *eager_args), (ref, *ref_args)):
        if ours is None:
            continue
        get = (lambda t: t) if name == "out" else (lambda t: t.grad)
        bound = max(4 * TOL[dtype], 4 * rel_err(get(same_dtype), get(exact)))
        err = rel_err(get(ours), get(exact))
        assert err <= bound, f"{name} {what}: relative error {err:.2e} > {bound:.2e}"


@pytest.mark.skipif(HAS_CUDA, reason="CPU tier (Triton interpreter)")
@CPU
@given(st.data())
def test_fused_mlp_triton_fused_dgrad_interpreter(data):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AMPKERNELS_TRITON_FUSED_DGRAD", "1")
        _mlp_case(data, "triton", "cpu", torch.float16)


@pytest.mark.skipif(HAS_CUDA, reason="CPU tier (Triton interpreter)")
@CPU
@given(st.data())
def test_norms_triton_interpreter(data):
    _norm_case(data, "triton", "cpu", [torch.float16, torch.float32])


@pytest.mark.skipif(HAS_CUDA, reason="CPU tier (Triton interpreter)")
@CPU
@given(st.data())
def test_linear_act_triton_interpreter(data):
    _linear_case(data, "triton", "cpu", [torch.float16, torch.float32])


@CPU
@given(st.data())
def test_norms_and_linear_act_reference_backend(data):
    _norm_case(data, "torch", "cpu", [torch.float16, torch.bfloat16, torch.float32])
    _linear_case(data, "torch", "cpu", [torch.float32])


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cuda", "triton"])
@GPU
@given(data=st.data())
def test_norms_gpu(backend, data):
    _norm_case(data, backend, "cuda", [torch.float16, torch.bfloat16, torch.float32])


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cuda", "triton"])
@GPU
@given(data=st.data())
def test_linear_act_gpu(backend, data):
    _linear_case(data, backend, "cuda", [torch.float16, torch.bfloat16])


@pytest.mark.gpu
@pytest.mark.parametrize("backend, fused_dgrad", [("cuda", "0"), ("triton", "0"), ("triton", "1")])
@GPU
@given(data=st.data())
def test_fused_mlp_gpu(backend, fused_dgrad, data):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AMPKERNELS_TRITON_FUSED_DGRAD", fused_dgrad)
        _mlp_case(data, backend, "cuda", data.draw(st.sampled_from([torch.float16, torch.bfloat16])))
