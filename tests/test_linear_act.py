"""linear_act: y = act(x @ W^T + b), every backend against float64 math.

CPU tier: the reference, the torch backend, the Triton kernels under TRITON_INTERPRET=1
(fp16: bf16 is broken in the interpreter), what backward saves, dispatch rules and errors,
opcheck, torch.compile(fullgraph) and the compiled extension's schemas.
GPU tier (`pytest -m gpu`): cuda (cuBLASLt fused and its fallback), triton and torch backends
for every activation x dtype x bias, odd shapes, autocast + GradScaler, compile, opcheck,
CUDA-graph capture.

Tolerances: outputs within TOL (fp16 1e-3, bf16 8e-3 relative Frobenius error vs float64).
Gradients get factor 2: dz = dy * act'(pre) is rounded to the compute dtype before the two
K- and M-long GEMMs, so they carry one extra rounding of the hidden tensor.
"""
import itertools
import math
import os

import pytest
import torch
import torch.nn.functional as F

import ampkernels
from ampkernels import _extension, backends, reference
from ampkernels.ops import linear_act as la
from ampkernels.ops.shared import autocast_dtypes
from tests.utils import assert_rel_close, needs_triton_ops, poison_, randn

# one Triton config per kernel: the session compiles each (activation, dtype) variant once
# instead of once per autotune config (the benchmark runs the autotuned kernels)
os.environ.setdefault("AMPKERNELS_TRITON_AUTOTUNE", "0")

ACTS = reference.ACTIVATIONS
HAS_CUDA = torch.cuda.is_available()
GRAD_FACTOR = 2
# The Hopper kernels apply the activation to the pre-activation rounded to the compute dtype, as
# the unfused path (GEMM, then act) does; squaring doubles that rounding's relative error. At
# 2 x 24 x 8 (16 outputs, no averaging) bf16 squared_relu measured 8.6e-3 against 8e-3 (4872a41)
HOPPER_Y_FACTOR = {"squared_relu": 2}


def _inputs(m, k, n, dtype, device, bias=True, lead=()):
    x = randn(*lead, m, k, dtype=dtype, device=device)
    w = randn(n, k, dtype=dtype, device=device, scale=1 / math.sqrt(k))  # pre-activation ~ N(0, 1)
    b = randn(n, dtype=dtype, device=device, scale=0.5) if bias else None
    return x, w, b


def _check(x, w, b, activation, backend, factor=1.0, **kw):
    """Forward and dx/dW/db of ampkernels.linear_act against float64 autograd."""
    x, w = x.detach().requires_grad_(), w.detach().requires_grad_()
    b = None if b is None else b.detach().requires_grad_()
    y = ampkernels.linear_act(x, w, b, activation, backend=backend, **kw)
    assert y.dtype == x.dtype and y.shape == (*x.shape[:-1], w.shape[0])
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    b64 = None if b is None else b.detach().double().requires_grad_()
    y64 = reference.linear_act(x64, w64, b64, activation)
    assert_rel_close(y, y64, x.dtype, factor=factor, what=f"{backend} {activation} y")
    dy = torch.randn_like(y)
    y.backward(dy)
    if activation == "relu":
        want_dx, want_dw, want_db = _relu_grads64(x64, w64, b64, y, dy)
    else:
        y64.backward(dy.double())
        want_dx, want_dw, want_db = x64.grad, w64.grad, None if b is None else b64.grad
    for name, got, want in (("dx", x.grad, want_dx), ("dW", w.grad, want_dw),
                            ("db", None if b is None else b.grad, want_db)):
        if want is None:
            continue
        assert got.dtype == x.dtype, name
        assert_rel_close(got, want, x.dtype, factor=GRAD_FACTOR * factor, what=f"{backend} {activation} {name}")


def _relu_grads64(x64, w64, b64, y, dy):
    """float64 (dx, dW, db) of linear + ReLU, with the mask the kernel's output shows (y > 0)
    where the float64 pre-activation is within 1e-3 of 0, after checking that mask against the
    float64 one everywhere else. ReLU's derivative jumps at 0, and a pre-activation within
    rounding of 0 (16-bit products summed in fp32) lands on either side in any implementation:
    one such element moves dx by |dy| times a weight row, a 5-7e-3 relative error; eager
    PyTorch fails a float64-masked check at the same 2 of 400 seeds as this library does."""
    z64 = (x64 @ w64.T + (0 if b64 is None else b64)).detach().reshape(-1, w64.shape[0])
    mask = y.detach().reshape(z64.shape) > 0
    near_zero = z64.abs() <= 1e-3
    assert ((mask == (z64 > 0)) | near_zero).all(), "relu: the output's mask differs from the pre-activation's sign"
    dz = dy.double().reshape(z64.shape) * mask
    x2 = x64.detach().reshape(-1, w64.shape[1])
    return (dz @ w64.detach()).reshape(x64.shape), dz.T @ x2, None if b64 is None else dz.sum(0)


# ---------------------------------------------------------------- CPU tier: reference

@pytest.mark.parametrize("activation", ACTS)
def test_reference_matches_float64_math(activation):
    x, w, b = _inputs(9, 24, 11, torch.float32, "cpu")
    z = x.double() @ w.double().T + b.double()
    want = {"identity": z, "relu": z.clamp_min(0), "gelu": 0.5 * z * (1 + torch.erf(z / math.sqrt(2))),
            "gelu_tanh": 0.5 * z * (1 + torch.tanh(math.sqrt(2 / math.pi) * (z + 0.044715 * z**3))),
            "silu": z * torch.sigmoid(z), "squared_relu": z.clamp_min(0) ** 2}[activation]
    got = reference.linear_act(x, w, b, activation)
    assert got.dtype == torch.float32
    assert_rel_close(got, want, torch.float32, factor=10)


@pytest.mark.parametrize("activation", ACTS)
def test_act_grad_matches_autograd(activation):
    z = torch.randn(200, dtype=torch.float64, requires_grad=True)
    reference.act_fwd(z, activation).sum().backward()
    assert_rel_close(reference.act_grad(z.detach(), activation), z.grad, torch.float64)


# ---------------------------------------------------------------- CPU tier: torch backend

@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("activation", ACTS)
def test_torch_backend_fp32(activation, bias):
    _check(*_inputs(13, 24, 10, torch.float32, "cpu", bias), activation, "torch", factor=5)


def test_fp32_without_autocast_takes_the_torch_path():
    x, w, b = _inputs(4, 16, 8, torch.float32, "cpu")
    assert backends.select("linear_act", None, x.device, ("cuda", "triton"), "dtype float32") == "torch"
    assert_rel_close(ampkernels.linear_act(x, w, b, "silu"), F.silu(F.linear(x, w, b)), torch.float32)


def test_cpu_autocast_casts_like_f_linear():
    x, w, b = _inputs(6, 32, 16, torch.float32, "cpu")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = ampkernels.linear_act(x, w, b, "gelu")
        want = F.linear(x, w, b)
    assert y.dtype == want.dtype == torch.bfloat16
    assert_rel_close(y, F.gelu(want.float()), torch.bfloat16)


@pytest.mark.parametrize("recompute", [False, True])
def test_torch_path_under_autocast_is_f_linear_bit_for_bit(recompute):
    # the torch backend leaves the fp32 parameters' casts to F.linear's autocast: output and
    # gradients are the eager block's exactly; fp64 parameters, which autocast does not cast,
    # are cast by the op
    x, w, b = (t.requires_grad_() for t in _inputs(6, 32, 16, torch.float32, "cpu"))
    dy = torch.randn(6, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = ampkernels.linear_act(x, w, b, "gelu", backend="torch", recompute=recompute)
    grads = torch.autograd.grad(y, (x, w, b), dy)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = F.gelu(F.linear(x, w, b))
    want_grads = torch.autograd.grad(want, (x, w, b), dy)
    assert y.dtype == torch.bfloat16 and torch.equal(y, want)
    assert all(torch.equal(g, h) and g.dtype == h.dtype for g, h in zip(grads, want_grads))
    w64, b64 = (t.detach().double().requires_grad_() for t in (w, b))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y64 = ampkernels.linear_act(x, w64, b64, "gelu", backend="torch")
    assert y64.dtype == torch.bfloat16 and torch.equal(y64, y)
    y64.float().sum().backward()
    assert w64.grad.dtype == torch.float64


# ---------------------------------------------------------------- CPU tier: Triton (interpreter)

needs_triton = needs_triton_ops


@needs_triton
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("activation", ACTS)
def test_triton_fp16(activation, bias):
    if HAS_CUDA:
        pytest.skip("GPU tier covers triton on CUDA tensors")
    _check(*_inputs(37, 48, 40, torch.float16, "cpu", bias), activation, "triton")


@needs_triton
@pytest.mark.parametrize("shape", [(1, 16, 8), (5, 13, 7), (33, 70, 9)])
def test_triton_odd_shapes(shape):
    if HAS_CUDA:
        pytest.skip("GPU tier covers triton on CUDA tensors")
    m, k, n = shape
    _check(*_inputs(m, k, n, torch.float16, "cpu"), "gelu", "triton")


@needs_triton
def test_triton_3d_input_and_store_pre():
    if HAS_CUDA:
        pytest.skip("GPU tier covers triton on CUDA tensors")
    x, w, b = _inputs(5, 32, 24, torch.float16, "cpu", lead=(3,))
    _check(x, w, b, "silu", "triton")
    y, pre = torch.ops.ampkernels.linear_act_fwd_triton(x.reshape(-1, 32), w, b, reference.activation_id("silu"),
                                                         True)
    z = reference.linear_act(x.reshape(-1, 32), w, b, "identity")
    assert_rel_close(pre, z, torch.float16, what="pre")
    assert_rel_close(y, F.silu(pre.float()), torch.float16, what="y = act(pre)")


@needs_triton
@pytest.mark.parametrize("tma", [True, False])
@pytest.mark.parametrize("activation", ["gelu", "relu"])
def test_triton_fwd_kernels_tma_and_pointer(activation, tma):
    # the TMA-descriptor kernel is the default on Hopper; the pointer kernel takes the rest
    if HAS_CUDA:
        pytest.skip("GPU tier covers triton on CUDA tensors")
    from ampkernels.triton import linear_act as tk
    x, w, b = _inputs(70, 48, 40, torch.float16, "cpu")
    for bias in (b, None):
        y, pre = tk.linear_act_fwd(x, w, bias, reference.activation_id(activation), True, tma=tma)
        assert_rel_close(y, reference.linear_act(x.double(), w.double(), None if bias is None else bias.double(),
                                                 activation), torch.float16, what=f"y tma={tma}")
        assert_rel_close(pre, reference.linear_act(x.double(), w.double(), None if bias is None else bias.double(),
                                                   "identity"), torch.float16, what=f"pre tma={tma}")


@needs_triton
@pytest.mark.parametrize("activation", ACTS)
def test_triton_dz_kernel(activation):
    if HAS_CUDA:
        pytest.skip("GPU tier covers triton on CUDA tensors")
    from ampkernels.triton import linear_act as tk
    dy, pre = randn(45, 70, dtype=torch.float16), randn(45, 70, dtype=torch.float16, scale=2)
    dz, db = tk.linear_act_dz(dy, pre, reference.activation_id(activation), True)
    want = dy.double() * reference.act_grad(pre.double(), activation)
    assert_rel_close(dz, want, torch.float16)
    assert db.dtype == torch.float32
    assert_rel_close(db, dz.double().sum(0), torch.float32)


def _check_column_sums(device):
    # an identity layer's bias gradient on the Triton backend: the dz pass storing nothing
    from ampkernels.triton import linear_act as tk
    for m, n in ((1, 7), (45, 70), (130, 300), (0, 5)):
        for dtype in (torch.float16, torch.bfloat16):
            t = randn(m, n, dtype=dtype, device=device)
            before = t.clone()
            db = tk.column_sums(t)
            assert db.dtype == torch.float32 and db.shape == (n,)
            assert torch.equal(t, before), "column_sums modified its input"
            if m:
                assert_rel_close(db, t.double().sum(0), torch.float32, what=f"column sums {m}x{n} {dtype}")
                assert torch.equal(db, tk.column_sums(t)), "column sums differ between two runs"
            else:
                assert not db.any()
    t = randn(40, 64, dtype=torch.float16, device=device)
    assert_rel_close(tk.column_sums(t[:, ::2]), t[:, ::2].double().sum(0), torch.float32, what="strided")


@needs_triton
def test_triton_column_sums():
    if HAS_CUDA:
        pytest.skip("GPU tier covers triton on CUDA tensors")
    _check_column_sums("cpu")


def _check_act_forward(dtype, device):
    # fused_mlp's Triton backward recomputes h = act(pre) with act_forward: the forward's
    # epilogue formulas on the pre-activation it stored, so the same bits as the forward's output
    from ampkernels.triton import linear_act as tk
    x, w, b = _inputs(70, 48, 40, dtype, device)
    for activation in ACTS:
        y, pre = tk.linear_act_fwd(x, w, b, reference.activation_id(activation), True)
        h = tk.act_forward(pre, reference.activation_id(activation))
        assert h.dtype == dtype and torch.equal(h, y), f"{activation}: {(h != y).sum()} elements differ"
    assert tk.act_forward(pre[:0], 3).shape == (0, 40)


@needs_triton
def test_triton_act_forward_is_the_forward_epilogue():
    if HAS_CUDA:
        pytest.skip("GPU tier covers triton on CUDA tensors")
    _check_act_forward(torch.float16, "cpu")




try:  # the Triton forward epilogue's activation alone, as a kernel over a 1-D fp32 tensor
    import triton
    import triton.language as tl

    from ampkernels.triton import linear_act as _tk

    @triton.jit
    def _epilogue_act_kernel(z_ptr, y_ptr, n, ACT: tl.constexpr, GRAD: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        z = tl.load(z_ptr + offs, mask=offs < n)
        y = _tk._act_grad(z, ACT) if GRAD else _tk._act_fwd(z, ACT)
        tl.store(y_ptr + offs, y, mask=offs < n)
except ImportError:
    _epilogue_act_kernel = None


def _epilogue_act(z, activation, grad=False):
    y = torch.empty_like(z)
    _epilogue_act_kernel[(triton.cdiv(z.numel(), 1024),)](z, y, z.numel(), ACT=reference.activation_id(activation),
                                                          GRAD=grad, BLOCK=1024)
    return y


def _tail_exact_act64(z, activation):
    """float64 activations without the cancellation of 1 + erf / 1 + tanh, which leaves even
    float64 with no correct digits for z < -8 (the reference follows torch's formulas)."""
    if activation == "gelu":
        return z * 0.5 * torch.special.erfc(-z / math.sqrt(2))
    if activation == "gelu_tanh":
        return z * torch.sigmoid(2 * math.sqrt(2 / math.pi) * (z + 0.044715 * z**3))
    return z * torch.sigmoid(z)


def _check_epilogue_act(device):
    """Elementwise against float64: relative error < 2e-5 wherever |act(z)| > 1e-30 (fp16 rounds
    at 2.4e-4, bf16 at 2e-3), over dense z in [-12, 12] and down to 1e-30; infinities and NaN as
    torch's own formulas give them (-inf: NaN for the GELUs and SiLU)."""
    mag = torch.cat([torch.linspace(0, 12, 20001, dtype=torch.float64), torch.logspace(-30, 1, 2000, dtype=torch.float64)])
    z = torch.cat([mag, -mag]).float().to(device)
    special = torch.tensor([float("inf"), -float("inf"), float("nan"), 100.0, -100.0, 1e30, -1e30], device=device)
    for activation in ("gelu", "gelu_tanh", "silu"):
        got = _epilogue_act(torch.cat([z, special]), activation).cpu().double()
        want = _tail_exact_act64(z.cpu().double(), activation)
        big = want.abs() > 1e-30
        rel = ((got[:z.numel()] - want).abs() / want.abs().clamp_min(1e-300))[big]
        assert rel.max() < 2e-5, f"{activation}: max relative error {rel.max():.2e} at z={z.cpu()[big][rel.argmax()]}"
        assert (got[:z.numel()][~big].abs() <= 1e-30).all(), activation
        s = special.cpu().double()
        got_s, want_s = got[z.numel():], reference.act_fwd(s, activation)
        assert torch.equal(got_s.isnan(), want_s.isnan()), f"{activation}: NaN at {s[got_s.isnan() != want_s.isnan()]}"
        ok = ~want_s.isnan()
        assert torch.allclose(got_s[ok], want_s[ok], rtol=2e-5, atol=1e-30), f"{activation}: {got_s} != {want_s}"


def _check_act_grad(device):
    """act' (the backward's, in the dz pass and the act'-epilogue GEMM) elementwise against
    float64: within 2e-5 relative + 1e-6 absolute (act' crosses zero; dz rounds to 16 bits)
    over dense z in [-12, 12] and down to 1e-30; NaN where torch's formulas give NaN."""
    mag = torch.cat([torch.linspace(0, 12, 20001, dtype=torch.float64), torch.logspace(-30, 1, 2000, dtype=torch.float64)])
    z = torch.cat([mag, -mag]).float().to(device)
    special = torch.tensor([float("inf"), -float("inf"), float("nan"), 100.0, -100.0], device=device)
    for activation in ACTS:
        got = _epilogue_act(torch.cat([z, special]), activation, grad=True).cpu().double()
        want = reference.act_grad(z.cpu().double(), activation)
        err = (got[:z.numel()] - want).abs() - 2e-5 * want.abs()
        assert err.max() < 1e-6, f"{activation}: error {err.max():.2e} over tolerance at z={z.cpu()[err.argmax()]}"
        s = special.cpu().double()
        got_s, want_s = got[z.numel():], reference.act_grad(s, activation)
        assert torch.equal(got_s.isnan(), want_s.isnan()), f"{activation}: NaN at {s[got_s.isnan() != want_s.isnan()]}"
        ok = ~want_s.isnan()
        assert torch.allclose(got_s[ok], want_s[ok], rtol=2e-5, atol=1e-6), f"{activation}: {got_s} != {want_s}"


@needs_triton
def test_triton_act_grad_math():
    # under the interpreter: the formulas with exact exp2 and division (the GPU test runs the SFU's)
    if HAS_CUDA:
        pytest.skip("GPU tier covers the GPU's fast-math path")
    _check_act_grad("cpu")


@needs_triton
def test_triton_epilogue_activation_math():
    # under the interpreter: the formulas with exact exp2 and division (the GPU test runs the SFU's)
    if HAS_CUDA:
        pytest.skip("GPU tier covers the GPU's fast-math path")
    _check_epilogue_act("cpu")


# ---------------------------------------------------------------- CPU tier: what backward keeps

def _saved_hidden(backend, activation, recompute, device="cpu", dtype=torch.float32):
    """Tensors of the hidden shape (M, N) that autograd keeps for backward."""
    m, n = 12, 40
    x, w, b = _inputs(m, 16, n, dtype, device)
    x.requires_grad_()
    w.requires_grad_()
    kept = []

    def pack(t):
        kept.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = ampkernels.linear_act(x, w, b, activation, backend=backend, recompute=recompute)
    y.sum().backward()
    return [t for t in kept if tuple(t.shape) == (m, n)], y


@pytest.mark.parametrize("activation", ACTS)
def test_backward_saves_one_hidden_tensor(cpu_kernels, activation):
    # the op's C++ autograd (the kernels stood in for on CPU)
    hidden, y = _saved_hidden("cuda", activation, recompute=False, dtype=torch.bfloat16)
    assert len(hidden) == (0 if activation == "identity" else 1)
    if activation == "relu":  # relu keeps its output: y > 0 exactly where pre > 0
        assert hidden[0].data_ptr() == y.data_ptr()
    hidden, _ = _saved_hidden("cuda", activation, recompute=True, dtype=torch.bfloat16)
    assert hidden == []


def _grads_with_and_without_recompute(activation, backend, dtype):
    x, w, b = _inputs(10, 24, 16, dtype, "cpu")
    grads = []
    for recompute in (False, True):
        xs, ws, bs = (t.detach().requires_grad_() for t in (x, w, b))
        ampkernels.linear_act(xs, ws, bs, activation, backend=backend, recompute=recompute).sum().backward()
        grads.append((xs.grad, ws.grad, bs.grad))
    for g0, g1 in zip(*grads):
        assert torch.equal(g0, g1)


@pytest.mark.parametrize("activation", ["gelu", "relu", "squared_relu"])
def test_recompute_gives_the_same_grads(activation):
    _grads_with_and_without_recompute(activation, "torch", torch.float32)  # under torch.utils.checkpoint


@pytest.mark.parametrize("activation", ["gelu", "relu", "squared_relu", "identity"])
def test_recompute_gives_the_same_grads_cpp_autograd(cpu_kernels, activation):
    _grads_with_and_without_recompute(activation, "cuda", torch.bfloat16)


def test_torch_path_trains_with_torch_autograd():
    # "torch" (auto's unfused choice, fp32, CPU) is eager F.linear + activation, node for node
    x, w, b = _inputs(6, 16, 8, torch.float32, "cpu")
    w.requires_grad_()
    y = ampkernels.linear_act(x, w, b, "gelu_tanh", backend="torch")
    ref = F.gelu(F.linear(x, w, b), approximate="tanh")
    assert type(y.grad_fn) is type(ref.grad_fn) and torch.equal(y, ref)
    (gw,) = torch.autograd.grad(y.sum(), w)
    assert torch.equal(gw, torch.autograd.grad(ref.sum(), w)[0])


def test_no_grad_builds_no_graph():
    x, w, b = _inputs(4, 16, 8, torch.float32, "cpu")
    w.requires_grad_()
    with torch.no_grad():
        y = ampkernels.linear_act(x, w, b, "gelu")
    assert y.grad_fn is None and not y.requires_grad


# ---------------------------------------------------------------- CPU tier: bad input

def test_bad_inputs_are_clear_errors():
    x, w, b = _inputs(4, 16, 8, torch.float32, "cpu")
    with pytest.raises(ValueError, match=r"x's last dim must equal weight's K = 16"):
        ampkernels.linear_act(randn(4, 15), w, b)
    with pytest.raises(ValueError, match=r"weight must be 2-D"):
        ampkernels.linear_act(x, w[0], b)
    with pytest.raises(ValueError, match=r"bias must have shape \(8,\)"):
        ampkernels.linear_act(x, w, randn(7))
    with pytest.raises(TypeError, match=r"must share a dtype .* x torch.float16, weight torch.float32"):
        ampkernels.linear_act(x.half(), w, None)
    with pytest.raises(ValueError, match=r"activation must be one of .* got 'gelu_erf'"):
        ampkernels.linear_act(x, w, b, "gelu_erf")
    with pytest.raises(ValueError, match=r"weight is on meta but x is on cpu"):
        ampkernels.linear_act(x, w.to("meta"), b)
    with pytest.raises(ValueError, match="backend must be one of"):
        ampkernels.linear_act(x, w, b, backend="cublas")
    with pytest.raises(TypeError, match="x must be a Tensor"):
        ampkernels.linear_act(x.tolist(), w, b)
    ints = torch.randint(-3, 3, (4, 16)), torch.randint(-3, 3, (8, 16))
    for act in ("identity", "relu", "gelu"):  # torch returned int64 or raised its kernel's error
        with pytest.raises(TypeError, match="linear_act: x must be a floating-point tensor, got torch.int64"):
            ampkernels.linear_act(*ints, None, act)
    with pytest.raises(TypeError, match="linear_act: weight must be a floating-point tensor"):
        ampkernels.linear_act(x, ints[1], None)
    from ampkernels.ops.mlp import fused_mlp
    with pytest.raises(TypeError, match="fused_mlp: x must be a floating-point tensor"):
        fused_mlp(ints[0], w, b, randn(16, 8), None)


@pytest.mark.skipif(HAS_CUDA, reason="CPU-only behaviour")
def test_explicit_cuda_on_cpu_is_a_clear_error():
    x, w, b = _inputs(4, 16, 8, torch.float16, "cpu")
    with pytest.raises(RuntimeError, match=r"ampkernels.linear_act: backend 'cuda'"):
        ampkernels.linear_act(x, w, b, backend="cuda")


@pytest.mark.parametrize("backend", ["torch"] + ([pytest.param("triton", marks=needs_triton)] if not HAS_CUDA else []))
def test_empty_batch(backend):
    dtype = torch.float32 if backend == "torch" else torch.float16
    x, w, b = _inputs(0, 16, 8, dtype, "cpu", lead=(2,))
    x, w, b = (t.requires_grad_() for t in (x, w, b))
    y = ampkernels.linear_act(x, w, b, "gelu", backend=backend)
    assert y.shape == (2, 0, 8)
    y.sum().backward()
    assert x.grad.shape == x.shape and torch.equal(w.grad, torch.zeros_like(w)) and torch.equal(b.grad, torch.zeros_like(b))


def test_non_contiguous_and_offset_inputs_torch_path():
    base = randn(9 * 33 + 1)
    x = base[1:].view(9, 33)[:, 1:]  # storage offset and a row stride != K
    w = randn(40, 64)[:, ::2]
    _check(x, w, randn(40), "gelu_tanh", "torch", factor=5)


# ---------------------------------------------------------------- CPU tier: dispatch

def test_auto_default_preference_and_table(monkeypatch):
    dev = torch.device("cpu")
    assert la.auto_preference(dev, torch.float16, "gelu", 8192, 4096, 4096) == la._AUTO_DEFAULT
    monkeypatch.setitem(la._AUTO_TABLE, (0, torch.float16, "gelu", "large", False), ("triton", "cuda"))
    assert la.auto_preference(dev, torch.float16, "gelu", 8192, 4096, 4096) == ("triton", "cuda")
    assert la.auto_preference(dev, torch.float16, "gelu", 8192, 4096, 4096, training=True) == la._AUTO_DEFAULT
    assert la.auto_preference(dev, torch.float16, "gelu", 8, 8, 8) == la._AUTO_DEFAULT
    assert [la.shape_bucket(*s) for s in ((1024, 1024, 480), (128, 3072, 768), (4096, 3072, 768), (8192, 4096, 1024),
                                          (8192, 4096, 4096), (1 << 10, 1 << 11, 1 << 11))] == \
        ["tiny", "tiny", "small", "medium", "large", "small"]
    from torch.fx.experimental.symbolic_shapes import ShapeEnv  # rows known only at run time: no guard, "tiny"
    assert la.shape_bucket(ShapeEnv().create_unbacked_symint(), 4096, 4096) == "tiny"
    # the measured H200 table: every cell names real backends, the fastest first
    assert len(la._AUTO_TABLE) >= 48
    assert all(set(p) <= {"cuda", "triton", "torch"} and p for p in la._AUTO_TABLE.values())


def test_auto_skips_triton_in_deterministic_mode(monkeypatch):
    # Triton's autotuner picks tiles by timing: under use_deterministic_algorithms "auto" leaves it out
    dev = torch.device("cpu")
    monkeypatch.setitem(la._AUTO_TABLE, (0, torch.float16, "gelu", "large", False), ("triton", "cuda"))
    monkeypatch.setitem(la._AUTO_TABLE, (0, torch.float16, "relu", "large", False), ("triton",))
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        assert la.auto_preference(dev, torch.float16, "gelu", 8192, 4096, 4096) == ("cuda",)
        assert la.auto_preference(dev, torch.float16, "relu", 8192, 4096, 4096) == ("cuda",)
    finally:
        torch.use_deterministic_algorithms(before)
    assert la.auto_preference(dev, torch.float16, "gelu", 8192, 4096, 4096) == ("triton", "cuda")


def test_auto_on_cpu_runs_torch(monkeypatch):
    seen = []
    real = backends.select
    monkeypatch.setattr(backends, "select", lambda *a, **k: seen.append(real(*a, **k)) or seen[-1])
    x, w, b = _inputs(4, 16, 8, torch.float16, "cpu")
    ampkernels.linear_act(x, w, b, "relu")
    assert seen == ["torch"]


# ---------------------------------------------------------------- CPU tier: opcheck, compile, extension

def _opcheck(backend, dtype, device):
    """The op (its fake, its C++ autograd) on `backend`'s kernels, and those kernel ops."""
    x, w, b = _inputs(8, 32, 16, dtype, device)
    gelu, relu, identity = (reference.activation_id(a) for a in ("gelu", "relu", "identity"))
    op = torch.ops.ampkernels.linear_act.default
    leaf = lambda t: t.detach().requires_grad_()  # noqa: E731
    for args in ((x, w, b, gelu, None, False), (leaf(x), leaf(w), leaf(b), gelu, None, False),
                 (leaf(x), leaf(w), None, relu, None, True), (leaf(x), leaf(w), leaf(b), identity, None, False),
                 (leaf(x.reshape(2, 4, 32)), leaf(w), leaf(b), gelu, None, True)):
        torch.library.opcheck(op, (*args, backend))
    # fp32 master weights: cast inside, their gradients in fp32
    for act in (gelu, identity):
        torch.library.opcheck(op, (leaf(x), leaf(w.float()), leaf(b.float()), act, dtype, False, backend))
    fwd = getattr(torch.ops.ampkernels, f"linear_act_fwd_{backend}").default
    extra = (True,) if backend == "cuda" else ()  # cuda's `fuse`
    torch.library.opcheck(fwd, (x, w, b, gelu, True, *extra))
    torch.library.opcheck(fwd, (x, w, None, relu, False, *extra))
    dy, pre = randn(8, 16, dtype=dtype, device=device), randn(8, 16, dtype=dtype, device=device)
    if backend == "cuda":
        torch.library.opcheck(torch.ops.ampkernels.linear_act_bwd_cuda.default, (dy, x, w, pre, gelu, True, True, True,
                                                                                 True))
    else:
        for act in (gelu, identity):
            torch.library.opcheck(torch.ops.ampkernels.linear_act_dz_triton.default, (dy, pre, act, True))
        torch.library.opcheck(torch.ops.ampkernels.act_fwd_triton.default, (pre, gelu))
    torch.library.opcheck(getattr(torch.ops.ampkernels, f"act_backward_{backend}_").default,
                          (dy.clone(), pre, gelu, True))


def test_opcheck_cpu_reference_as_cuda_kernels(cpu_kernels):
    _opcheck("cuda", torch.bfloat16, "cpu")


@needs_triton
def test_opcheck_cpu_triton_interpret():
    if HAS_CUDA:
        pytest.skip("GPU tier covers triton on CUDA tensors")
    _opcheck("triton", torch.float16, "cpu")


@pytest.mark.parametrize("backend", ["torch"] + ([pytest.param("triton", marks=needs_triton)] if not HAS_CUDA else []))
def test_compile_fullgraph_cpu(backend):
    dtype = torch.float32 if backend == "torch" else torch.float16
    x, w, b = _inputs(6, 32, 16, dtype, "cpu", lead=(2,))
    torch._dynamo.reset()
    fn = torch.compile(lambda x, w, b: ampkernels.linear_act(x, w, b, "silu", backend=backend), fullgraph=True,
                       backend="aot_eager")
    x, w, b = (t.requires_grad_() for t in (x, w, b))
    y = fn(x, w, b)
    assert_rel_close(y, reference.linear_act(x.detach().double(), w.detach().double(), b.detach().double(), "silu"),
                     dtype, factor=5)
    y.sum().backward()
    assert x.grad is not None and w.grad is not None and b.grad is not None


needs_ext = pytest.mark.skipif(not _extension.load(), reason=f"extension not built: {_extension.status()[1]}")


@needs_ext
@pytest.mark.parametrize("name", ["linear_act_fwd_cuda", "linear_act_bwd_cuda", "linear_act_lt_plans_cuda",
                                  "act_backward_cuda_"])
def test_extension_schemas(name):
    assert getattr(torch.ops.ampkernels, name).default._schema.name == f"ampkernels::{name}"


@needs_ext
def test_extension_cpu_tensor_is_a_clear_error():
    x, w, b = _inputs(4, 16, 8, torch.float16, "cpu")
    with pytest.raises(RuntimeError, match="linear_act_fwd_cuda: x must be a CUDA tensor, got a tensor on cpu"):
        torch.ops.ampkernels.linear_act_fwd_cuda(x, w, b, 2, False, True)
    with pytest.raises(RuntimeError, match="linear_act_bwd_cuda: x must be a CUDA tensor"):
        torch.ops.ampkernels.linear_act_bwd_cuda(x @ w.T, x, w, x @ w.T, 2, True, True, True, True)
    with pytest.raises(RuntimeError, match="act_backward_cuda_: dy must be a CUDA tensor"):
        torch.ops.ampkernels.act_backward_cuda_(x @ w.T, x @ w.T, 2, True)


def test_cuda_and_triton_act_grad_share_their_constants():
    # the CUDA backward's act' (csrc/activations.cuh) transcribes the Triton kernels' forms
    # (ampkernels/triton/epilogue.py): the Gaussian-tail fit and the sigmoid exponents must not
    # drift apart (each backend's GPU tests check its own accuracy against float64)
    import re
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def floats(path, start, end):
        text = open(os.path.join(root, path)).read()
        body = text[text.index(start):text.index(end, text.index(start))]
        return [float(v) for v in re.findall(r"\d+\.\d{6,}", body)]

    cuda_tail = floats("csrc/activations.cuh", "float gaussian_tail(", "\n}")
    triton_tail = floats("ampkernels/triton/epilogue.py", "def _gaussian_tail(", "return t *")
    assert len(cuda_tail) == 10 and cuda_tail[:9] == triton_tail[:9], (cuda_tail, triton_tail)
    cuda_grad = floats("csrc/activations.cuh", "float act_grad(", "kSquaredReLU")
    triton_grad = floats("ampkernels/triton/epilogue.py", "def _act_grad(", "squared relu")
    for c in (0.7213475204444817, 2.302208198, 0.1029432396, 1.4426950408889634):
        assert c in cuda_grad and c in triton_grad, c


def test_benchmark_runs_and_reports(monkeypatch, tmp_path):
    # the benchmark's code path on tiny CPU shapes (numbers meaningless), then its report
    from ampkernels.bench import bench_linear_act as bl
    from ampkernels.bench.common import Recorder
    monkeypatch.setattr(bl, "SHAPES", [(32, 32, 32)])
    monkeypatch.setattr(bl, "ACTIVATIONS", ("gelu_tanh",))
    monkeypatch.setattr(bl, "COMPILE_SHAPE", (0, 0, 0))
    rec = Recorder(str(tmp_path))
    bl.run(rec, [torch.float16], quick=True, device="cpu")
    providers = {r["provider"] for r in rec.rows}
    assert "error" not in providers, [r for r in rec.rows if r["provider"] == "error"]
    assert {"matmul", "eager", "addmm_act"} <= providers
    assert all(r.get("rel_err", 0) < 1e-2 for r in rec.rows), rec.rows
    rows = [dict(op="linear_act", provider=p, dtype="float16", shape="8192x1024x4096", activation=a,
                 metric="TFLOP/s", value=v, **{"pass": s})
            for p, s, a, v in (("matmul", "fwd", "none", 600), ("matmul", "fwd_bwd", "none", 600),
                               ("ampkernels-cuda", "fwd", "gelu", 590), ("ampkernels-cuda", "fwd_bwd", "gelu", 500),
                               ("eager", "fwd_bwd", "gelu", 400))]
    monkeypatch.undo()  # the report's eager target is at the real COMPILE_SHAPE
    lines = bl.report(rows)
    assert any("0.983 of matmul (>= 0.95) [ampkernels-cuda] PASS" in line for line in lines), lines
    assert any("0.833 of matmul (>= 0.95) [ampkernels-cuda] FALLS SHORT" in line for line in lines), lines
    assert any("1.250x eager (>= 1.15) PASS" in line for line in lines), lines


# ---------------------------------------------------------------- GPU tier

GPU_DTYPES = [torch.float16, torch.bfloat16]
GPU_BACKENDS = ["cuda", "triton", "torch"]


@pytest.mark.gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("activation", ACTS)
def test_gpu_backends_match_float64(backend, dtype, activation):
    _check(*_inputs(300, 256, 384, dtype, "cuda", True), activation, backend)
    _check(*_inputs(300, 256, 384, dtype, "cuda", False), activation, backend)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cuda", "triton"])
def test_gpu_act_backward_nan_and_inf_as_reference(backend):
    # the dz pass: NaN where float64 act' gives NaN (inf * 0 for the GELUs and SiLU at +-inf;
    # NaN in, NaN out, except ReLU's mask), finite elsewhere
    pre = randn(4, 64, dtype=torch.float16, device="cuda")
    pre[1, 3], pre[2, 5], pre[3, 7] = float("nan"), float("inf"), -float("inf")
    dy = randn(4, 64, dtype=torch.float16, device="cuda")
    for activation in ACTS[1:]:
        dz = dy.clone()
        getattr(torch.ops.ampkernels, f"act_backward_{backend}_")(dz, pre, reference.activation_id(activation), False)
        want = dy.double() * reference.act_grad(pre.double(), activation)
        assert torch.equal(dz.isnan(), want.isnan()), f"{activation}: NaN at {(dz.isnan() != want.isnan()).nonzero()}"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
def test_gpu_triton_act_forward_is_the_forward_epilogue(dtype):
    _check_act_forward(dtype, "cuda")


@pytest.mark.gpu
def test_gpu_triton_column_sums():
    _check_column_sums("cuda")


@pytest.mark.gpu
def test_gpu_triton_epilogue_activation_math():
    _check_epilogue_act("cuda")  # ex2.approx / rcp.approx: the compiled fast-math path
    _check_act_grad("cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("activation", ACTS)
def test_gpu_cuda_fused_and_fallback_paths_agree(dtype, activation):
    x, w, b = _inputs(256, 512, 768, dtype, "cuda")
    ref = reference.linear_act(x.double(), w.double(), b.double(), activation)
    aid = reference.activation_id(activation)
    for store_pre in (False, True):
        for fuse in (True, False):
            y, pre = torch.ops.ampkernels.linear_act_fwd_cuda(x, w, b, aid, store_pre, fuse)
            assert_rel_close(y, ref, dtype, what=f"y fuse={fuse} store_pre={store_pre}")
            if store_pre:
                assert_rel_close(pre, reference.linear_act(x.double(), w.double(), b.double(), "identity"), dtype)
    dy, saved = torch.randn_like(ref, dtype=dtype), (x @ w.T + b)
    if activation == "relu":
        saved = torch.relu(saved)
    outs = [torch.ops.ampkernels.linear_act_bwd_cuda(dy, x, w, saved, aid, True, True, True, fuse)
            for fuse in (True, False)]
    for a, c, name in zip(*outs, ("dx", "dW", "db")):
        assert_rel_close(a, c.double(), dtype, factor=GRAD_FACTOR, what=f"{name} fused vs fallback")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cuda", "triton"])
@pytest.mark.parametrize("shape", [(1, 64, 128), (7, 13, 7), (33, 72, 40), (65, 8, 24)])
def test_gpu_odd_shapes(backend, shape):
    m, k, n = shape
    for activation in ("gelu_tanh", "relu", "silu"):
        _check(*_inputs(m, k, n, torch.float16, "cuda"), activation, backend)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cuda", "triton"])
def test_gpu_3d_strided_and_offset_inputs(backend):
    x, w, b = _inputs(17, 64, 96, torch.bfloat16, "cuda", lead=(3,))
    _check(x, w, b, "gelu_tanh", backend)
    big = randn(40, 130, dtype=torch.float16, device="cuda")
    _check(big[:, 1:129:2], randn(48, 64, dtype=torch.float16, device="cuda", scale=0.125), None, "gelu", backend)
    base = randn(64 * 128 + 1, dtype=torch.float16, device="cuda")
    x_off = base[1:].view(64, 128)  # 2-byte storage offset: misaligned for 16-byte vector loads
    wbase = randn(96 * 128 + 3, dtype=torch.float16, device="cuda", scale=1 / math.sqrt(128))
    _check(x_off, wbase[3:].view(96, 128), randn(96, dtype=torch.float16, device="cuda"), "gelu_tanh", backend)
    _check(x_off, wbase[3:].view(96, 128), None, "relu", backend)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cuda", "triton"])
def test_gpu_empty_batch(backend):
    x, w, b = (t.requires_grad_() for t in _inputs(0, 64, 32, torch.float16, "cuda"))
    y = ampkernels.linear_act(x, w, b, "gelu", backend=backend)
    assert y.shape == (0, 32)
    y.sum().backward()
    assert torch.equal(w.grad, torch.zeros_like(w)) and torch.equal(b.grad, torch.zeros_like(b))


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(64, 256, 512), (7, 13, 7)])
@pytest.mark.parametrize("activation", ["gelu_tanh", "identity"])
@pytest.mark.parametrize("backend", ["cuda", "triton"])
@pytest.mark.parametrize("dtype", GPU_DTYPES)
def test_gpu_autocast_fp32_params_and_grad_scaler(backend, dtype, activation, shape):
    # fp32 master weights: dweight straight from the GEMM in fp32 (identity on every backend,
    # Triton's act' path too), the cuda act' path casts cuBLASLt's result; K = 13 and N = 7
    # leave rows 26 / 14 bytes long, unaligned for 16-byte vectors
    m, k, n = shape
    torch.manual_seed(0)
    lin = torch.nn.Linear(k, n, device="cuda")
    x = torch.randn(m, k, device="cuda")
    ref_lin = torch.nn.Linear(k, n, device="cuda")
    ref_lin.load_state_dict(lin.state_dict())
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cuda")
    with torch.autocast("cuda", dtype=dtype):
        y = ampkernels.linear_act(x, lin.weight, lin.bias, activation, backend=backend)
        y_ref = reference.act_fwd(ref_lin(x), activation)
    assert y.dtype == y_ref.dtype == dtype
    assert_rel_close(y, y_ref.double(), dtype, factor=2)
    scaler.scale(y.float().square().mean()).backward()
    y_ref.float().square().mean().backward()
    assert lin.weight.grad.dtype == torch.float32 and lin.bias.grad.dtype == torch.float32
    scaler.unscale_(opt)
    assert_rel_close(lin.weight.grad, ref_lin.weight.grad.double(), dtype, factor=4)
    assert_rel_close(lin.bias.grad, ref_lin.bias.grad.double(), dtype, factor=4)
    before = lin.weight.detach().clone()
    scaler.step(opt)
    scaler.update()
    assert not torch.equal(before, lin.weight) and torch.isfinite(lin.weight).all()


@pytest.mark.gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_gpu_autocast_output_dtype_every_activation(backend):
    # the output in the autocast dtype on every backend and activation: the torch path computes
    # the activation itself, where CUDA autocast would run square() (squared_relu) in fp32
    x = torch.randn(33, 40, device="cuda")
    lin = torch.nn.Linear(40, 24, device="cuda")
    for activation in ACTS:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = ampkernels.linear_act(x, lin.weight, lin.bias, activation, backend=backend)
        assert y.dtype == torch.bfloat16, (activation, y.dtype)
        y.float().sum().backward()
        assert lin.weight.grad.dtype == torch.float32, activation
        lin.zero_grad()


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cuda", "triton"])
def test_gpu_compile_fullgraph(backend):
    x, w, b = (t.requires_grad_() for t in _inputs(128, 256, 512, torch.bfloat16, "cuda"))
    torch._dynamo.reset()
    fn = torch.compile(lambda x, w, b: ampkernels.linear_act(x, w, b, "gelu", backend=backend) * 2, fullgraph=True)
    y = fn(x, w, b)
    assert_rel_close(y, 2 * reference.linear_act(x.detach().double(), w.detach().double(), b.detach().double(),
                                                 "gelu"), torch.bfloat16)
    y.sum().backward()
    assert x.grad is not None and w.grad is not None and b.grad is not None


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cuda", "triton"])
def test_gpu_opcheck(backend):
    _opcheck(backend, torch.float16, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cuda", "triton"])
def test_gpu_cuda_graph_capture(backend):
    x, w, b = _inputs(256, 512, 1024, torch.float16, "cuda")
    w.requires_grad_()
    dy = torch.randn(256, 1024, dtype=torch.float16, device="cuda")

    def step():
        w.grad = None
        y = ampkernels.linear_act(x, w, b, "gelu_tanh", backend=backend)
        y.backward(dy)
        return y

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):  # warm up: autotuning, plan caches, allocator
            step()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    w.grad = None
    with torch.cuda.graph(g):
        y = ampkernels.linear_act(x, w, b, "gelu_tanh", backend=backend)
        y.backward(dy)
    poison_(y)
    x.copy_(randn(256, 512, dtype=torch.float16, device="cuda"))
    g.replay()
    torch.cuda.synchronize()
    assert_rel_close(y, reference.linear_act(x.double(), w.detach().double(), b.double(), "gelu_tanh"), torch.float16)
    assert torch.isfinite(w.grad).all()


@pytest.mark.gpu
def test_gpu_lt_plans_are_cached():
    x, w, b = _inputs(512, 256, 384, torch.float16, "cuda")
    ampkernels.linear_act(x, w, b, "gelu_tanh", backend="cuda")
    n = torch.ops.ampkernels.linear_act_lt_plans_cuda()
    for _ in range(3):
        ampkernels.linear_act(x, w, b, "gelu_tanh", backend="cuda")
    assert torch.ops.ampkernels.linear_act_lt_plans_cuda() == n


@pytest.mark.gpu
def test_gpu_lt_times_a_few_token_counts_only():
    # variable-length training: a new token count every step must not time the candidates
    # (a host sync and ~100 GEMMs) each time; after the first two, the nearest timed algorithm
    _, w, b = _inputs(8, 264, 392, torch.bfloat16, "cuda")
    plans, timed = torch.ops.ampkernels.linear_act_lt_plans_cuda()
    counts = (520, 1040, 600, 776, 1032, 48)
    for m in counts:
        _check(torch.randn(m, 264, device="cuda", dtype=torch.bfloat16), w, b, "gelu_tanh", "cuda")
    plans2, timed2 = torch.ops.ampkernels.linear_act_lt_plans_cuda()
    assert timed2 - timed <= 3 * 2  # forward (GELU + aux + bias), dx, dW: 2 token counts each
    assert plans2 - plans >= 3 * len(counts)  # a plan per shape all the same


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cuda", "triton"])
@pytest.mark.parametrize("activation", ["gelu_tanh", "relu", "silu", "identity"])
def test_gpu_saved_memory_and_recompute(backend, activation):
    hidden, _ = _saved_hidden(backend, activation, recompute=False, device="cuda", dtype=torch.float16)
    assert len(hidden) == (0 if activation == "identity" else 1)
    assert all(t.dtype == torch.float16 for t in hidden)
    hidden, _ = _saved_hidden(backend, activation, recompute=True, device="cuda", dtype=torch.float16)
    assert hidden == []
    _check(*_inputs(64, 128, 256, torch.float16, "cuda"), activation, backend, recompute=True)


@pytest.mark.gpu
def test_gpu_auto_is_correct_for_every_activation():
    x, w, b = _inputs(256, 512, 1024, torch.bfloat16, "cuda")
    for activation in ACTS:
        _check(x, w, b, activation, None)


@pytest.mark.gpu
def test_gpu_triton_every_tma_config():
    # the session runs one config per kernel (AMPKERNELS_TRITON_AUTOTUNE=0); the autotuner picks
    # among all of them on a user's machine, so each must be right: ragged tiles, bias, pre stored
    from ampkernels.triton import linear_act as tk
    if not tk.tma_enabled(torch.device("cuda")):
        pytest.skip("TMA needs compute capability 9.0+")
    x, w, b = _inputs(300, 264, 392, torch.bfloat16, "cuda")
    want_y = reference.linear_act(x.double(), w.double(), b.double(), "gelu")
    want_pre = reference.linear_act(x.double(), w.double(), b.double(), "identity")
    kernel, configs = tk._linear_act_fwd_tma_kernel, tk._linear_act_fwd_tma_kernel.configs
    try:
        for cfg in tk._tma_configs(tune=True):
            kernel.configs = [cfg]  # one config: the autotuner launches it without timing
            kernel.cache.clear()
            y, pre = tk.linear_act_fwd(x, w, b, reference.activation_id("gelu"), True, pingpong=False)
            assert_rel_close(y, want_y, torch.bfloat16, what=f"y {cfg}")
            assert_rel_close(pre, want_pre, torch.bfloat16, what=f"pre {cfg}")
    finally:
        kernel.configs = configs
        kernel.cache.clear()


@pytest.mark.gpu
def test_gpu_triton_tma_kernel_is_live_on_hopper():
    from ampkernels.triton import linear_act as tk
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("TMA needs compute capability 9.0+")
    x, w, b = _inputs(256, 512, 384, torch.float16, "cuda")
    y, _ = tk.linear_act_fwd(x, w, b, reference.activation_id("gelu"), False, pingpong=False)
    assert tk._TMA_STATE["broken"] is None, tk._TMA_STATE["broken"]
    assert tk.tma_enabled(x.device)
    assert_rel_close(y, reference.linear_act(x.double(), w.double(), b.double(), "gelu"), torch.float16)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_triton_hopper_kernels(dtype):
    # both Hopper kernels, each forced (the ping-pong kernel and, in bf16, the TMA kernel's first
    # config: this file turns autotuning off), every activation, bias or not, pre stored or not.
    # 5000 x 1000 (ragged in M, N and K = 776) is 320 tiles: several per program, so both
    # ping-pong consumers run and take turns; 2 x 24 x 8 is one tile with one consumer idle.
    # One compile per variant for both shapes: Triton specializes integer arguments equal to 1
    # or divisible by 16, and none of these is (M = 1 would compile every variant again)
    from ampkernels.triton import linear_act as tk
    if not tk.pingpong_enabled(torch.device("cuda")):
        pytest.skip("the ping-pong kernel needs Hopper (sm_90) and Triton's Gluon")
    for m, k, n in ((5000, 776, 1000), (2, 24, 8)):
        x, w, b = _inputs(m, k, n, dtype, "cuda")
        want_pre = reference.linear_act(x.double(), w.double(), b.double(), "identity")
        for activation, pingpong in itertools.product(ACTS, (True, False) if dtype == torch.bfloat16 else (True,)):
            act_id = reference.activation_id(activation)
            want_y = reference.linear_act(x.double(), w.double(), b.double(), activation)
            for store_pre in (True, False):
                y, pre = tk.linear_act_fwd(x, w, b, act_id, store_pre, pingpong=pingpong)
                what = f"{m}x{k}x{n} {activation} store_pre={store_pre} pingpong={pingpong}"
                assert_rel_close(y, want_y, dtype, HOPPER_Y_FACTOR.get(activation, 1), what=f"y {what}")
                if store_pre:
                    assert_rel_close(pre, want_pre, dtype, what=f"pre {what}")
            y, _ = tk.linear_act_fwd(x, w, None, act_id, False, pingpong=pingpong)
            want = reference.linear_act(x.double(), w.double(), None, activation)
            assert_rel_close(y, want, dtype, HOPPER_Y_FACTOR.get(activation, 1),
                             what=f"y {m}x{k}x{n} {activation} no bias pingpong={pingpong}")
    assert tk._PINGPONG_STATE["broken"] is None and tk._TMA_STATE["broken"] is None


@pytest.mark.gpu
def test_gpu_triton_times_pingpong_against_tma_once(monkeypatch):
    # left to itself the Triton forward times the two Hopper kernels once per shape and keeps
    # the faster; whichever it keeps, and the other when the pick is overridden, is right
    from ampkernels.triton import linear_act as tk
    if not tk.pingpong_enabled(torch.device("cuda")):
        pytest.skip("the ping-pong kernel needs Hopper (sm_90) and Triton's Gluon")
    x, w, b = _inputs(512, 2048, 384, torch.bfloat16, "cuda")
    act_id = reference.activation_id("gelu")
    key = (x.device, x.dtype, 512, 384, 2048, act_id, False, True)  # M = 512: its own bucket
    tk._KERNEL_PICK.pop(key, None)
    monkeypatch.setattr(tk, "_AUTOTUNE", True)  # the timing runs only where tuning is on
    calls = []
    original = tk._pingpong.linear_act_fwd_pingpong
    monkeypatch.setattr(tk._pingpong, "linear_act_fwd_pingpong", lambda *a: calls.append(a) or original(*a))
    want = reference.linear_act(x.double(), w.double(), b.double(), "gelu")
    y, _ = tk.linear_act_fwd(x, w, b, act_id, False)
    assert key in tk._KERNEL_PICK
    assert_rel_close(y, want, torch.bfloat16)
    for pick in (True, False):
        tk._KERNEL_PICK[key] = pick
        calls.clear()
        y, _ = tk.linear_act_fwd(x, w, b, act_id, False)
        assert len(calls) == (1 if pick else 0)
        assert_rel_close(y, want, torch.bfloat16, what=f"pingpong={pick}")
        # a batch of 300 rows falls in the same bucket: no new timing, the same kernel
        calls.clear()
        picks = len(tk._KERNEL_PICK)
        y, _ = tk.linear_act_fwd(x[:300], w, b, act_id, False)
        assert len(tk._KERNEL_PICK) == picks and len(calls) == (1 if pick else 0)
        assert_rel_close(y, want[:300], torch.bfloat16, what=f"300 rows, pingpong={pick}")
    tk._KERNEL_PICK.pop(key)


def test_pingpong_pick_is_timed_once_per_key(monkeypatch):
    # the timing rule alone (no GPU): fake kernels with fixed times
    from ampkernels.triton import linear_act as tk
    monkeypatch.setattr(tk, "_KERNEL_PICK", {})
    monkeypatch.setattr(tk, "_AUTOTUNE", True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    times = {"pingpong": 1.0, "tma": 2.0}
    ran = []

    def kernel(name):
        return lambda: ran.append(name)

    monkeypatch.setattr(tk, "_median_ms", lambda fn: fn() or times[ran[-1]])
    assert tk._pingpong_is_faster("a", kernel("pingpong"), kernel("tma"))
    assert ran == ["pingpong", "tma", "tma"]  # the TMA kernel's autotuning run, then its timing
    times["pingpong"] = 3.0
    assert tk._pingpong_is_faster("a", kernel("pingpong"), kernel("tma"))  # cached: no new runs
    assert len(ran) == 3
    assert not tk._pingpong_is_faster("b", kernel("pingpong"), kernel("tma"))

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert tk._pingpong_is_faster("d", kernel("pingpong"), kernel("tma"))  # no timing while capturing
    assert "d" not in tk._KERNEL_PICK


def test_pingpong_is_on_by_default_and_hopper_only(monkeypatch):
    # the dispatch rule alone (no GPU): a Hopper with TMA and Gluon stood in for
    from ampkernels.triton import linear_act as tk
    monkeypatch.setattr(tk, "tma_enabled", lambda device: True)
    monkeypatch.setattr(tk._pingpong, "available", lambda: True)
    capability = [9]
    monkeypatch.setattr(tk, "_cc_major", lambda device: capability[0])
    device = torch.device("cuda")
    monkeypatch.delenv("AMPKERNELS_TRITON_PINGPONG", raising=False)
    assert tk.pingpong_enabled(device)
    monkeypatch.setenv("AMPKERNELS_TRITON_PINGPONG", "0")
    assert not tk.pingpong_enabled(device)
    monkeypatch.setenv("AMPKERNELS_TRITON_PINGPONG", "1")
    assert tk.pingpong_enabled(device)
    capability[0] = 10  # wgmma is Hopper's alone
    assert not tk.pingpong_enabled(device)


# ---------------------------------------------------------------- the op's C++ autograd, on CPU

@pytest.mark.parametrize("activation", reference.ACTIVATIONS)
@pytest.mark.parametrize("master", [False, True])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("lead", [(7,), (2, 3), ()])
@pytest.mark.parametrize("recompute", [False, True])
def test_cpp_autograd_matches_torch_backend(cpu_kernels, activation, master, bias, lead, recompute):
    # x of any rank goes to the op as it is (the rows are viewed below autograd); fp32 master
    # weights are cast inside and get fp32 gradients
    k, n = 24, 40
    for grads_of in ("all", "x", "weight"):
        pdt = torch.float32 if master else torch.bfloat16
        x = randn(*lead, k, dtype=torch.bfloat16 if not master else torch.float32).requires_grad_(grads_of != "weight")
        w = randn(n, k, dtype=pdt, scale=0.3).requires_grad_(grads_of != "x")
        b = randn(n, dtype=pdt).requires_grad_(grads_of == "all") if bias else None
        leaves = [t for t in (x, w, b) if t is not None and t.requires_grad]
        g = randn(*lead, n, dtype=torch.bfloat16)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=master):
            y = la.linear_act(x, w, b, activation, recompute=recompute)  # "cuda" (patched): the op
            x2, cast_to = autocast_dtypes("linear_act", x, (w, b), ("weight", "bias"))
            want = la._torch_linear_act(x2, w, b, activation, cast_to, False)
        assert "LinearActBackward" in y.grad_fn.name()
        assert y.shape == want.shape == (*lead, n)
        assert y.dtype == want.dtype and torch.equal(y, want)
        got_g = torch.autograd.grad(y, leaves, g)
        want_g = torch.autograd.grad(want, leaves, g)
        for t, a, e in zip(leaves, got_g, want_g):
            assert a.dtype == e.dtype == t.dtype
            assert_rel_close(a, e.double(), torch.bfloat16, what=f"{activation} grad of {tuple(t.shape)}")


def test_cpp_autograd_of_nd_x_keeps_inplace_checks(cpu_kernels):
    # the rows are viewed below autograd, and the saved ReLU output is the returned tensor itself:
    # editing it in place is allowed (it is no view in autograd's eyes) and caught by backward
    x = randn(2, 3, 24, dtype=torch.bfloat16).requires_grad_()
    w = randn(40, 24, dtype=torch.bfloat16).requires_grad_()
    y = la.linear_act(x, w, None, "relu")
    assert "LinearActBackward" in y.grad_fn.name() and y._base is None
    y.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


@pytest.mark.parametrize("activation,recompute", [("gelu", False), ("relu", False), ("gelu", True)])
def test_cpp_autograd_node_lifecycle(cpu_kernels, activation, recompute):
    # the hand-written node as torch's own: what it saves goes through saved-tensor hooks (x, the
    # cast weight, then the bias if recomputing, then the hidden tensor: ReLU's is the output;
    # under autocast x and the parameters in bf16),
    # retain_graph replays, a second backward without it fails clearly, forward AD is refused
    x = randn(2, 3, 24, dtype=torch.float32).requires_grad_()
    w = randn(40, 24, dtype=torch.float32, scale=0.3).requires_grad_()
    b = randn(40, dtype=torch.float32).requires_grad_()
    packed = []
    with torch.autocast("cpu", dtype=torch.bfloat16), \
            torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or len(packed) - 1,
                                                     lambda i: packed[i]):
        y = la.linear_act(x, w, b, activation, recompute=recompute)
    assert len(packed) == 3 and all(t.dtype == torch.bfloat16 for t in packed) and packed[0].shape == x.shape
    assert (packed[2] is y) == (activation == "relu")
    g = randn(*y.shape, dtype=y.dtype)
    first = torch.autograd.grad(y, (x, w, b), g, retain_graph=True)
    again = torch.autograd.grad(y, (x, w, b), g)
    assert all(torch.equal(a, e) and a.dtype == torch.float32 for a, e in zip(first, again))
    with pytest.raises(RuntimeError, match="second time"):
        torch.autograd.grad(y, (x,), g)
    import torch.autograd.forward_ad as fwAD
    for weight in (w.bfloat16(), w.detach().bfloat16()):  # building a graph or not
        with fwAD.dual_level(), pytest.raises(RuntimeError, match="forward-mode AD"):
            la.linear_act(fwAD.make_dual(x.detach().bfloat16(), torch.ones(2, 3, 24, dtype=torch.bfloat16)),
                          weight, None, activation)


def test_cpp_op_without_grad_runs_the_forward_alone(cpu_kernels):
    x, w = randn(5, 24, dtype=torch.bfloat16), randn(40, 24, dtype=torch.bfloat16).requires_grad_()
    with torch.no_grad():
        y = la.linear_act(x, w, None, "gelu")
    assert y.grad_fn is None
    with torch.inference_mode():
        y2 = la.linear_act(x, w, None, "gelu")
    assert torch.equal(y, y2) and torch.equal(y, reference.act_fwd(F.linear(x, w.detach()), "gelu"))
