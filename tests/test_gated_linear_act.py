"""gated_linear_act: h = act(x Wg^T + bg) * (x Wu^T + bu), and gated_mlp / FusedGatedMLP, every
backend against float64 math.

CPU tier: the torch backend (fp32), the Triton kernels under TRITON_INTERPRET=1 (fp16), what
backward saves, the in-place backward under retain_graph, packed weights, autocast with fp32
master weights, errors, dispatch, opcheck, torch.compile(fullgraph).
GPU tier (`pytest -m gpu`): cuda, triton and torch for every activation x dtype x bias mix,
odd shapes, autocast, packed weights, the CUDA passes against the reference, memory.

Tolerances as tests/test_linear_act.py: outputs within TOL, gradients with factor 2 (dg and du are
rounded to the compute dtype before the backward's GEMMs).
"""
import math
import os

import pytest
import torch
import torch.nn.functional as F

import ampkernels
import ampkernels.nn
from ampkernels import _extension, backends, reference
from ampkernels.ops import gated_linear_act as gla
from ampkernels.ops import linear_act as la
from ampkernels.ops.shared import autocast_dtypes
from tests.utils import assert_rel_close, randn

os.environ.setdefault("AMPKERNELS_TRITON_AUTOTUNE", "0")  # one config per kernel (see test_linear_act.py)

ACTS = reference.GATED_ACTIVATIONS
HAS_CUDA = torch.cuda.is_available()
GRAD_FACTOR = 2
BIASES = [(True, True), (True, False), (False, True), (False, False)]
_TRITON_OPS = backends._available("triton")[0] and _extension.load()  # the ops live in the extension
needs_triton = pytest.mark.skipif(not _TRITON_OPS, reason="triton unavailable, or the extension (the ops) not built")
cpu_triton = pytest.mark.skipif(HAS_CUDA or not _TRITON_OPS,
                                reason="CPU interpreter tier with the extension (the GPU tier covers triton on CUDA)")


def _inputs(m, k, h, dtype, device, biases=(True, True), lead=(), packed=False):
    x = randn(*lead, m, k, dtype=dtype, device=device)
    if packed:  # two halves of one (2H, K) parameter, as timm GluMlp's fc1
        w = randn(2 * h, k, dtype=dtype, device=device, scale=1 / math.sqrt(k))
        wg, wu = w[:h], w[h:]
    else:
        wg = randn(h, k, dtype=dtype, device=device, scale=1 / math.sqrt(k))
        wu = randn(h, k, dtype=dtype, device=device, scale=1 / math.sqrt(k))
    bg = randn(h, dtype=dtype, device=device, scale=0.5) if biases[0] else None
    bu = randn(h, dtype=dtype, device=device, scale=0.5) if biases[1] else None
    return x, wg, wu, bg, bu


def _leaf(t, dtype=None):
    return None if t is None else t.detach().to(dtype or t.dtype).requires_grad_()


def _check(x, wg, wu, bg, bu, activation, backend, factor=1.0, compute_dtype=None, **kw):
    """Forward and every gradient of gated_linear_act against float64 autograd. compute_dtype: the
    output dtype when it differs from x's (autocast)."""
    ins = [_leaf(t) for t in (x, wg, wu, bg, bu)]
    h = ampkernels.gated_linear_act(*ins, activation, backend=backend, **kw)
    dtype = compute_dtype or x.dtype
    assert h.dtype == dtype and h.shape == (*x.shape[:-1], wg.shape[0])
    ref_ins = [_leaf(t, torch.float64) for t in (x, wg, wu, bg, bu)]
    h64 = reference.gated_linear_act(*ref_ins, activation)
    assert_rel_close(h, h64, dtype, factor=factor, what=f"{backend} {activation} h")
    dh = torch.randn_like(h)
    h.backward(dh)
    h64.backward(dh.double())
    for name, got, want in zip(("dx", "dWg", "dWu", "dbg", "dbu"), ins, ref_ins):
        if got is None:
            continue
        assert got.grad.dtype == got.dtype, name  # each gradient in its parameter's dtype
        assert_rel_close(got.grad, want.grad, dtype, factor=GRAD_FACTOR * factor, what=f"{backend} {activation} {name}")


# ---------------------------------------------------------------- CPU tier: reference and torch path

@pytest.mark.parametrize("activation", ACTS)
def test_reference_matches_float64_math(activation):
    x, wg, wu, bg, bu = (t.double() for t in _inputs(5, 12, 7, torch.float32, "cpu"))
    g, u = x @ wg.T + bg, x @ wu.T + bu
    act = {"silu": lambda z: z * torch.sigmoid(z), "gelu": lambda z: 0.5 * z * (1 + torch.erf(z / math.sqrt(2))),
           "gelu_tanh": lambda z: 0.5 * z * (1 + torch.tanh(math.sqrt(2 / math.pi) * (z + 0.044715 * z**3)))}
    torch.testing.assert_close(reference.gated_linear_act(x, wg, wu, bg, bu, activation), act[activation](g) * u)
    dh = torch.randn_like(g)
    dg, du = reference.gated_act_backward(dh, g, u, activation)
    gl, ul = g.clone().requires_grad_(), u.clone().requires_grad_()
    (act[activation](gl) * ul).backward(dh)
    torch.testing.assert_close(dg, gl.grad)
    torch.testing.assert_close(du, ul.grad)


@pytest.mark.parametrize("activation", ACTS)
@pytest.mark.parametrize("biases", BIASES)
@pytest.mark.parametrize("recompute", [False, True])
def test_torch_backend_fp32(activation, biases, recompute):
    _check(*_inputs(9, 20, 12, torch.float32, "cpu", biases, lead=(2,)), activation, "torch", recompute=recompute)


def test_fp32_and_fp64_without_autocast_take_the_torch_path():
    for dtype in (torch.float32, torch.float64):
        x, wg, wu, bg, bu = (_leaf(t) for t in _inputs(4, 8, 6, dtype, "cpu"))
        h = ampkernels.gated_linear_act(x, wg, wu, bg, bu)
        assert "GatedLinearAct" not in type(h.grad_fn).__name__  # torch's own autograd nodes
        torch.testing.assert_close(h, F.silu(F.linear(x, wg, bg)) * F.linear(x, wu, bu))


@pytest.mark.parametrize("biases", [(True, True), (False, False)])
def test_packed_and_separate_weights_agree(cpu_kernels, biases):
    # two halves of one parameter take one GEMM each way (the dx GEMM here): the same results
    x, wg, wu, bg, bu = (_leaf(t) for t in _inputs(7, 16, 10, torch.float32, "cpu", biases, packed=True))
    outs = []
    for a, b in ((wg, wu), (_leaf(wg), _leaf(wu))):
        h = ampkernels.gated_linear_act(x, a, b, bg, bu)
        outs.append((h, *torch.autograd.grad(h, (x, a, b), torch.ones_like(h))))
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b)


def _saved_shapes(fn):
    shapes = []

    def pack(t):
        shapes.append(tuple(t.shape))
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, shapes


@pytest.mark.parametrize("recompute", [False, True])
def test_backward_saves_one_gated_buffer_and_never_h(cpu_kernels, recompute):
    m, k, h = 6, 16, 10
    x, wg, wu, bg, bu = (_leaf(t) for t in _inputs(m, k, h, torch.float32, "cpu"))
    out, shapes = _saved_shapes(lambda: ampkernels.gated_linear_act(x, wg, wu, bg, bu, recompute=recompute))
    assert (m, h) not in shapes, shapes
    assert shapes.count((m, 2 * h)) == (0 if recompute else 1), shapes
    out.sum().backward()


def test_retain_graph_backward_twice_gives_the_same_grads(cpu_kernels):
    # backward writes dg, du over the saved g|u buffer only when nothing reads it later
    x, wg, wu, bg, bu = (_leaf(t) for t in _inputs(6, 16, 10, torch.float32, "cpu"))
    h = ampkernels.gated_linear_act(x, wg, wu, bg, bu, "gelu")
    dh = torch.randn_like(h)
    h.backward(dh, retain_graph=True)
    first = [t.grad.clone() for t in (x, wg, wu, bg, bu)]
    for t in (x, wg, wu, bg, bu):
        t.grad = None
    h.backward(dh)
    for a, t in zip(first, (x, wg, wu, bg, bu)):
        torch.testing.assert_close(t.grad, a)


def test_in_place_backward_when_the_graph_is_freed(cpu_kernels):
    x, wg, wu, bg, bu = (_leaf(t) for t in _inputs(6, 16, 10, torch.float32, "cpu"))
    packed = []  # (the saved tensor, its values when saved)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append((t, t.clone())) or t, lambda t: t):
        h = ampkernels.gated_linear_act(x, wg, wu, bg, bu, "silu")
        h.sum().backward()
    saved, gu = next(p for p in packed if p[0].shape == (6, 20))
    assert not torch.equal(saved, gu)  # overwritten with dg | du
    dg, du = reference.gated_act_backward(torch.ones(6, 10), gu[:, :10], gu[:, 10:], "silu")
    torch.testing.assert_close(saved, torch.cat([dg, du], 1))


def test_no_grad_builds_no_graph():
    x, wg, wu, bg, bu = (_leaf(t) for t in _inputs(4, 8, 6, torch.float32, "cpu"))
    with torch.no_grad():
        assert ampkernels.gated_linear_act(x, wg, wu, bg, bu).grad_fn is None


def test_cpu_autocast_casts_like_f_linear():
    x, wg, wu, bg, bu = _inputs(4, 8, 6, torch.float32, "cpu")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = ampkernels.gated_linear_act(x, wg, wu, bg, bu, "gelu_tanh")
        want = F.gelu(F.linear(x, wg, bg), approximate="tanh") * F.linear(x, wu, bu)
    assert h.dtype == torch.bfloat16
    torch.testing.assert_close(h, want)


def test_torch_path_under_autocast_is_the_eager_block_bit_for_bit():
    # F.linear's autocast casts the fp32 parameters on the torch backend: the eager block's bits,
    # forward and backward, for gated_linear_act and gated_mlp
    x, wg, wu, bg, bu = (t.requires_grad_() for t in _inputs(4, 8, 6, torch.float32, "cpu"))
    wd, bd = torch.randn(5, 6, requires_grad=True), torch.randn(5, requires_grad=True)
    leaves = (x, wg, wu, bg, bu, wd, bd)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = gla.gated_mlp(x, wg, wu, bg, bu, wd, bd, "silu", backend="torch")
        want = F.linear(F.silu(F.linear(x, wg, bg)) * F.linear(x, wu, bu), wd, bd)
    assert out.dtype == torch.bfloat16 and torch.equal(out, want)
    dy = torch.randn_like(out)
    got, exp = torch.autograd.grad(out, leaves, dy), torch.autograd.grad(want, leaves, dy)
    assert all(torch.equal(g, e) and g.dtype == e.dtype for g, e in zip(got, exp))


def test_bad_inputs_are_clear_errors():
    x, wg, wu, bg, bu = _inputs(4, 8, 6, torch.float32, "cpu")
    f = ampkernels.gated_linear_act
    with pytest.raises(ValueError, match="activation must be one of"):
        f(x, wg, wu, activation="relu")
    with pytest.raises(TypeError, match="up_weight must be a Tensor"):
        f(x, wg, None)
    with pytest.raises(ValueError, match="up_weight must have gate_weight's shape"):
        f(x, wg, wu[:5])
    with pytest.raises(ValueError, match="x's last dim"):
        f(x[:, :7], wg, wu)
    with pytest.raises(ValueError, match="up_bias must have shape"):
        f(x, wg, wu, bg, bu[:3])
    with pytest.raises(TypeError, match="gate_bias must be a floating-point"):
        f(x, wg, wu, torch.ones(6, dtype=torch.int64))
    with pytest.raises(TypeError, match=r"up_weight torch.float16"):
        f(x, wg, wu.half(), bg, bu)
    with pytest.raises(TypeError, match=r"gate_bias torch.float64"):
        f(x, wg, wu, bg.double(), bu)
    with pytest.raises(ValueError, match="down_weight must be"):
        gla.gated_mlp(x, wg, wu, bg, bu, torch.randn(3, 5), None)


@pytest.mark.skipif(HAS_CUDA, reason="CPU-only behaviour")
def test_explicit_cuda_on_cpu_is_a_clear_error():
    x, wg, wu, _, _ = _inputs(4, 8, 6, torch.float16, "cpu")
    with pytest.raises(RuntimeError, match="gated_linear_act: backend 'cuda' needs CUDA tensors"):
        ampkernels.gated_linear_act(x, wg, wu, backend="cuda")


def test_auto_preference(monkeypatch):
    import types
    cuda = torch.device("cuda", 0)
    for major in (9, 8):
        monkeypatch.setattr(gla, "device_properties", lambda index, major=major: types.SimpleNamespace(major=major))
        assert gla.preference(cuda, torch.bfloat16, "silu", "large", True) == ("cuda", "triton")
        assert gla.preference(cuda, torch.bfloat16, "silu", "large", False) == ("cuda", "triton")
        assert gla.preference(cuda, torch.bfloat16, "silu", "medium", True) == ("cuda", "triton")
        # Hopper inference in the medium bucket: the Triton ping-pong kernel first
        want = ("triton", "cuda") if major == 9 else ("cuda", "triton")
        assert gla.preference(cuda, torch.float16, "gelu_tanh", "medium", False) == want
        assert gla.preference(cuda, torch.bfloat16, "silu", "large", True, compiling=True) == ("torch",)
        torch.use_deterministic_algorithms(True)
        try:
            assert gla.preference(cuda, torch.float16, "silu", "medium", False) == ("cuda",)
        finally:
            torch.use_deterministic_algorithms(False)
    # the extension's eager entry declines exactly those cells (the Python path then decides)
    from ampkernels.ops.shared import gemm_entry_key
    assert set(gla._NOT_CUDA_FIRST) == {gemm_entry_key(la.ACT_ID[a], 9, dt, "medium", False) for a in ACTS
                                        for dt in (torch.float16, torch.bfloat16)}
    assert not any(gla._NOT_CUDA_FIRST.values())  # none of them is torch-first
    x, wg, wu, _, _ = _inputs(4, 8, 6, torch.float16, "cpu")
    assert gla._choose(None, x.device, x.dtype, "silu", "small", False, None, False) == "torch"


# ---------------------------------------------------------------- CPU tier: Triton under the interpreter

@cpu_triton
@pytest.mark.parametrize("activation", ACTS)
@pytest.mark.parametrize("biases", BIASES)
def test_triton_fp16(activation, biases):
    _check(*_inputs(40, 48, 36, torch.float16, "cpu", biases), activation, "triton")


@cpu_triton
@pytest.mark.parametrize("shape", [(1, 16, 8), (7, 13, 7), (33, 40, 20), (3, 70, 45)])
def test_triton_odd_shapes(shape):
    m, k, h = shape
    _check(*_inputs(m, k, h, torch.float16, "cpu"), "silu", "triton")


@cpu_triton
def test_triton_non_contiguous_x_packed_weights_and_recompute():
    x, wg, wu, bg, bu = _inputs(24, 32, 20, torch.float16, "cpu", packed=True)
    big = randn(24, 64, dtype=torch.float16)
    x = big[:, ::2]  # non-contiguous
    _check(x, wg, wu, bg, bu, "gelu", "triton")
    _check(x, wg, wu, bg, bu, "gelu_tanh", "triton", recompute=True)


@cpu_triton
@pytest.mark.parametrize("activation", ACTS)
def test_triton_kernels_against_the_reference(activation):
    x, wg, wu, bg, bu = _inputs(40, 32, 36, torch.float16, "cpu")
    from ampkernels.triton import gated_linear_act as tk
    aid = reference.activation_id(activation)
    h, gu = tk.gated_linear_act_fwd(x, wg, wu, bg, bu, aid, True)
    want_gu = torch.cat([F.linear(x.float(), wg.float(), bg.float()), F.linear(x.float(), wu.float(), bu.float())], 1)
    assert_rel_close(gu, want_gu.double(), torch.float16, what="gu")
    assert torch.equal(tk.gated_act_forward(gu, aid), h)  # the recomputation is the forward's h, bit for bit
    h2, empty = tk.gated_linear_act_fwd(x, wg, wu, bg, bu, aid, False)
    assert torch.equal(h2, h) and empty.shape == (0, 0)
    dh = randn(40, 36, dtype=torch.float16)
    dgu = torch.full_like(gu, float("nan"))
    db = tk.gated_act_backward(dh, gu, dgu, aid, True)
    dg, du = reference.gated_act_backward(dh.double(), gu[:, :36].double(), gu[:, 36:].double(), activation)
    assert_rel_close(dgu, torch.cat([dg, du], 1), torch.float16, what="dgu")
    assert db.dtype == torch.float32
    torch.testing.assert_close(db, dgu.float().sum(0), rtol=1e-5, atol=1e-4)
    inplace = gu.clone()
    tk.gated_act_backward(dh, inplace, inplace, aid, False)
    assert torch.equal(inplace, dgu)


@cpu_triton
@pytest.mark.parametrize("recompute", [False, True])
def test_triton_fp32_master_weights_under_autocast(recompute):
    # CPU autocast to fp16 (the interpreter's 16-bit type): weights cast inside, into one packed buffer
    x, wg, wu, bg, bu = _inputs(20, 32, 24, torch.float32, "cpu")
    with torch.autocast("cpu", dtype=torch.float16):
        _check(x, wg, wu, bg, bu, "silu", "triton", compute_dtype=torch.float16, recompute=recompute)


@cpu_triton
def test_triton_empty_inputs():
    x, wg, wu, bg, bu = _inputs(0, 16, 8, torch.float16, "cpu")
    h = ampkernels.gated_linear_act(x, wg, wu, bg, bu, backend="triton")
    assert h.shape == (0, 8)
    x = randn(3, 0, dtype=torch.float16)  # K = 0: g, u are the biases
    h = ampkernels.gated_linear_act(x, wg[:, :0], wu[:, :0], bg, bu, backend="triton")
    torch.testing.assert_close(h, (F.silu(bg.float()) * bu.float()).half().expand(3, 8))


# ---------------------------------------------------------------- CPU tier: the gated MLP block

def _mlp_check(backend, dtype, activation="silu", biases=(False, False), down_bias=False, cast=False):
    m, k, h, n = 18, 32, 40, 24
    x, wg, wu, bg, bu = _inputs(m, k, h, torch.float32 if cast else dtype, "cpu", biases, lead=(2,))
    wd = randn(n, h, dtype=torch.float32 if cast else dtype, scale=1 / math.sqrt(h))
    bd = randn(n, dtype=wd.dtype, scale=0.5) if down_bias else None
    ins = [_leaf(t) for t in (x, wg, wu, bg, bu, wd, bd)]
    ctx = torch.autocast("cpu", dtype=dtype) if cast else torch.autocast("cpu", enabled=False)
    with ctx:
        out, shapes = _saved_shapes(lambda: gla.gated_mlp(*ins, activation, backend=backend))
    assert out.dtype == dtype and out.shape == (2, m, n)
    refs = [_leaf(t, torch.float64) for t in (x, wg, wu, bg, bu, wd, bd)]
    want = F.linear(reference.gated_linear_act(*refs[:5], activation), refs[5], refs[6])
    assert_rel_close(out, want, dtype, what="out")
    dout = torch.randn_like(out)
    out.backward(dout)
    want.backward(dout.double())
    for name, got, ref in zip(("dx", "dWg", "dWu", "dbg", "dbu", "dWd", "dbd"), ins, refs):
        if got is not None:
            assert got.grad.dtype == got.dtype, name
            assert_rel_close(got.grad, ref.grad, dtype, factor=GRAD_FACTOR * 2, what=name)
    return shapes


@cpu_triton
@pytest.mark.parametrize("activation", ACTS)
def test_gated_mlp_triton_keeps_h_out_of_the_saved_tensors(activation):
    shapes = _mlp_check("triton", torch.float16, activation, biases=(True, False), down_bias=True)
    assert (36, 40) not in shapes and shapes.count((36, 80)) == 1, shapes


@cpu_triton
def test_gated_mlp_triton_fp32_master_weights_under_autocast():
    _mlp_check("triton", torch.float16, "gelu_tanh", biases=(True, True), down_bias=True, cast=True)


def test_gated_mlp_torch_path():
    _mlp_check("torch", torch.float32, "gelu", biases=(True, True), down_bias=True)


# ---------------------------------------------------------------- the ops' C++ autograd

@pytest.mark.parametrize("activation", gla.ACTIVATIONS)
@pytest.mark.parametrize("master", [False, True])
@pytest.mark.parametrize("biases", [(True, True, True), (False, False, False), (False, True, True)])
@pytest.mark.parametrize("lead", [(7,), (2, 3)])
@pytest.mark.parametrize("op", ["gated_mlp", "gated_linear_act", "gated_linear_act recompute"])
def test_cpp_autograd_matches_torch_backend(cpu_kernels, activation, master, biases, lead, op):
    # x of any rank goes to the op as it is (the rows are viewed below autograd); master weights
    # cast inside (packed) with fp32 gradients; a kept graph leaves gu as it was
    k, hidden, n = 24, 20, 16
    pdt = torch.float32 if master else torch.bfloat16
    mlp = op == "gated_mlp"
    for grads_of in ("all", "x", "weights"):
        x = randn(*lead, k, dtype=torch.float32 if master else torch.bfloat16).requires_grad_(grads_of != "weights")
        wg, wu = (randn(hidden, k, dtype=pdt, scale=0.3).requires_grad_(grads_of != "x") for _ in range(2))
        wd = randn(n, hidden, dtype=pdt, scale=0.3).requires_grad_(grads_of != "x")
        bg, bu, bd = (randn(d, dtype=pdt).requires_grad_(grads_of == "all") if on else None
                      for on, d in zip(biases, (hidden, hidden, n)))
        params = (wg, wu, bg, bu, wd, bd) if mlp else (wg, wu, bg, bu)
        leaves = [t for t in (x, *params) if t is not None and t.requires_grad]
        g = randn(*lead, n if mlp else hidden, dtype=torch.bfloat16)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=master):
            if mlp:
                out = gla.gated_mlp(x, *params, activation)  # "cuda" (patched): the op
            else:
                out = gla.gated_linear_act(x, *params, activation, recompute=op.endswith("recompute"))
            x2, cast_to = autocast_dtypes(op, x, params, ("w",) * len(params))
            want = gla._torch_gated_linear_act(x2, wg, wu, bg, bu, activation, cast_to, False)
            if mlp:
                cd = (lambda t: t if t is None or cast_to is None else t.to(cast_to))  # noqa: E731
                want = F.linear(want, cd(wd), cd(bd))
        assert ("GatedMLPTrain" if mlp else "GatedLinearActTrain") in out.grad_fn.name()
        assert out._base is None and out.shape == want.shape and out.dtype == want.dtype
        assert_rel_close(out, want.double(), torch.bfloat16)
        if grads_of == "all":
            kept = torch.autograd.grad(out, leaves, g, retain_graph=True)
            for a, e in zip(kept, torch.autograd.grad(out, leaves, g, retain_graph=True)):
                assert torch.equal(a, e)
        for t, a, e in zip(leaves, torch.autograd.grad(out, leaves, g), torch.autograd.grad(want, leaves, g)):
            assert a.dtype == e.dtype == t.dtype
            assert_rel_close(a, e.double(), torch.bfloat16, factor=2 * GRAD_FACTOR,
                             what=f"{op} {activation} grad of {tuple(t.shape)}")


def test_fused_gated_mlp_is_llama_mlp():
    T = pytest.importorskip("transformers")
    cfg = T.LlamaConfig(hidden_size=32, intermediate_size=48, mlp_bias=True)
    from transformers.models.llama.modeling_llama import LlamaMLP
    hf = LlamaMLP(cfg)
    ours = ampkernels.nn.FusedGatedMLP(32, 48, bias=True)
    assert ours.state_dict().keys() == hf.state_dict().keys()
    ours.load_state_dict(hf.state_dict())
    x = torch.randn(2, 5, 32)
    torch.testing.assert_close(ours(x), hf(x))
    hf.load_state_dict(ours.state_dict())
    with pytest.raises(ValueError, match="activation must be one of"):
        ampkernels.nn.FusedGatedMLP(8, 16, activation="relu")


# ---------------------------------------------------------------- CPU tier: opcheck, compile

def _opcheck(backend, dtype):
    """The ops (their fakes, their C++ autograd on `backend`'s kernels, traced too) and the
    kernel ops."""
    x, wg, wu, bg, bu = _inputs(8, 32, 16, dtype, "cpu")
    wd, bd = randn(24, 16, dtype=dtype), randn(24, dtype=dtype)
    silu, gelu = reference.activation_id("silu"), reference.activation_id("gelu")
    leaf = lambda t: None if t is None else t.detach().requires_grad_()  # noqa: E731
    f32 = lambda t: leaf(t.float())  # noqa: E731
    gla_op, mlp_op = torch.ops.ampkernels.gated_linear_act.default, torch.ops.ampkernels.gated_mlp.default
    torch.library.opcheck(gla_op, (x, wg, wu, bg, bu, silu, None, False, backend))
    for recompute in (False, True):
        torch.library.opcheck(gla_op, (*(leaf(t) for t in (x, wg, wu, None, bu)), gelu, None, recompute, backend))
    torch.library.opcheck(gla_op, (leaf(x.reshape(2, 4, 32)), *(f32(t) for t in (wg, wu, bg, bu)), silu, dtype, False,
                                   backend))
    torch.library.opcheck(mlp_op, (*(leaf(t) for t in (x, wg, wu, bg, bu, wd, bd)), silu, None, backend))
    torch.library.opcheck(mlp_op, (leaf(x), *(f32(t) for t in (wg, wu, bg, bu, wd, bd)), gelu, dtype, backend))
    kernels = {name: getattr(torch.ops.ampkernels, f"{name}_{backend}").default
               for name in ("gated_linear_act_fwd", "gated_act_fwd", "gated_act_bwd")}
    torch.library.opcheck(kernels["gated_linear_act_fwd"], (x, wg, wu, bg, bu, silu, True))
    torch.library.opcheck(kernels["gated_linear_act_fwd"], (x, wg, wu, None, bu, gelu, False))
    gu = randn(8, 32, dtype=dtype)
    torch.library.opcheck(kernels["gated_act_fwd"], (gu, silu))
    torch.library.opcheck(kernels["gated_act_bwd"], (randn(8, 16, dtype=dtype), gu, torch.empty_like(gu), silu, True))


def test_opcheck_cpu_cpu_kernels(cpu_kernels):
    _opcheck("cuda", torch.float32)


@cpu_triton
def test_opcheck_cpu_triton_interpret():
    _opcheck("triton", torch.float16)


@pytest.mark.parametrize("backend", ["torch", "auto"] + ([pytest.param("triton", marks=needs_triton)] if not HAS_CUDA
                                                          else []))
@pytest.mark.parametrize("recompute", [False, True])
def test_compile_fullgraph_cpu(backend, recompute):
    dtype = torch.float16 if backend == "triton" else torch.float32
    x, wg, wu, bg, bu = (_leaf(t) for t in _inputs(6, 32, 16, dtype, "cpu", lead=(2,)))
    torch._dynamo.reset()
    fn = torch.compile(lambda *a: ampkernels.gated_linear_act(*a, activation="gelu", backend=backend,
                                                              recompute=recompute),
                       fullgraph=True, backend="aot_eager")
    h = fn(x, wg, wu, bg, bu)
    want = reference.gated_linear_act(*(t.detach().double() for t in (x, wg, wu, bg, bu)), "gelu")
    assert_rel_close(h, want, dtype, factor=5)
    h.sum().backward()
    assert all(t.grad is not None for t in (x, wg, wu, bg, bu))


@cpu_triton
def test_benchmark_runs_and_reports(tmp_path):
    # the benchmark's code path on a tiny CPU shape (numbers meaningless), then its report
    from ampkernels.bench import bench_gated_linear_act as bg
    from ampkernels.bench.common import Recorder
    rec = Recorder(str(tmp_path))
    bg.run(rec, [torch.float16], quick=True, device="cpu", shapes=[(32, 32, 48)])
    providers = {r["provider"] for r in rec.rows}
    assert "error" not in providers, [r for r in rec.rows if r["provider"] == "error"]
    assert {"matmul", "eager", "ampkernels-triton", "ampkernels"} <= providers
    assert all(r.get("rel_err", 0) < 1e-2 for r in rec.rows), rec.rows
    lines = bg.report(rec.rows)  # "auto" is the row judged
    assert any("of the packed matmul's speed [ampkernels]" in line for line in lines), lines
    assert any("x eager (>= 1.0)" in line for line in lines), lines


needs_ext = pytest.mark.skipif(not _extension.load(), reason=f"extension not built: {_extension.status()[1]}")


@needs_ext
@pytest.mark.parametrize("name", ["gated_linear_act_fwd_cuda", "gated_act_fwd_cuda", "gated_act_bwd_cuda"])
def test_extension_schemas(name):
    assert getattr(torch.ops.ampkernels, name).default._schema.name == f"ampkernels::{name}"


# ---------------------------------------------------------------- GPU tier

GPU_DTYPES = [torch.float16, torch.bfloat16]


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cuda", "triton", "torch"])
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("activation", ACTS)
@pytest.mark.parametrize("biases", BIASES)
def test_gpu_backends_match_float64(backend, dtype, activation, biases):
    _check(*_inputs(300, 256, 384, dtype, "cuda", biases), activation, backend)
    _check(*_inputs(300, 256, 384, dtype, "cuda", biases, packed=True), activation, backend, recompute=True)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cuda", "triton"])
@pytest.mark.parametrize("shape", [(1, 64, 128), (7, 13, 7), (33, 72, 40), (65, 8, 24), (129, 100, 45)])
def test_gpu_odd_shapes(backend, shape):
    m, k, h = shape
    for activation in ACTS:
        _check(*_inputs(m, k, h, torch.bfloat16, "cuda"), activation, backend)
    big = randn(m, 2 * k, dtype=torch.float16, device="cuda")
    _check(big[:, ::2], *_inputs(m, k, h, torch.float16, "cuda")[1:], "silu", backend)  # non-contiguous x


def _hopper_pingpong():
    if not (HAS_CUDA and _TRITON_OPS):
        return False
    from ampkernels.triton import linear_act as tla
    return tla.pingpong_enabled(torch.device("cuda"))


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper_pingpong(), reason="the Gluon ping-pong kernel runs on Hopper")
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("shape", [(300, 520, 200), (2048, 256, 1024), (1, 64, 8), (130, 8, 72)])
def test_gpu_pingpong_gated_kernel(dtype, shape):
    # the warp-specialized forward (both consumers: more tiles than SMs in the second shape; row,
    # column and K tails in the first), separate and packed weights, every bias mix and
    # activation, gu stored and not: against float64, h from its own g and u bit for bit (the
    # recomputation in gated_mlp's backward), and the same h whether gu is stored
    from ampkernels.triton import gated_linear_act as tk
    from ampkernels.triton import linear_act_pingpong as pp
    m, k, hid = shape
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for packed, biases in ((False, (True, True)), (True, (False, False)), (False, (False, True))):
        x, wg, wu, bg, bu = _inputs(m, k, hid, dtype, "cuda", biases, packed=packed)
        assert tk._pingpong_ok(x, wg, wu, x.new_empty(m, hid), x.new_empty(m, 2 * hid), True)
        for activation in ACTS:
            aid = reference.activation_id(activation)
            h = torch.full((m, hid), float("nan"), dtype=dtype, device="cuda")
            gu = torch.full((m, 2 * hid), float("nan"), dtype=dtype, device="cuda")
            pp.gated_linear_act_fwd_pingpong(x, wg, wu, bg, bu, aid, h, gu, sms)
            f64 = [None if t is None else t.double() for t in (x, wg, wu, bg, bu)]
            want_gu = torch.cat([F.linear(f64[0], f64[1], f64[3]), F.linear(f64[0], f64[2], f64[4])], 1)
            assert_rel_close(gu, want_gu, dtype, what=f"{activation} gu")
            assert_rel_close(h, reference.gated_linear_act(*f64, activation), dtype, what=f"{activation} h")
            assert torch.equal(tk.gated_act_forward(gu, aid), h), activation
            h2 = torch.full_like(h, float("nan"))
            pp.gated_linear_act_fwd_pingpong(x, wg, wu, bg, bu, aid, h2, None, sms)
            assert torch.equal(h2, h), activation


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cuda", "triton"])
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("recompute", [False, True])
def test_gpu_fp32_master_weights_under_autocast(backend, dtype, recompute):
    x, wg, wu, bg, bu = _inputs(256, 128, 192, torch.float32, "cuda")
    with torch.autocast("cuda", dtype=dtype):
        _check(x, wg, wu, bg, bu, "silu", backend, compute_dtype=dtype, recompute=recompute)
        _check(x, wg, wu, None, bu, "gelu", backend, compute_dtype=dtype, recompute=recompute)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("activation", ACTS)
def test_gpu_cuda_ops_packed_and_separate_agree(dtype, activation):
    aid = reference.activation_id(activation)
    for biases in ((True, True), (False, False), (False, True)):
        x, wg, wu, bg, bu = _inputs(130, 96, 72, dtype, "cuda", biases, packed=True)
        h, gu = torch.ops.ampkernels.gated_linear_act_fwd_cuda(x, wg, wu, bg, bu, aid, True)
        h2, gu2 = torch.ops.ampkernels.gated_linear_act_fwd_cuda(x, wg.clone(), wu.clone(), bg, bu, aid, True)
        torch.testing.assert_close(h, h2)
        torch.testing.assert_close(gu, gu2)
        want = reference.gated_linear_act(x.double(), wg.double(), wu.double(),
                                          None if bg is None else bg.double(), None if bu is None else bu.double(),
                                          activation)
        assert_rel_close(h, want, dtype, what="h")
        assert torch.equal(torch.ops.ampkernels.gated_act_fwd_cuda(gu, aid), h)  # recomputation: the same bits
        h3, empty = torch.ops.ampkernels.gated_linear_act_fwd_cuda(x, wg, wu, bg, bu, aid, False)
        assert torch.equal(h3, h) and empty.shape == (0, 0)
        dh = randn(130, 72, dtype=dtype, device="cuda")
        dgu = torch.full_like(gu, float("nan"))
        db = torch.ops.ampkernels.gated_act_bwd_cuda(dh, gu, dgu, aid, True)
        dg, du = reference.gated_act_backward(dh.double(), gu[:, :72].double(), gu[:, 72:].double(), activation)
        assert_rel_close(dgu, torch.cat([dg, du], 1), dtype, what="dgu")
        torch.testing.assert_close(db, dgu.float().sum(0), rtol=1e-5, atol=1e-3)
        inplace = gu.clone()
        torch.ops.ampkernels.gated_act_bwd_cuda(dh, inplace, inplace, aid, False)
        assert torch.equal(inplace, dgu)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cuda", "triton"])
@pytest.mark.parametrize("dtype", GPU_DTYPES)
def test_gpu_gated_mlp_and_module(backend, dtype):
    x = randn(4, 33, 64, dtype=torch.float32, device="cuda", requires_grad=True)
    mod = ampkernels.nn.FusedGatedMLP(64, 176, activation="gelu_tanh", bias=True, device="cuda", backend=backend)
    ref = ampkernels.nn.FusedGatedMLP(64, 176, activation="gelu_tanh", bias=True, device="cuda", backend="torch")
    ref.load_state_dict(mod.state_dict())
    with torch.autocast("cuda", dtype=dtype):
        out, shapes = _saved_shapes(lambda: mod(x))
        want = ref(x)
    assert (132, 176) not in shapes, shapes  # h is recomputed, not saved
    assert_rel_close(out, want.double(), dtype, factor=2)
    out.float().sum().backward()
    xr = x.detach().clone().requires_grad_()
    with torch.autocast("cuda", dtype=dtype):
        ref(xr).float().sum().backward()
    for (name, p), q in zip(mod.named_parameters(), ref.parameters()):
        assert p.grad.dtype == torch.float32, name
        assert_rel_close(p.grad, q.grad.double(), dtype, factor=4, what=name)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cuda", "triton"])
def test_gpu_compile_fullgraph(backend):
    x, wg, wu, bg, bu = (_leaf(t) for t in _inputs(64, 128, 96, torch.bfloat16, "cuda"))
    torch._dynamo.reset()
    fn = torch.compile(lambda *a: ampkernels.gated_linear_act(*a, backend=backend), fullgraph=True)
    h = fn(x, wg, wu, bg, bu)
    assert_rel_close(h, reference.gated_linear_act(*(t.detach().double() for t in (x, wg, wu, bg, bu))), torch.bfloat16)
    h.float().sum().backward()
    assert all(t.grad is not None for t in (x, wg, wu, bg, bu))


@pytest.mark.gpu
def test_gpu_gated_mlp_saves_less_than_eager():
    # T=4096 tokens, 1024 -> 2816: eager keeps g, u, act(g) and h; FusedGatedMLP keeps g|u only
    torch.manual_seed(0)
    mod = ampkernels.nn.FusedGatedMLP(1024, 2816, device="cuda", dtype=torch.bfloat16, backend="cuda")
    x = randn(4096, 1024, dtype=torch.bfloat16, device="cuda", requires_grad=True)

    def eager():
        g, u, d = mod.gate_proj, mod.up_proj, mod.down_proj
        return d(F.silu(g(x)) * u(x))

    def saved_bytes(fn):
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        out = fn()
        torch.cuda.synchronize()
        used = torch.cuda.memory_allocated() - before
        out.float().sum().backward()
        return used
    saved_bytes(lambda: mod(x)), saved_bytes(eager)  # warm-up: cuBLAS workspaces, autotuning
    ours, theirs = saved_bytes(lambda: mod(x)), saved_bytes(eager)
    hidden = 4096 * 2816 * 2
    assert ours <= 2 * hidden + 4096 * 1024 * 2 * 2, ours / hidden
    assert theirs >= 4 * hidden, theirs / hidden


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cuda", "triton"])
@pytest.mark.parametrize("dtype", GPU_DTYPES)
def test_gpu_converted_timm_gated_blocks_match_under_autocast(backend, dtype):
    timm_layers = pytest.importorskip("timm.layers")
    import copy
    blocks = [timm_layers.SwiGLU(256, 704), timm_layers.GluMlp(256, 1408, act_layer=torch.nn.SiLU, gate_last=False),
              timm_layers.GluMlp(256, 1408, act_layer=torch.nn.GELU)]
    for blk in blocks:
        ref = torch.nn.Sequential(blk).cuda()
        model = copy.deepcopy(ref)
        _, report = ampkernels.nn.convert(model, backend=backend)
        assert len(report.replaced) == 1, str(report)
        x = randn(3, 77, 256, device="cuda")
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        with torch.autocast("cuda", dtype=dtype):
            out, want = model(xa), ref(xb)
        assert_rel_close(out.float(), want.double(), dtype, factor=2)
        out.float().sum().backward()
        want.float().sum().backward()
        assert_rel_close(xa.grad, xb.grad.double(), dtype, factor=4, what="dx")
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert p.grad.dtype == torch.float32, name
            assert_rel_close(p.grad, q.grad.double(), dtype, factor=4, what=name)
