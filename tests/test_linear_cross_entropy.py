"""linear_cross_entropy: every backend against float64 autograd of reference.linear_cross_entropy.

CPU tier: the reference against F.cross_entropy, the torch backend (fp32, fp16, bf16, fp64,
master weights under CPU autocast), the Triton row pass under TRITON_INTERPRET=1 (fp16),
several chunks per call (the chunk floor patched down), every reduction, label smoothing,
ignore_index (all ignored too), 1 token, bad inputs, GradScaler's overflow path, opcheck,
torch.compile(fullgraph), nn.LinearCrossEntropy.
GPU tier (`-m gpu`): cuda and triton at odd and real shapes (8192 x 768 x 50257 bf16), the
memory bound, autocast + GradScaler, compile.
"""
import math
import os
import pathlib
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import ampkernels
import ampkernels.nn
from ampkernels import _extension, reference
from ampkernels.ops import linear_cross_entropy as lce
from tests.utils import assert_rel_close, randn

HAS_CUDA = torch.cuda.is_available()
needs_triton = pytest.mark.skipif(not ampkernels.available_backends()["triton"][0], reason="triton unavailable")
CPU_TRITON = [] if HAS_CUDA else ["triton"]
GPU_DTYPES = [torch.float16, torch.bfloat16]


def _run_probe(code, env=None):
    """A script in a Python process of its own, from the repository root."""
    return subprocess.run([sys.executable, "-c", code], cwd=pathlib.Path(__file__).resolve().parents[1], env=env,
                          capture_output=True, text=True, timeout=300, check=False)


@pytest.fixture
def small_chunks(monkeypatch):
    # a chunk of about 3 rows at the CPU shapes below: every call runs several chunks
    monkeypatch.setattr(lce, "_CHUNK_MIN_ELEMS", 150)


def _inputs(m, k, v, dtype, device, bias=True, lead=(), ignore_frac=0.2):
    x = randn(*lead, m, k, dtype=dtype, device=device)
    w = randn(v, k, dtype=dtype, device=device, scale=2 / math.sqrt(k))  # logits ~ N(0, 4): peaked rows
    b = randn(v, dtype=dtype, device=device, scale=0.5) if bias else None
    t = torch.randint(0, v, (*lead, m), device=device)
    t[torch.rand(t.shape, device=device) < ignore_frac] = -100
    return x, w, b, t


def _grads64(x, w, b, t, dloss, **kw):
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    b64 = None if b is None else b.detach().double().requires_grad_()
    ref = reference.linear_cross_entropy(x64, w64, t, b64, **kw)
    ref.backward(dloss.double())
    return ref.detach(), x64.grad, w64.grad, None if b is None else b64.grad


def _check(x, w, b, t, backend, factor=2.0, dtype=None, reduction="mean", label_smoothing=0.0, ignore_index=-100,
           autocast_dtype=None):
    """Loss and dx/dW/db against float64 autograd of the reference, with a random grad_output."""
    x, w = x.detach().requires_grad_(), w.detach().requires_grad_()
    b = None if b is None else b.detach().requires_grad_()
    kw = dict(reduction=reduction, label_smoothing=label_smoothing, ignore_index=ignore_index)
    with torch.autocast(x.device.type, dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None):
        loss = ampkernels.linear_cross_entropy(x, w, t, b, backend=backend, **kw)
    dtype = dtype or autocast_dtype or x.dtype
    assert loss.dtype == (torch.float64 if x.dtype == torch.float64 else torch.float32)
    assert loss.shape == (t.shape if reduction == "none" else ())
    dloss = torch.rand_like(loss) + 0.5
    loss.backward(dloss)
    ref, dx, dw, db = _grads64(x, w, b, t, dloss, **kw)
    what = f"{backend} {dtype} {reduction} ls={label_smoothing}"
    assert_rel_close(loss, ref, dtype, factor=factor, what=what + " loss")
    assert x.grad.dtype == x.dtype and w.grad.dtype == w.dtype
    assert_rel_close(x.grad, dx, dtype, factor=factor, what=what + " dx")
    assert_rel_close(w.grad, dw, dtype, factor=factor, what=what + " dW")
    if b is not None:
        assert b.grad.dtype == b.dtype
        assert_rel_close(b.grad, db, dtype, factor=factor, what=what + " db")
    return loss


# ---------------------------------------------------------------- CPU tier: reference

@pytest.mark.parametrize("reduction", lce.REDUCTIONS)
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_reference_is_f_cross_entropy(reduction, label_smoothing):
    x, w, b, t = _inputs(23, 16, 37, torch.float64, "cpu")
    want = F.cross_entropy(F.linear(x, w, b), t, reduction=reduction, label_smoothing=label_smoothing)
    got = reference.linear_cross_entropy(x, w, t, b, reduction=reduction, label_smoothing=label_smoothing)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------- CPU tier: torch backend

@pytest.mark.parametrize("reduction", lce.REDUCTIONS)
@pytest.mark.parametrize("label_smoothing", [0.0, 0.15])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_torch_backend(small_chunks, dtype, bias, label_smoothing, reduction):
    x, w, b, t = _inputs(19, 24, 53, dtype, "cpu", bias=bias)
    _check(x, w, b, t, "torch", reduction=reduction, label_smoothing=label_smoothing)


@pytest.mark.parametrize("backend", ["torch"] + CPU_TRITON)
@pytest.mark.parametrize("shape", [(1, 8, 5), (3, 13, 7), (17, 40, 101), (9, 16, 2)])
def test_odd_shapes_and_one_token(small_chunks, backend, shape):
    m, k, v = shape
    dtype = torch.float16 if backend == "triton" else torch.float32
    for reduction in lce.REDUCTIONS:
        x, w, b, t = _inputs(m, k, v, dtype, "cpu", ignore_frac=0.0)
        _check(x, w, b, t, backend, reduction=reduction, label_smoothing=0.1)


@pytest.mark.parametrize("backend", ["torch", "torch-bf16"] + CPU_TRITON)
@pytest.mark.parametrize("reduction", lce.REDUCTIONS)
def test_padded_vocabulary(small_chunks, monkeypatch, backend, reduction):
    # the GEMMs over a vocabulary padded with zero weight rows (CUDA pads to a multiple of 64;
    # forced here on CPU, with a pad of 1 to 71 columns): the same loss and gradients. fp32
    # weights: one cast and padded copy; 16-bit: the aligned rows as they are and a padded copy
    # of the rest (V = 37: none aligned; V = 300: 256 rows and a tail), in both passes
    for pad in (1, 71):
        monkeypatch.setattr(lce, "padded_vocab", lambda v, x, pad=pad: v + pad)
        dtype = {"triton": torch.float16, "torch-bf16": torch.bfloat16}.get(backend, torch.float32)
        for bias, v in ((True, 37), (False, 37), (True, 300)):
            x, w, b, t = _inputs(13, 16, v, dtype, "cpu", bias=bias)
            _check(x, w, b, t, backend.split("-")[0], reduction=reduction, label_smoothing=0.1)


def test_weight_parts():
    w, b = randn(300, 8, dtype=torch.bfloat16), randn(300)
    parts = lce._weight_parts(w, b, torch.bfloat16, 320)
    assert [(c0, c1) for c0, c1, _, _ in parts] == [(0, 256), (256, 320)]
    assert parts[0][2].data_ptr() == w.data_ptr()  # the aligned rows: not copied
    assert torch.equal(parts[1][2][:44], w[256:]) and not parts[1][2][44:].any()
    assert parts[0][3].dtype == parts[1][3].dtype == torch.bfloat16 and not parts[1][3][44:].any()
    # fp32 master weights: one copy, cast and padded
    (c0, c1, wp, bp), = lce._weight_parts(w.float(), None, torch.bfloat16, 320)
    assert (c0, c1, wp.shape, wp.dtype, bp) == (0, 320, (320, 8), torch.bfloat16, None)


@pytest.mark.parametrize("backend", ["torch"] + CPU_TRITON)
@pytest.mark.parametrize("reduction", lce.REDUCTIONS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16bit_weights_vocabulary_pass(small_chunks, backend, reduction, dtype):
    # 16-bit weights: dW from the vocabulary pass, here in blocks of 64 columns (5 blocks of a
    # 300-word vocabulary, the last one 44 wide), with and without bias and smoothing
    assert lce.vocab_block_cols(19, 24, 300, lce._CHUNK_MIN_ELEMS) == 64
    if backend == "triton":
        dtype = torch.float16
    for bias, ls in ((True, 0.1), (False, 0.0)):
        x, w, b, t = _inputs(19, 24, 300, dtype, "cpu", bias=bias)
        _check(x, w, b, t, backend, reduction=reduction, label_smoothing=ls)


def test_vocab_block_cols():
    floor = lce._CHUNK_MIN_ELEMS
    # GPT-2's head: blocks of 384 columns (6 MiB of bf16 logits), Llama-3's: 2048 (32 MiB)
    assert lce.vocab_block_cols(8192, 768, 50257, floor) == 384
    assert lce.vocab_block_cols(8192, 4096, 128256, floor) == 2048
    # a few tokens: the whole vocabulary at once; no tokens: one empty block
    assert lce.vocab_block_cols(8, 768, 50257, floor) == 50257 and lce.vocab_block_cols(0, 8, 7, floor) == 7
    for m, k, v in ((4096, 512, 32000), (100000, 64, 1000), (300, 8, 129)):
        c = lce.vocab_block_cols(m, k, v, floor)
        assert c == v or (c % 64 == 0 and (c == 64 or m * c <= max(m * k // 2, floor // 32))), (m, k, v, c)


@pytest.mark.parametrize("backend", ["torch"] + CPU_TRITON)
def test_3d_input(small_chunks, backend):
    dtype = torch.float16 if backend == "triton" else torch.float32
    x, w, b, t = _inputs(7, 16, 33, dtype, "cpu", lead=(3,))
    _check(x, w, b, t, backend)
    _check(x, w, b, t, backend, reduction="none")


@pytest.mark.parametrize("backend", ["torch"] + CPU_TRITON)
@pytest.mark.parametrize("label_smoothing", [0.0, 0.2])
def test_all_ignored_is_torch_behaviour(backend, label_smoothing):
    dtype = torch.float16 if backend == "triton" else torch.float32
    x, w, b, t = _inputs(6, 16, 12, dtype, "cpu")
    t.fill_(-100)
    for reduction in lce.REDUCTIONS:
        xs, ws, bs = (a.detach().requires_grad_() for a in (x, w, b))
        loss = ampkernels.linear_cross_entropy(xs, ws, t, bs, reduction=reduction, label_smoothing=label_smoothing,
                                               backend=backend)
        xr, wr, br = (a.detach().float().requires_grad_() for a in (x, w, b))
        ref = F.cross_entropy(F.linear(xr, wr, br), t, reduction=reduction, label_smoothing=label_smoothing)
        torch.testing.assert_close(loss, ref, equal_nan=True)  # mean: NaN, as torch
        loss.sum().backward()
        ref.sum().backward()
        for g, gr in ((xs.grad, xr.grad), (ws.grad, wr.grad), (bs.grad, br.grad)):
            assert torch.equal(g.float(), gr), "all ignored: gradients are zeros, as torch's"


@pytest.mark.parametrize("backend", ["torch"] + CPU_TRITON)
def test_other_ignore_index(small_chunks, backend):
    dtype = torch.float16 if backend == "triton" else torch.float32
    x, w, b, t = _inputs(11, 16, 21, dtype, "cpu", ignore_frac=0.0)
    t[::3] = 4  # a real class used as ignore_index
    _check(x, w, b, t, backend, ignore_index=4, label_smoothing=0.1)


def test_fp32_master_weights_under_cpu_autocast(small_chunks):
    # F.linear's autocast cast: x and the fp32 weight/bias to bf16; gradients back in fp32
    x, w, b, t = _inputs(13, 32, 45, torch.float32, "cpu")
    _check(x, w, b, t, "torch", autocast_dtype=torch.bfloat16)
    _check(x, w, None, t, "torch", autocast_dtype=torch.bfloat16, reduction="none")
    # the same value as torch's own ops under the same autocast
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = ampkernels.linear_cross_entropy(x, w, t, b)
        want = F.cross_entropy(F.linear(x, w, b).float(), t)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_auto_runs_the_composite_only_for_small_logits_on_cuda(monkeypatch):
    from types import SimpleNamespace
    cuda, cpu = SimpleNamespace(is_cuda=True), SimpleNamespace(is_cuda=False)
    monkeypatch.delenv("AMPKERNELS_BACKEND", raising=False)
    n = lce._COMPOSITE_MAX_LOGITS
    assert lce._runs_composite(None, cuda, n // 1024, 1024) and lce._runs_composite("auto", cuda, 8, 1024)
    assert not lce._runs_composite(None, cuda, n // 1024 + 1, 1024)  # above: the chunked op
    assert not lce._runs_composite(None, cpu, 8, 1024)  # CPU: the torch backend, its checks and messages
    assert not lce._runs_composite("cuda", cuda, 8, 1024)  # a backend asked for runs
    # a row count known only at run time (masked-LM rows under torch.compile): the op, no guard error
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    assert not lce._runs_composite(None, cuda, ShapeEnv().create_unbacked_symint(), 1024)
    monkeypatch.setenv("AMPKERNELS_BACKEND", "triton")
    assert not lce._runs_composite(None, cuda, 8, 1024)


@pytest.mark.parametrize("reduction", lce.REDUCTIONS)
def test_composite_is_the_definition(reduction):
    # autocast with fp32 master weights (F.linear casts them) and fp64 (kept fp64, not .float())
    x, w, b, t = _inputs(13, 32, 45, torch.float32, "cpu")
    args = dict(ignore_index=-100, label_smoothing=0.1, reduction=reduction)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = lce._composite(x, w, b, t, torch.bfloat16, **args)
        want = F.cross_entropy(F.linear(x, w, b).float(), t, **args)
    assert got.dtype == torch.float32 and torch.equal(got, want)
    x, w, b = x.double(), w.double(), b.double()
    got = lce._composite(x, w, b, t, None, **args)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, reference.linear_cross_entropy(x, w, t, b, **args), rtol=1e-12, atol=1e-12)


def test_fp32_without_autocast_matches_torch_closely(small_chunks):
    x, w, b, t = _inputs(29, 16, 31, torch.float32, "cpu")
    got = ampkernels.linear_cross_entropy(x, w, t, b, label_smoothing=0.1)
    torch.testing.assert_close(got, F.cross_entropy(F.linear(x, w, b), t, label_smoothing=0.1), rtol=1e-5, atol=1e-6)


def test_inference_computes_no_gradients_and_builds_no_graph():
    x, w, b, t = _inputs(9, 16, 20, torch.float32, "cpu")
    w.requires_grad_()
    with torch.no_grad():
        loss = ampkernels.linear_cross_entropy(x, w, t, b)
    assert loss.grad_fn is None
    assert_rel_close(loss, reference.linear_cross_entropy(x.double(), w.detach().double(), t, b.double()),
                     torch.float32)


def test_frozen_head_gives_only_dx(small_chunks):
    x, w, b, t = _inputs(9, 16, 20, torch.float32, "cpu")
    x.requires_grad_()
    loss = ampkernels.linear_cross_entropy(x, w, t, b)
    loss.backward()
    _, dx, _, _ = _grads64(x, w, b, t, torch.ones((), dtype=torch.float64))
    assert_rel_close(x.grad, dx, torch.float32)
    assert w.grad is None and b.grad is None


def test_chunking_bounds_the_logits():
    # the chunk's logits: about max(x's size, the floor) elements, never tokens x vocab
    for floor in (lce._CHUNK_MIN_ELEMS, lce._CHUNK_MIN_ELEMS * lce._COMPILED_CHUNK_SCALE):
        assert lce.chunk_rows(8192, 768, 50257, floor) * 50257 <= max(8192 * 768, floor)
        assert lce.chunk_rows(8192, 4096, 128256, floor) * 128256 <= max(8192 * 4096, floor)
        assert lce.chunk_rows(10, 4, 7, floor) == 10 and lce.chunk_rows(0, 4, 7, floor) == 1
        rows = lce.chunk_rows(1 << 20, 4096, 128256, floor)
        assert rows % 64 == 0 and rows * 128256 <= (1 << 20) * 4096
    # GPT-2's head: 13 chunks of 640 rows in eager, 4 of 2048 under torch.compile
    assert -(-8192 // lce.chunk_rows(8192, 768, 50257, lce._CHUNK_MIN_ELEMS)) == 13
    assert -(-8192 // lce.chunk_rows(8192, 768, 50257, lce._CHUNK_MIN_ELEMS * lce._COMPILED_CHUNK_SCALE)) == 4
    # the fp32 accumulator: chunks of at least hidden / 2 rows (Llama-3's head: 4 of 2048, not 32
    # of 256); at GPT-2's head the floor is larger already
    assert lce.chunk_rows(8192, 4096, 128256, lce._CHUNK_MIN_ELEMS) == 256
    assert lce.chunk_rows(8192, 4096, 128256, lce._CHUNK_MIN_ELEMS, accumulate=True) == 2048
    assert lce.chunk_rows(8192, 768, 50257, lce._CHUNK_MIN_ELEMS, accumulate=True) == \
        lce.chunk_rows(8192, 768, 50257, lce._CHUNK_MIN_ELEMS)
    assert lce.chunk_rows(100, 4096, 128256, lce._CHUNK_MIN_ELEMS, accumulate=True) == 100


def test_chunk_floor_is_larger_under_compile():
    seen = []
    compiled = torch.compile(lambda: seen.append(lce.current_chunk_floor()), fullgraph=False, backend="eager")
    torch._dynamo.reset()
    compiled()
    assert lce.current_chunk_floor() == lce._CHUNK_MIN_ELEMS
    assert seen == [lce._CHUNK_MIN_ELEMS * lce._COMPILED_CHUNK_SCALE]


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_backward_allocates_no_zero_gradients(reduction):
    # the op's gradient outputs (dx, dW, db) get no gradients: autograd must not materialise
    # zeros for them (an fp32 weight-sized buffer at the step's peak: 154 MB for GPT-2's head)
    from tests.memory import StorageTracker
    k, v, m = 64, 1000, 256
    w, x, t = randn(v, k).requires_grad_(), randn(m, k, dtype=torch.bfloat16).requires_grad_(), torch.randint(0, v, (m,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = ampkernels.linear_cross_entropy(x, w, t, reduction=reduction)
    tracker = StorageTracker()
    with tracker:
        loss.sum().backward()
    assert not [e for e in tracker.at_peak if "zeros" in e.op], tracker.breakdown()
    assert w.grad.dtype == torch.float32 and x.grad.dtype == torch.bfloat16


def test_second_backward_is_a_clear_error():
    x, w, b, t = _inputs(5, 8, 9, torch.float32, "cpu")
    x.requires_grad_()
    loss = ampkernels.linear_cross_entropy(x, w, t, b)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    # reduction="none" recomputes, so it may run twice
    loss = ampkernels.linear_cross_entropy(x, w, t, b, reduction="none").sum()
    x.grad = None
    loss.backward(retain_graph=True)
    first = x.grad.clone()
    loss.backward()
    torch.testing.assert_close(x.grad, 2 * first)


def test_bad_inputs_are_clear_errors():
    x, w, b, t = _inputs(4, 8, 6, torch.float32, "cpu")
    f = ampkernels.linear_cross_entropy
    with pytest.raises(ValueError, match="reduction must be one of"):
        f(x, w, t, reduction="avg")
    with pytest.raises(ValueError, match="target must have x's leading shape"):
        f(x, w, t[:3])
    with pytest.raises(TypeError, match="target must be an int64"):
        f(x, w, t.float())
    with pytest.raises(ValueError, match="x's last dim must equal weight's hidden"):
        f(x[:, :7], w, t)
    with pytest.raises(ValueError, match="bias must have shape"):
        f(x, w, t, b[:5])
    with pytest.raises(ValueError, match="label_smoothing must be a float in"):
        f(x, w, t, label_smoothing=1.5)
    with pytest.raises(TypeError, match="x, weight and bias must share a dtype"):
        f(x.half(), w, t)
    with pytest.raises(ValueError, match="target holds 6 at flat index 1, outside"):
        f(x, w, torch.tensor([0, 6, -100, 1]))
    with pytest.raises(ValueError, match="target holds -1 at flat index 0"):
        f(x, w, torch.tensor([-1, 0, 1, 2]))
    with pytest.raises(RuntimeError, match="backend 'cuda' needs CUDA tensors"):
        f(x.half(), w.half(), t, backend="cuda")


def test_grad_scaler_overflow_step_is_skipped():
    # an inf in x (CPU autocast, fp32 master weights): the loss is not finite and the step skips
    lin = ampkernels.nn.LinearCrossEntropy(16, 24)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    x = torch.randn(6, 16)
    x[2, 3] = float("inf")
    t = torch.randint(0, 24, (6,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = lin(x, t)
    assert not torch.isfinite(loss)
    scaler.scale(loss).backward()
    before = lin.weight.detach().clone()
    scaler.step(opt)
    scaler.update()
    assert torch.equal(before, lin.weight) and scaler.get_scale() < 2.0 ** 10
    # and a finite step goes through, with the scale folded into the saved gradients
    opt.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = lin(torch.randn(6, 16), t)
    scaler.scale(loss).backward()
    scaler.step(opt)
    assert not torch.equal(before, lin.weight) and torch.isfinite(lin.weight).all()


def test_module_matches_linear_plus_cross_entropy():
    torch.manual_seed(1)
    head = ampkernels.nn.LinearCrossEntropy(16, 40, label_smoothing=0.05)
    ref = torch.nn.Linear(16, 40)
    ref.load_state_dict(head.state_dict())
    assert set(head.state_dict()) == {"weight", "bias"} and "reduction='mean'" in repr(head)
    x, t = torch.randn(2, 5, 16), torch.randint(0, 40, (2, 5))
    head(x, t).backward()
    F.cross_entropy(ref(x).flatten(0, 1), t.flatten(), label_smoothing=0.05).backward()
    torch.testing.assert_close(head.weight.grad, ref.weight.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(head.bias.grad, ref.bias.grad, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="reduction must be one of"):
        ampkernels.nn.LinearCrossEntropy(4, 4, reduction="mean ")


# ---------------------------------------------------------------- CPU tier: Triton interpreter

@needs_triton
@pytest.mark.skipif(HAS_CUDA, reason="the GPU tier covers triton on CUDA tensors")
@pytest.mark.parametrize("reduction", lce.REDUCTIONS)
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_triton_interpreter(small_chunks, reduction, label_smoothing):
    x, w, b, t = _inputs(13, 16, 300, torch.float16, "cpu")  # 300 > one 256-lane block: two steps a row
    _check(x, w, b, t, "triton", reduction=reduction, label_smoothing=label_smoothing)


@needs_triton
@pytest.mark.skipif(HAS_CUDA, reason="the GPU tier covers triton on CUDA tensors")
def test_triton_rows_pass_matches_torch_rows_pass():
    z = randn(5, 300, dtype=torch.float16, scale=3)
    z[1, 7] = float("-inf")  # a zero probability; smoothing's eps/V on it makes the loss inf, as torch's
    t = torch.tensor([3, 299, -100, 0, 150])
    scale = torch.tensor([0.5, 1.0, 2.0, 3.0, 0.25])
    outs = []
    for backend in ("torch", "triton"):
        zz, loss = z.clone(), torch.empty(5)
        lce.rows_pass(zz, t, loss, scale, -100, 0.1, True, backend)
        outs.append((zz, loss))
    torch.testing.assert_close(outs[1][1], outs[0][1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(outs[1][0], outs[0][0], rtol=2e-3, atol=1e-6)
    assert outs[1][1][1] == float("inf") and torch.isfinite(outs[1][1][[0, 2, 3, 4]]).all()
    assert torch.isfinite(outs[1][0]).all() and torch.equal(outs[1][0][2], torch.zeros(300, dtype=torch.float16))
    # rows padded to a wider stride (the op's chunk buffer on CUDA): same results, padding untouched
    big = torch.full((5, 320), 7.0, dtype=torch.float16)
    zp, loss = big[:, :300], torch.empty(5)
    zp.copy_(z)
    lce.rows_pass(zp, t, loss, scale, -100, 0.1, True, "triton")
    torch.testing.assert_close(loss, outs[1][1], rtol=0, atol=0)
    assert torch.equal(zp, outs[1][0]) and (big[:, 300:] == 7).all()


@needs_triton
@pytest.mark.skipif(HAS_CUDA, reason="the GPU tier covers triton on CUDA tensors")
def test_triton_lse_and_grad_pass_match_torch():
    _lse_and_grad_pass_match_torch("triton", "cpu", torch.float16, (300,))


def _lse_and_grad_pass_match_torch(backend, device, dtype, vocabs):
    """The token pass's lse, and the vocabulary pass over column blocks (one of them holding
    targets, one past them, an odd-width last one, in a wider padded buffer) against the torch
    passes and against the token pass's own gradient."""
    for v in vocabs:
        n = 9
        z = randn(n, v, dtype=dtype, device=device, scale=4)
        t = torch.randint(0, v, (n,), device=device)
        t[4] = -100
        t[0], t[1] = 0, v - 1
        for scale in (torch.rand(n, device=device) + 0.5, torch.tensor([1.5], device=device)):
            full = {}
            for b in ("torch", backend):
                zz, loss, lse = z.clone(), torch.empty(n, device=device), torch.full((n,), 7.0, device=device)
                lce.rows_pass(zz, t, loss, scale, -100, 0.1, True, b, lse=lse)
                full[b] = (zz, loss, lse)
            torch.testing.assert_close(full[backend][1], full["torch"][1], rtol=2e-5, atol=2e-5)
            torch.testing.assert_close(full[backend][2], full["torch"][2], rtol=2e-5, atol=2e-5)
            assert full[backend][2][4] == 0
            torch.testing.assert_close(full["torch"][2][:4], torch.logsumexp(z[:4].float(), -1), rtol=1e-5, atol=1e-5)
            lse = full["torch"][2]
            cut = [0, min(64, v), v // 2, v]
            for c0, c1 in zip(cut, cut[1:]):
                if c1 <= c0:
                    continue
                big = torch.full((n, c1 - c0 + 64), 5.0, dtype=dtype, device=device)
                zp = big[:, :c1 - c0]
                zp.copy_(z[:, c0:c1])
                lce.grad_pass(zp, t, lse, scale, c0, v, -100, 0.1, backend)
                torch.testing.assert_close(zp.float(), full["torch"][0][:, c0:c1].float(), rtol=1.6e-2, atol=1e-6)
                assert (big[:, c1 - c0:] == 5).all()
                assert not zp[4].any()


# ---------------------------------------------------------------- CPU tier: opcheck, compile

def _opcheck(backend, dtype, device):
    x, w, b, t = _inputs(7, 16, 24, dtype, device)
    fwd, bwd = torch.ops.ampkernels.linear_cross_entropy_fwd.default, torch.ops.ampkernels.linear_cross_entropy_bwd
    for reduction in lce.REDUCTIONS:
        # chunk floor 150: two chunks (7 rows of 24 classes, 6 rows at most a chunk)
        torch.library.opcheck(fwd, (x, w, b, t, -100, 0.1, reduction, True, True, True, 150, backend))
        torch.library.opcheck(fwd, (x, w, None, t, -100, 0.0, reduction, False, True, False, 1 << 25, backend))
        dl = torch.rand(7 if reduction == "none" else (), device=device)
        torch.library.opcheck(bwd.default, (dl, x, w, b, t, -100, 0.1, reduction, True, True, True, 150, backend))
    torch.library.opcheck(fwd, (x, w, b, t, -100, 0.0, "mean", False, False, False, 1 << 25, backend))
    if lce.wgrad_by_vocab(w):
        lse = fwd(x, w, b, t, -100, 0.1, "mean", False, True, False, 150, backend)[4]
        assert lse.shape == (7,) and lse.dtype == torch.float32
        for scale in (torch.rand(1, device=device), torch.rand(7, device=device)):
            torch.library.opcheck(torch.ops.ampkernels.linear_cross_entropy_wgrad.default,
                                  (x, w, b, t, lse, scale, -100, 0.1, 150, backend))
    # the autograd registered on the op. mean/sum: its backward scales the gradients the forward
    # returned in place, which the functional API never hands out; AOT dispatch of the bare op,
    # whose callers keep them, refuses that (the compiled API is checked in test_compile_fullgraph_cpu)
    for reduction, tests in (("none", None), ("mean", ("test_schema", "test_autograd_registration", "test_faketensor"))):
        xg, wg, bg = (a.detach().requires_grad_() for a in (x, w, b))
        torch.library.opcheck(fwd, (xg, wg, bg, t, -100, 0.1, reduction, True, True, True, 150, backend),
                              **({"test_utils": tests} if tests else {}))


def test_opcheck_cpu_torch():
    _opcheck("torch", torch.float32, "cpu")
    _opcheck("torch", torch.bfloat16, "cpu")
    # fp32 master weights with 16-bit x (what autocast passes): cast inside the op
    x, w, b, t = _inputs(7, 16, 24, torch.float32, "cpu")
    fwd = torch.ops.ampkernels.linear_cross_entropy_fwd.default
    torch.library.opcheck(fwd, (x.bfloat16(), w, b, t, -100, 0.1, "mean", True, True, True, 1 << 25, "torch"))
    torch.library.opcheck(torch.ops.ampkernels.linear_cross_entropy_bwd.default,
                          (torch.rand(7), x.bfloat16(), w, b, t, -100, 0.0, "none", True, True, True, 1 << 25, "torch"))


@needs_triton
@pytest.mark.skipif(HAS_CUDA, reason="the GPU tier covers triton on CUDA tensors")
def test_opcheck_cpu_triton_interpret():
    _opcheck("triton", torch.float16, "cpu")


# Compiles the Triton row pass for sm_90 without a GPU, in a process of its own (this one may run
# the kernels under TRITON_INTERPRET=1, where @triton.jit functions cannot be compiled), and
# prints its PTX.
_ROWS_PTX_PROBE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from ampkernels.triton import linear_cross_entropy as tk
fn = tk._lce_rows_kernel
sig = {"z_ptr": "*bf16", "ld": "i32", "t_ptr": "*i64", "loss_ptr": "*fp32", "lse_ptr": "*fp32", "scale_ptr": "*fp32",
       "V": "i32", "ignore_index": "i32", "eps": "fp32",
       **{k: "constexpr" for k in ("SCALE_PER_ROW", "WRITE_GRAD", "SMOOTH", "STORE_LSE", "BLOCK")}}
ce = {"SCALE_PER_ROW": False, "WRITE_GRAD": True, "SMOOTH": False, "STORE_LSE": True, "BLOCK": 4096}
attrs = {(fn.arg_names.index(k),): [["tt.divisibility", 16]]
         for k in ("z_ptr", "t_ptr", "loss_ptr", "lse_ptr", "scale_ptr", "ld", "V")}
k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=ce, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                   options={"num_warps": 8})
print(k.asm["ptx"])
"""


@needs_triton
def test_triton_row_pass_reads_the_target_logit_before_its_barriers():
    """The row pass overwrites the row with its gradient once the reductions are done; the
    target's logit must be read before the reductions' barriers, or a warp that lags behind
    reads a gradient another warp already stored there (a wrong loss, seen under
    compute-sanitizer). In the PTX of a 8-warp long-row launch the one scalar 16-bit load, z_t,
    precedes the first bar.sync (the row's own loads are 16-byte vectors)."""
    import re

    r = _run_probe(_ROWS_PTX_PROBE, env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"})
    if r.returncode != 0:
        if "ImportError" in r.stderr or "cannot import" in r.stderr or "ptxas" in r.stderr:
            pytest.skip(f"this Triton cannot compile for sm_90 here: {r.stderr.strip().splitlines()[-1]}")
        raise AssertionError(r.stderr[-3000:])
    lines = r.stdout.splitlines()
    scalar16 = [i for i, line in enumerate(lines) if re.search(r"\bld\.global(\.\w+)*\.[bu]16\b", line)]
    barriers = [i for i, line in enumerate(lines) if re.search(r"\b(bar|barrier)\.sync\b", line)]
    assert len(scalar16) == 1 and barriers, (scalar16, barriers)
    assert scalar16[0] < barriers[0], f"z_t is loaded at PTX line {scalar16[0]}, after the barrier at {barriers[0]}"


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("backend", ["torch"] + CPU_TRITON)
def test_compile_fullgraph_cpu(backend, reduction):
    dtype = torch.float16 if backend == "triton" else torch.float32
    x, w, b, t = _inputs(6, 16, 24, dtype, "cpu", lead=(2,))
    torch._dynamo.reset()
    fn = torch.compile(lambda x, w, b, t: ampkernels.linear_cross_entropy(x, w, t, b, reduction=reduction,
                                                                          backend=backend),
                       fullgraph=True, backend="aot_eager")
    x, w, b = (a.requires_grad_() for a in (x, w, b))
    loss = fn(x, w, b, t)
    dloss = torch.rand_like(loss) + 0.5
    loss.backward(dloss)
    ref, dx, dw, db = _grads64(x, w, b, t, dloss, reduction=reduction)
    assert_rel_close(loss, ref, dtype, factor=2)
    assert_rel_close(x.grad, dx, dtype, factor=2, what="dx")
    assert_rel_close(w.grad, dw, dtype, factor=2, what="dW")
    assert_rel_close(b.grad, db, dtype, factor=2, what="db")


def test_compile_keeps_the_op_opaque():
    # inductor must see the custom op, not F.linear + cross_entropy (it would build the logits)
    from torch._dynamo.testing import AotEagerAndRecordGraphs
    x, w, b, t = _inputs(6, 16, 24, torch.float32, "cpu")
    rec = AotEagerAndRecordGraphs()
    torch._dynamo.reset()
    fn = torch.compile(lambda x, w, b, t: ampkernels.linear_cross_entropy(x, w, t, b), fullgraph=True, backend=rec)
    fn(x, w.requires_grad_(), b, t).backward()
    code = "\n".join(g.code for g in rec.fw_graphs + rec.bw_graphs)
    assert "linear_cross_entropy_fwd" in code and "aten.mm" not in code and "log_softmax" not in code


needs_ext = pytest.mark.skipif(not _extension.load(), reason=f"extension not built: {_extension.status()[1]}")


@needs_ext
def test_extension_schema():
    op = torch.ops.ampkernels.linear_cross_entropy_rows_cuda_.default
    assert op._schema.name == "ampkernels::linear_cross_entropy_rows_cuda_"


# ---------------------------------------------------------------- GPU tier

@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cuda", "triton"])
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("shape", [(1, 64, 128), (7, 13, 7), (33, 72, 1001), (130, 64, 50257), (65, 40, 3)])
def test_gpu_backends_match_float64(backend, dtype, shape):
    m, k, v = shape
    for reduction in lce.REDUCTIONS:
        for ls, bias in ((0.0, True), (0.1, False)):
            x, w, b, t = _inputs(m, k, v, dtype, "cuda", bias=bias)
            _check(x, w, b, t, backend, reduction=reduction, label_smoothing=ls)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cuda", "triton"])
def test_gpu_many_chunks_and_odd_vocab(small_chunks, backend):
    x, w, b, t = _inputs(100, 48, 1003, torch.bfloat16, "cuda")
    _check(x, w, b, t, backend)
    _check(x, w, b, t, backend, reduction="none", label_smoothing=0.2)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cuda", "triton"])
def test_gpu_rows_pass_agrees_with_torch(backend):
    for v in (7, 1000, 50257, 128256):
        z = randn(9, v, dtype=torch.bfloat16, device="cuda", scale=4)
        t = torch.randint(0, v, (9,), device="cuda")
        t[4] = -100
        scale = torch.rand(9, device="cuda") + 0.5
        (z1, l1), (z2, l2) = [(z.clone(), torch.empty(9, device="cuda")) for _ in range(2)]
        lce.rows_pass(z1, t, l1, scale, -100, 0.1, True, "torch")
        lce.rows_pass(z2, t, l2, scale, -100, 0.1, True, backend)
        torch.testing.assert_close(l2, l1, rtol=2e-5, atol=2e-5)
        torch.testing.assert_close(z2.float(), z1.float(), rtol=1.6e-2, atol=1e-7)
        # the op's padded chunk buffer (row stride a multiple of 64, past V; CUDA then takes 16-byte
        # vectors where a dense odd-width row took one element at a time): the same values, the
        # padding untouched
        big = torch.full((9, lce.padded_vocab(v, z) + 64), 5.0, dtype=torch.bfloat16, device="cuda")
        zp, lp = big[:, :v], torch.empty(9, device="cuda")
        zp.copy_(z)
        lce.rows_pass(zp, t, lp, scale, -100, 0.1, True, backend)
        torch.testing.assert_close(lp, l1, rtol=2e-5, atol=2e-5)
        torch.testing.assert_close(zp.float(), z1.float(), rtol=1.6e-2, atol=1e-7)
        assert (big[:, v:] == 5).all()


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cuda", "triton"])
@pytest.mark.parametrize("dtype", GPU_DTYPES)
def test_gpu_lse_and_grad_pass_agree_with_torch(backend, dtype):
    _lse_and_grad_pass_match_torch(backend, "cuda", dtype, (7, 1000, 50257, 128256))


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cuda", "triton"])
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("bias", [True, False])
def test_gpu_autocast_master_weights_and_grad_scaler(backend, dtype, bias):
    torch.manual_seed(0)
    head = ampkernels.nn.LinearCrossEntropy(256, 5003, bias=bias, backend=backend).cuda()
    ref = torch.nn.Linear(256, 5003, bias=bias).cuda()
    ref.load_state_dict(head.state_dict())
    x, t = torch.randn(4, 97, 256, device="cuda"), torch.randint(0, 5003, (4, 97), device="cuda")
    t[:, :5] = -100
    scaler = torch.amp.GradScaler("cuda")
    opt = torch.optim.SGD(head.parameters(), lr=0.1)
    with torch.autocast("cuda", dtype=dtype):
        loss = head(x, t)
        want = F.cross_entropy(ref(x).float().flatten(0, 1), t.flatten())
    assert_rel_close(loss, want.double(), dtype)
    scaler.scale(loss).backward()
    want.backward()
    assert head.weight.grad.dtype == torch.float32
    scaler.unscale_(opt)
    assert_rel_close(head.weight.grad, ref.weight.grad.double(), dtype, factor=2)
    if bias:
        assert_rel_close(head.bias.grad, ref.bias.grad.double(), dtype, factor=2)
    before = head.weight.detach().clone()
    scaler.step(opt)
    scaler.update()
    assert not torch.equal(before, head.weight)
    # an inf in x: the loss is not finite, the step skips
    opt.zero_grad()
    x[1, 10, 7] = float("inf")  # a counted position (t[:, :5] are ignored)
    with torch.autocast("cuda", dtype=dtype):
        loss = head(x, t)
    assert not torch.isfinite(loss)
    scaler.scale(loss).backward()
    before = head.weight.detach().clone()
    scale = scaler.get_scale()
    scaler.step(opt)
    scaler.update()
    assert torch.equal(before, head.weight) and scaler.get_scale() < scale


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cuda", "triton"])
def test_gpu_real_shape_and_bounded_memory(backend):
    # 8192 x 768 x 50257 bf16 (GPT-2's head): the loss and gradients against torch's fp32 path,
    # and peak extra memory that does not grow with tokens x vocab
    k, v = 768, 50257
    torch.manual_seed(0)
    w = (torch.randn(v, k, device="cuda") / math.sqrt(k)).bfloat16().requires_grad_()
    peaks = {}
    for m in (8192, 32768):
        x = torch.randn(m, k, device="cuda").bfloat16().requires_grad_()
        t = torch.randint(0, v, (m,), device="cuda")
        w.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        loss = ampkernels.linear_cross_entropy(x, w, t, backend=backend)
        loss.backward()
        torch.cuda.synchronize()
        peaks[m] = torch.cuda.max_memory_allocated() - base
        if m == 8192:
            ref = F.cross_entropy(F.linear(x.detach().float(), w.detach().float()), t)
            assert_rel_close(loss, ref.double(), torch.bfloat16)
            xr, wr = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
            F.cross_entropy(F.linear(xr, wr), t).backward()
            assert_rel_close(x.grad, xr.grad.double(), torch.bfloat16, factor=2)
            assert_rel_close(w.grad, wr.grad.double(), torch.bfloat16, factor=2)
            del xr, wr, ref
        del x, t, loss
    chunk = lce._CHUNK_MIN_ELEMS * 2
    bound = chunk + 3 * v * k * 4 + 4 * 32768 * k * 2 + (64 << 20)
    assert peaks[8192] < bound and peaks[32768] < bound, (peaks, bound)
    # 4x the tokens: the bf16 logits alone would add 3 x 8192 x 50257 x 2 bytes (2.5 GB)
    assert peaks[32768] - peaks[8192] < 0.1 * 3 * 8192 * v * 2, peaks


def _step_peak(step, *leaves):
    """Bytes allocated at the peak of one training step beyond what was held before it (no
    gradients), after a first step (cuBLAS's workspace and handles, once per process)."""
    def run():
        for a in leaves:
            a.grad = None
        step()

    run()
    for a in leaves:
        a.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    run()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


@pytest.mark.gpu
def test_gpu_master_weights_memory():
    # GPT-2's head with fp32 master weights under bf16 autocast: beyond the gradients themselves
    # (fp32 dW, bf16 dx), one padded bf16 copy of the weight and one chunk of logits
    k, v, m = 768, 50257, 8192
    torch.manual_seed(0)
    w = (torch.randn(v, k, device="cuda") / math.sqrt(k)).requires_grad_()
    x = torch.randn(m, k, device="cuda").bfloat16().requires_grad_()
    t = torch.randint(0, v, (m,), device="cuda")

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            ampkernels.linear_cross_entropy(x, w, t, backend="cuda").backward()

    peak = _step_peak(step, x, w)
    vp = lce.padded_vocab(v, x)
    grads = vp * k * 4 + m * k * 2
    extra = vp * k * 2 + lce.chunk_rows(m, k, v, lce._CHUNK_MIN_ELEMS, accumulate=True) * vp * 2
    assert peak <= grads + extra + (8 << 20), (peak, grads, extra)
    assert w.grad.dtype == torch.float32 and x.grad.dtype == torch.bfloat16


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cuda", "triton"])
def test_gpu_16bit_weights_memory(backend):
    # GPT-2's head with bf16 weights: no fp32 accumulator and no padded copy of the weight, beyond
    # the gradients (bf16 dW, dx) one chunk of logits in the forward, one vocabulary block in
    # backward, and a 64-row padded copy of the odd vocabulary's last rows
    k, v, m = 768, 50257, 8192
    torch.manual_seed(0)
    w = (torch.randn(v, k, device="cuda") / math.sqrt(k)).bfloat16().requires_grad_()
    x = torch.randn(m, k, device="cuda").bfloat16().requires_grad_()
    t = torch.randint(0, v, (m,), device="cuda")

    peak = _step_peak(lambda: ampkernels.linear_cross_entropy(x, w, t, backend=backend).backward(), x, w)
    vp = lce.padded_vocab(v, x)
    chunk = lce.chunk_rows(m, k, v, lce._CHUNK_MIN_ELEMS) * vp * 2
    block = m * lce.padded_vocab(lce.vocab_block_cols(m, k, v, lce._CHUNK_MIN_ELEMS), x) * 2
    grads = v * k * 2 + m * k * 2
    assert peak <= grads + max(chunk, block) + (4 << 20), (peak, grads, chunk, block)
    assert w.grad.dtype == torch.bfloat16 and x.grad.dtype == torch.bfloat16
    xr, wr = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    F.cross_entropy(F.linear(xr, wr), t).backward()
    assert_rel_close(w.grad, wr.grad.double(), torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cuda", "triton"])
def test_gpu_compile_fullgraph(backend):
    x, w, b, t = _inputs(300, 64, 2001, torch.bfloat16, "cuda", lead=(2,))
    torch._dynamo.reset()
    fn = torch.compile(lambda x, w, b, t: ampkernels.linear_cross_entropy(x, w, t, b, backend=backend),
                       fullgraph=True)
    x, w, b = (a.requires_grad_() for a in (x, w, b))
    loss = fn(x, w, b, t)
    loss.backward()
    ref, dx, dw, db = _grads64(x, w, b, t, torch.ones((), dtype=torch.float64, device="cuda"))
    assert_rel_close(loss, ref, torch.bfloat16)
    assert_rel_close(w.grad, dw, torch.bfloat16, factor=2)


@pytest.mark.gpu
def test_gpu_opcheck():
    for backend in ("cuda", "triton", "torch"):
        _opcheck(backend, torch.bfloat16, "cuda")


def test_benchmark_report():
    from ampkernels.bench import bench_linear_cross_entropy as bl
    rows = [dict(op="linear_cross_entropy", provider=p, dtype="bfloat16", shape="T=8192,H=768,V=50257,w=fp32", ms=ms,
                 peak_extra_MiB=mem, **{"pass": "fwd_bwd"}) for p, ms, mem in (("eager", 12.0, 4000), ("liger", 8.0, 900),
                                                                                ("ampkernels_cuda", 6.0, 800))]
    (line,) = bl.report(rows)
    assert "eager 12.00 ms, 4000 MiB" in line and "ampkernels_cuda 6.00 ms (2.00x), 800 MiB (20%)" in line, line


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cuda", "triton"])
@pytest.mark.parametrize("master", [True, False])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_gpu_training_call_does_not_sync(backend, master, reduction):
    # the target check queues a device-side assert: a step's loss and backward never wait for
    # the GPU (fp32 master weights: the fp32 accumulator; 16-bit ones: the vocabulary pass)
    x, w, b, t = _inputs(70, 48, 1003, torch.float32 if master else torch.bfloat16, "cuda")
    for p in (x, w, b):
        p.requires_grad_()

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = ampkernels.linear_cross_entropy(x, w, t, b, reduction=reduction, backend=backend)
        loss.sum().backward()

    step()  # Triton's autotuner times its configs (syncs) on first use
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert torch.isfinite(w.grad).all()


_BAD_TARGET_PROBE = """
import torch, ampkernels
x = torch.randn(4, 16, device="cuda", dtype=torch.bfloat16)
w = torch.randn(24, 16, device="cuda", dtype=torch.bfloat16)
loss = ampkernels.linear_cross_entropy(x, w, torch.tensor([0, 24, -100, 1], device="cuda"), backend={backend!r})
torch.cuda.synchronize()
print("no error, loss", loss.item())
"""


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cuda", None])  # None: "auto", the composite at this size
def test_gpu_bad_target_is_a_device_assert(backend):
    # as F.cross_entropy's: it ends the process's CUDA context, so it runs in a process of its own
    r = _run_probe(_BAD_TARGET_PROBE.format(backend=backend))
    assert r.returncode != 0 and "device-side assert" in r.stderr, (r.stdout, r.stderr[-3000:])
    if backend == "cuda":
        assert "outside [0, 24)" in r.stderr, r.stderr[-3000:]


@pytest.mark.gpu
def test_gpu_auto_composite_below_its_size_the_op_above(monkeypatch):
    # fp32 master weights under bf16 autocast, leading dims, each reduction: below the size "auto"
    # gives torch's composite bit for bit (no ampkernels op runs), above it the chunked op
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.add(func.namespace)
            return func(*args, **(kwargs or {}))

    monkeypatch.delenv("AMPKERNELS_BACKEND", raising=False)
    x, w, b, t = _inputs(20, 64, 1003, torch.float32, "cuda", lead=(3,))
    size = lce._COMPOSITE_MAX_LOGITS
    for reduction in lce.REDUCTIONS:
        grads = {}
        for limit, who in ((size, "auto"), (0, "op"), (None, "torch")):
            xs, ws, bs = (a.detach().requires_grad_() for a in (x, w, b))
            with torch.autocast("cuda", dtype=torch.bfloat16), Ops() as ops:
                if limit is None:
                    loss = F.cross_entropy(F.linear(xs, ws, bs).float().flatten(0, 1), t.flatten(), reduction=reduction)
                    loss = loss.reshape(t.shape) if reduction == "none" else loss
                else:
                    monkeypatch.setattr(lce, "_COMPOSITE_MAX_LOGITS", limit)
                    loss = ampkernels.linear_cross_entropy(xs, ws, t, bs, reduction=reduction)
            assert ("ampkernels" in ops.names) == (who == "op"), (who, ops.names)
            loss.sum().backward()
            grads[who] = (loss.detach(), xs.grad, ws.grad, bs.grad)
        assert all(torch.equal(a, c) for a, c in zip(grads["auto"], grads["torch"])), reduction
        for a, c in zip(grads["op"], grads["torch"]):
            assert_rel_close(a, c.double(), torch.bfloat16, factor=2)


@pytest.mark.gpu
def test_gpu_benchmark_runs(monkeypatch, tmp_path):
    from ampkernels.bench import bench_linear_cross_entropy as bl
    from ampkernels.bench.common import Recorder
    rec = Recorder(str(tmp_path))
    bl.run(rec, [torch.bfloat16], quick=True, shapes=[(512, 64, 1003)])
    assert "error" not in {r["provider"] for r in rec.rows}, [r for r in rec.rows if r["provider"] == "error"]
    assert {"eager", "compile", "ampkernels_cuda", "ampkernels_triton"} <= {r["provider"] for r in rec.rows}
    assert bl.report(rec.rows)
