"""Randomised cases, each against float64: the norms, linear_act, the fused MLP, the gated ones,
rotary_embedding and linear_cross_entropy.

Each test draws its cases in a loop from a seeded generator (tests.conftest.input_seed of the
test's id and the case index): dtypes drawn independently (the norms: x, residual and
residual_in_fp32, weight, bias, out_dtype, as tests/test_dtype_combos.py enumerates them;
linear_act / fused_mlp: fp16/bf16, under autocast with fp32 master weights or not), shapes
(odd, one row, leading dims, 2-D normalized shapes, K or N not multiples of 8), strided views
and storage offsets (misaligned pointers), eps, bias or not, residual or not, every activation.
Every case checks the forward and every gradient against float64 autograd, the dtypes of the
outputs and gradients, and that no input was modified. A failure names the case's seed and
parameters; AMPKERNELS_FUZZ_SEED=<seed> reruns that case alone (in the test that reported it).

GPU tier: ~15,090 cases. The cuda backend takes the whole space; the triton backend a palette
per test (a Triton kernel compiles once per pointer-dtype signature, pointer alignment, BLOCK_N
and integer argument class: ==1, multiple of 16, other), so that its compiles stay bounded,
with autotuning off (one config per kernel: the masking and indexing under test are the same
for every tile).
AMPKERNELS_FUZZ_SCALE=<float> scales every case count (e.g. 0.1 for a quick look, 10 for a soak).
CPU tier: a few hundred cases, the Triton kernels under TRITON_INTERPRET=1 (fp16/fp32) and the
torch backend (all dtypes).
"""
import os
import random

import pytest
import torch
import torch.nn.functional as F

import ampkernels
from ampkernels import reference
from tests.conftest import input_seed
from tests.test_dtype_combos import ALL, CPU_DTYPES, ISSUE_31, NormCombo, check_norm, norm_combos
from tests.utils import TOL, needs_triton_ops, rel_err

HAS_CUDA = torch.cuda.is_available()
SCALE = float(os.environ.get("AMPKERNELS_FUZZ_SCALE", "1"))
ONLY = os.environ.get("AMPKERNELS_FUZZ_SEED")
needs_triton = needs_triton_ops
cpu_only = pytest.mark.skipif(HAS_CUDA, reason="CPU tier (Triton interpreter)")
RELU_LIKE = ("relu", "squared_relu")
BIAS_LAYOUTS = ("contiguous", "strided", "offset")


def run_cases(request, count, case, salt=""):
    """case(rng, gen) for `count` seeds derived from the test's id; returns how many ran."""
    base = input_seed(request.node.nodeid, salt + os.environ.get("AMPKERNELS_TEST_SEED", ""))
    seeds = [int(ONLY)] if ONLY else [base + i for i in range(max(1, round(count * SCALE)))]
    for seed in seeds:
        rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
        params = {}
        try:
            case(rng, gen, params)
        except Exception as e:
            raise AssertionError(f"fuzz case AMPKERNELS_FUZZ_SEED={seed}: {params}\n{type(e).__name__}: {e}") from e
    return len(seeds)


def tensor(shape, dtype, device, gen, layout="contiguous", scale=1.0, offset=0.0):
    """A random tensor of `shape` laid out as asked: contiguous, at a storage offset of one
    element (contiguous but misaligned), every other column of a wider one, or transposed."""
    shape = tuple(shape)

    def rnd(*s):
        return (torch.randn(*s, generator=gen) * scale + offset).to(device=device, dtype=dtype)

    if layout == "offset":
        return rnd(torch.Size(shape).numel() + 1)[1:].view(shape)
    if layout == "strided":
        return rnd(*shape[:-1], 2 * shape[-1])[..., ::2]
    if layout == "transposed" and len(shape) >= 2:
        return rnd(*shape[:-2], shape[-1], shape[-2]).transpose(-1, -2)
    return rnd(*shape)


LAYOUTS = ("contiguous", "contiguous", "offset", "strided", "transposed")
ALIGNED_LAYOUTS = ("contiguous", "contiguous", "strided", "transposed")  # the op copies the last two: aligned


# ---------------------------------------------------------------- norms

# row lengths by the kernels' regimes (BLOCK_N = next power of two); the cuda backend draws from
# all of them, each Triton test from a fixed palette of two
N_BINS = ((1, 1), (2, 8), (9, 64), (65, 300), (700, 1100), (2000, 2600))


NORM_ROLES = ("x", "residual", "weight", "bias")


def norm_case(rng, gen, params, backend, device, combos, bins=N_BINS, misaligned=NORM_ROLES):
    """One norm case; only the tensors named in `misaligned` may sit at a misaligned storage offset."""
    combo = rng.choice(combos)
    lo, hi = rng.choice(bins)
    n = rng.randint(lo, hi)
    if combo.residual is not None and not combo.residual_in_fp32 and not combo.is_rms:
        # LayerNorm of a few elements with a 16-bit stored sum: rows whose spread is near the sum's
        # rounding get wrong gradients, a known error (test_dtype_combos, docs/reliability.md)
        n = max(n, 16)
    nshape = (n,)
    if n > 3 and n % 2 == 0 and rng.random() < 0.15:
        nshape = (2, n // 2)  # a 2-D normalized_shape
    rows = 1 if rng.random() < 0.2 else rng.randint(2, 40)
    lead = (rng.randint(2, 3),) if rng.random() < 0.3 else ()
    shape = (*lead, rows, *nshape)
    scale, offset = rng.choice([1.0, 30.0]), rng.choice([0.0, 0.0, 100.0])
    if n < 16 or (combo.residual is not None and not combo.residual_in_fp32 and combo.x != torch.float32):
        # a mean of 100 over a few elements: their spread may be far below 100's fp32 rounding;
        # the backward reads the sum as stored, rounded to 16 bits: at a mean of 100 that rounding
        # is ~5% of x - mean (the contract: docs/reliability.md), no test of the kernels' accuracy
        offset = 0.0
    layouts = [rng.choice(LAYOUTS if role in misaligned else ALIGNED_LAYOUTS) for role in NORM_ROLES]
    eps = rng.choice([1e-5, 1e-6, 1e-2])
    use = rng.choice(["both", "out", "res_out"]) if combo.residual is not None else "out"
    params.update(backend=backend, combo=str(combo), shape=shape, normalized_shape=nshape, scale=scale,
                  offset=offset, layouts=layouts, eps=eps, use=use)
    x = tensor(shape, combo.x, device, gen, layouts[0], scale, offset)
    r = None if combo.residual is None else tensor(shape, combo.residual, device, gen, layouts[1])
    w = None if combo.weight is None else tensor(nshape, combo.weight, device, gen, layouts[2], 0.5, 1.0)
    b = None if combo.bias is None or combo.is_rms else tensor(nshape, combo.bias, device, gen, layouts[3], 0.5)
    # fp32 rows of mean 100: the fp32 row sums carry ~1e-5 of x - mean (any fp32 implementation)
    factor = 20 if offset and combo.x == torch.float32 else 4
    check_norm(combo.is_rms, x, w, b, r, backend=backend, residual_in_fp32=combo.residual_in_fp32,
               out_dtype=combo.out, eps=eps, normalized_shape=nshape, factor=factor, use_out=use != "res_out",
               use_res_out=use != "out", what=f"{backend} {combo}")


def every_combo(dtypes, x_dtypes=None):
    return [c for is_rms in (False, True) for x in (x_dtypes or dtypes) for c in norm_combos(is_rms, x, dtypes)]


# The one tensor each Triton norm test may misalign (a misaligned pointer is one more
# specialisation for every kernel it meets; all of them misaligned independently multiplied
# the compiles, the tier's time): between them the six tests misalign each tensor the op takes
TRITON_MISALIGNED = {(False, torch.float16): "residual", (False, torch.bfloat16): "weight",
                     (False, torch.float32): "bias", (True, torch.float16): "x", (True, torch.bfloat16): "residual",
                     (True, torch.float32): "weight"}


def triton_palette(rng, is_rms, x_dtype, dtypes=ALL, size=4):
    """`size` combos for one Triton test (issue 31's first when it applies), and two N bins."""
    combos = norm_combos(is_rms, x_dtype, dtypes)
    chosen = [c for c in ISSUE_31 if c.is_rms == is_rms and c.x == x_dtype]
    chosen += rng.sample([c for c in combos if c not in chosen], size - len(chosen))
    return chosen, rng.sample(N_BINS[:5], 2)


@pytest.mark.gpu
@pytest.mark.parametrize("chunk", range(8))
def test_norms_gpu_cuda(request, chunk):
    run_cases(request, 1000, lambda rng, gen, p: norm_case(rng, gen, p, "cuda", "cuda", every_combo(ALL)))


@pytest.mark.gpu
@pytest.mark.parametrize("x_dtype", ALL, ids=str)
@pytest.mark.parametrize("is_rms", [False, True], ids=["ln", "rms"])
def test_norms_gpu_triton(request, is_rms, x_dtype):
    combos, bins = triton_palette(random.Random(input_seed(request.node.nodeid, "palette")), is_rms, x_dtype)
    misaligned = (TRITON_MISALIGNED[is_rms, x_dtype],)
    run_cases(request, 500, lambda rng, gen, p: norm_case(rng, gen, p, "triton", "cuda", combos, bins, misaligned))


@needs_triton_ops
@cpu_only
def test_norms_triton_interpreter(request):
    combos = every_combo(CPU_DTYPES)
    run_cases(request, 150, lambda rng, gen, p: norm_case(rng, gen, p, "triton", "cpu", combos, N_BINS[:5]))


def test_norms_torch_backend(request):
    combos = every_combo(ALL)
    run_cases(request, 150, lambda rng, gen, p: norm_case(rng, gen, p, "torch", "cpu", combos, N_BINS[:5]))


# ---------------------------------------------------------------- linear_act and fused_mlp


def _assert_close_or_as_eager(ours, eager, exact, dtype, what):
    """Each (name, tensor) of ours within max(4 TOL, 4x the same-dtype eager error) of float64:
    with few terms per output (K or M of 1) the 16-bit rounding both make can leave no correct
    digit after cancellation."""
    for (name, got), same, want in zip(ours, eager, exact):
        if got is None:
            continue
        assert not torch.isnan(got).any() or torch.isnan(want).any(), f"{what} {name}: NaN"
        bound = max(4 * TOL[dtype], 4 * rel_err(same, want))
        err = rel_err(got, want)
        assert err <= bound, f"{what} {name}: relative error {err:.2e} > {bound:.2e}"


def _near_zero(pre64, x64, w64, dtype):
    """Whether some pre-activation is within 16 units of `dtype` of its terms' size from 0, where
    a ReLU-like act' may flip between implementations that round differently."""
    with torch.no_grad():
        size = x64.abs() @ w64.abs().t()
        return bool((pre64.abs() <= 16 * torch.finfo(dtype).eps * size + 1e-30).any())


def _leaves(tensors):
    return [None if t is None else t.detach().requires_grad_() for t in tensors]


def _f64(tensors, dtype):
    # the values the op computes with: autocast's cast to the compute dtype, then float64
    return [None if t is None else t.detach().to(dtype).double().requires_grad_() for t in tensors]


def _draw_dims(rng, triton_palette_dims, top=80):
    if triton_palette_dims:  # (K, N) classes: any size but 16-divisible (Triton specialises on it)
        aligned = rng.random() < 0.5  # multiples of 8, not 16: TMA (and on Hopper the ping-pong kernel)
        pick = (lambda: 8 * rng.choice([1, 3, 5, 7])) if aligned else (lambda: rng.choice([v for v in range(1, top)
                                                                                              if v % 8]))
        return pick(), pick()
    dim = lambda: 8 * rng.randint(1, top // 8) if rng.random() < 0.4 else rng.randint(1, top)  # noqa: E731
    return dim(), dim()


def _dtype_setup(rng, device, dtypes):
    dtype = rng.choice(dtypes)
    autocast = device == "cuda" and rng.random() < 0.5
    return dtype, autocast, (torch.float32 if autocast else dtype)


def linear_act_case(rng, gen, params, backend, device, dtypes, activation=None, palette=False):
    dtype, autocast, pdtype = _dtype_setup(rng, device, dtypes)
    activation = activation or rng.choice(reference.ACTIVATIONS)
    k, n = _draw_dims(rng, palette)
    m = 1 if rng.random() < 0.1 else rng.randint(2, 64)
    lead = (rng.randint(2, 3),) if rng.random() < 0.3 else ()
    m = m if not lead or m > 1 else 2
    bias = rng.random() < 0.6
    xdtype = rng.choice([dtype, torch.float32]) if autocast else dtype
    layouts = [rng.choice(LAYOUTS), rng.choice(("contiguous", "transposed", "strided"))]
    params.update(backend=backend, dtype=dtype, autocast=autocast, x_dtype=xdtype, activation=activation,
                  shape=(*lead, m, k), n=n, bias=bias, layouts=layouts)
    x = tensor((*lead, m, k), xdtype, device, gen, layouts[0])
    w = tensor((n, k), pdtype, device, gen, layouts[1], scale=k ** -0.5)
    b = tensor((n,), pdtype, device, gen, rng.choice(BIAS_LAYOUTS)) if bias else None
    check_linear_act(x, w, b, activation, backend, dtype, autocast, params)


def check_linear_act(x, w, b, activation, backend, dtype, autocast=False, params=None):
    """linear_act (under autocast to dtype, or not) and its backward against float64 autograd
    and the same-dtype eager op; inputs as given (any layout); no input modified."""
    inputs = [x, w, b]
    before = [None if t is None else t.clone() for t in inputs]
    ours, eager, exact = _leaves(inputs), _leaves(inputs), _f64(inputs, dtype)
    with torch.autocast(x.device.type, dtype=dtype, enabled=autocast):
        y = ampkernels.linear_act(*ours, activation, backend=backend)
        y_eager = reference.act_fwd(F.linear(*eager), activation)
    pre64 = F.linear(*exact)
    y64 = reference.act_fwd(pre64, activation)
    assert y.dtype == dtype and y.shape == (*x.shape[:-1], w.shape[0]), f"out {y.dtype} {tuple(y.shape)}"
    _assert_close_or_as_eager([("out", y)], [y_eager], [y64], dtype, "linear_act")
    _backward_and_compare(y, y_eager, y64, ours, eager, exact, ("dx", "dweight", "dbias"), dtype, "linear_act",
                          params, activation in RELU_LIKE and _near_zero(pre64, exact[0], exact[1], dtype))
    _assert_unmodified(inputs, before)


def _backward_and_compare(y, y_eager, y64, ours, eager, exact, names, dtype, what, params, tie):
    dy = torch.randn(y.shape, device=y.device).to(y.dtype)
    y.backward(dy)
    y_eager.backward(dy)
    y64.backward(dy.double())
    for name, t in zip(names, ours):
        if t is not None:
            assert t.grad is not None and t.grad.dtype == t.dtype, f"{what} {name}: grad {getattr(t.grad, 'dtype', None)}"
    if tie:  # a pre-activation at a ReLU kink: act' there is either side's to pick
        if params is not None:
            params["grads"] = "not compared (a pre-activation within rounding of 0)"
        return
    _assert_close_or_as_eager([(nm, None if t is None else t.grad) for nm, t in zip(names, ours)],
                              [None if t is None else t.grad for t in eager],
                              [None if t is None else t.grad for t in exact], dtype, what)


def _assert_unmodified(inputs, before):
    for t, t0 in zip(inputs, before):
        assert t is None or torch.equal(t, t0), "an input was modified"


def mlp_case(rng, gen, params, backend, device, dtypes, palette=False):
    dtype, autocast, pdtype = _dtype_setup(rng, device, dtypes)
    activation = rng.choice(reference.ACTIVATIONS)
    k, h = _draw_dims(rng, palette)
    n = _draw_dims(rng, palette, 48)[0]
    m = 1 if rng.random() < 0.1 else rng.randint(2, 40)
    lead = (2,) if rng.random() < 0.3 else ()
    bias = rng.random() < 0.6
    layouts = [rng.choice(LAYOUTS), rng.choice(("contiguous", "transposed")), rng.choice(("contiguous", "transposed"))]
    params.update(backend=backend, dtype=dtype, autocast=autocast, activation=activation, shape=(*lead, m, k),
                  h=h, n=n, bias=bias, layouts=layouts)
    x = tensor((*lead, m, k), dtype, device, gen, layouts[0])
    w1 = tensor((h, k), pdtype, device, gen, layouts[1], scale=k ** -0.5)
    w2 = tensor((n, h), pdtype, device, gen, layouts[2], scale=h ** -0.5)
    b1, b2 = [tensor((d,), pdtype, device, gen, rng.choice(BIAS_LAYOUTS)) if bias else None for d in (h, n)]
    check_mlp(x, w1, b1, w2, b2, activation, backend, dtype, autocast, params)


def check_mlp(x, w1, b1, w2, b2, activation, backend, dtype, autocast=False, params=None):
    """fused_mlp as check_linear_act checks linear_act."""
    from ampkernels.ops.mlp import fused_mlp
    inputs = [x, w1, b1, w2, b2]
    before = [None if t is None else t.clone() for t in inputs]
    ours, eager, exact = _leaves(inputs), _leaves(inputs), _f64(inputs, dtype)

    def block(a):
        return F.linear(reference.act_fwd(F.linear(a[0], a[1], a[2]), activation), a[3], a[4])

    with torch.autocast(x.device.type, dtype=dtype, enabled=autocast):
        out = fused_mlp(*ours, activation, backend=backend)
        out_eager = block(eager)
    out64 = block(exact)
    assert out.dtype == dtype and out.shape == (*x.shape[:-1], w2.shape[0]), f"out {out.dtype} {tuple(out.shape)}"
    _assert_close_or_as_eager([("out", out)], [out_eager], [out64], dtype, "fused_mlp")
    tie = activation in RELU_LIKE and _near_zero(F.linear(*exact[:3]), exact[0], exact[1], dtype)
    _backward_and_compare(out, out_eager, out64, ours, eager, exact, ("dx", "dw1", "db1", "dw2", "db2"), dtype,
                          "fused_mlp", params, tie)
    _assert_unmodified(inputs, before)


@pytest.fixture
def untuned_triton(monkeypatch):
    """The Triton matmuls with their first config only and no ping-pong/TMA timing: a fuzz case
    of a new shape would otherwise autotune (benchmark every config) once per shape."""
    import triton
    from ampkernels.triton import gated_linear_act as tg
    from ampkernels.triton import linear_act as tk
    monkeypatch.setattr(tk, "_AUTOTUNE", False)
    for module in (tk, tg):
        for name in dir(module):
            kernel = getattr(module, name)
            if isinstance(kernel, triton.runtime.Autotuner) and len(kernel.configs) > 1:
                monkeypatch.setattr(kernel, "configs", kernel.configs[:1])


@pytest.mark.gpu
@pytest.mark.parametrize("chunk", range(2))
def test_linear_act_gpu_cuda(request, chunk):
    run_cases(request, 750, lambda rng, gen, p: linear_act_case(rng, gen, p, "cuda", "cuda",
                                                                (torch.float16, torch.bfloat16)))


@pytest.mark.gpu
@pytest.mark.parametrize("activation", reference.ACTIVATIONS)
def test_linear_act_gpu_triton(request, activation, untuned_triton):
    run_cases(request, 100, lambda rng, gen, p: linear_act_case(rng, gen, p, "triton", "cuda",
                                                                (torch.float16, torch.bfloat16), activation, True))


@pytest.mark.gpu
@pytest.mark.parametrize("chunk", range(2))
def test_fused_mlp_gpu_cuda(request, chunk):
    run_cases(request, 250, lambda rng, gen, p: mlp_case(rng, gen, p, "cuda", "cuda", (torch.float16, torch.bfloat16)))


@pytest.mark.gpu
def test_fused_mlp_gpu_triton(request, untuned_triton):
    # few cases: each new shape compiles Triton kernels (150 took 168 s of the GPU tier)
    run_cases(request, 60, lambda rng, gen, p: mlp_case(rng, gen, p, "triton", "cuda",
                                                         (torch.float16, torch.bfloat16), palette=True))


@needs_triton
@cpu_only
def test_linear_act_triton_interpreter(request):
    run_cases(request, 40, lambda rng, gen, p: linear_act_case(rng, gen, p, "triton", "cpu", (torch.float16,)))


@needs_triton
@cpu_only
@pytest.mark.parametrize("chunk", range(2))
def test_fused_mlp_triton_interpreter(request, chunk):
    run_cases(request, 10, lambda rng, gen, p: mlp_case(rng, gen, p, "triton", "cpu", (torch.float16,)))


def test_linear_act_and_mlp_torch_backend(request):
    run_cases(request, 30, lambda rng, gen, p: linear_act_case(rng, gen, p, "torch", "cpu", (torch.float32,)))
    run_cases(request, 15, lambda rng, gen, p: mlp_case(rng, gen, p, "torch", "cpu", (torch.float32,)), "mlp")


# ---------------------------------------------------------------- gated_linear_act, gated_mlp

GATED_NAMES = ("dx", "dgate_weight", "dup_weight", "dgate_bias", "dup_bias", "ddown_weight", "ddown_bias")


def gated_case(rng, gen, params, backend, device, dtypes, activation=None, palette=False):
    """gated_linear_act, or gated_mlp (with a down projection), as linear_act_case draws its
    cases, and: each bias on its own, gate and up as the halves of one packed (2H, K) weight or
    apart, recompute."""
    dtype, autocast, pdtype = _dtype_setup(rng, device, dtypes)
    activation = activation or rng.choice(reference.GATED_ACTIVATIONS)
    k, h = _draw_dims(rng, palette)
    m = 1 if rng.random() < 0.1 else rng.randint(2, 64)
    lead = (rng.randint(2, 3),) if rng.random() < 0.3 else ()
    down = _draw_dims(rng, palette, 48)[0] if rng.random() < 0.3 else None
    biases = [rng.random() < 0.4 for _ in range(3)]
    packed, recompute = rng.random() < 0.3, down is None and rng.random() < 0.3
    xdtype = rng.choice([dtype, torch.float32]) if autocast else dtype
    layouts = [rng.choice(LAYOUTS), rng.choice(("contiguous", "transposed", "strided"))]
    params.update(backend=backend, dtype=dtype, autocast=autocast, x_dtype=xdtype, activation=activation,
                  shape=(*lead, m, k), hidden=h, down=down, biases=biases, packed=packed, recompute=recompute,
                  layouts=layouts)
    x = tensor((*lead, m, k), xdtype, device, gen, layouts[0])
    if packed:
        wgu = tensor((2 * h, k), pdtype, device, gen, layouts[1], scale=k ** -0.5)
        wg, wu = wgu[:h], wgu[h:]
    else:
        wg, wu = (tensor((h, k), pdtype, device, gen, layouts[1], scale=k ** -0.5) for _ in range(2))
    bg, bu = (tensor((h,), pdtype, device, gen, rng.choice(BIAS_LAYOUTS)) if on else None for on in biases[:2])
    wd = None if down is None else tensor((down, h), pdtype, device, gen, rng.choice(("contiguous", "transposed")),
                                          scale=h ** -0.5)
    bd = tensor((down,), pdtype, device, gen) if down is not None and biases[2] else None
    check_gated(x, wg, wu, bg, bu, wd, bd, activation, backend, dtype, autocast, recompute, params)


def check_gated(x, wg, wu, bg, bu, wd, bd, activation, backend, dtype, autocast, recompute, params=None):
    """gated_linear_act (wd None) or gated_mlp as check_linear_act checks linear_act."""
    from ampkernels.ops.gated_linear_act import gated_mlp
    inputs = [x, wg, wu, bg, bu] + ([] if wd is None else [wd, bd])
    before = [None if t is None else t.clone() for t in inputs]
    ours, eager, exact = _leaves(inputs), _leaves(inputs), _f64(inputs, dtype)

    def block(a):
        h = reference.act_fwd(F.linear(a[0], a[1], a[3]), activation) * F.linear(a[0], a[2], a[4])
        return h if wd is None else F.linear(h, a[5], a[6])

    with torch.autocast(x.device.type, dtype=dtype, enabled=autocast):
        if wd is None:
            out = ampkernels.gated_linear_act(*ours, activation, backend=backend, recompute=recompute)
        else:
            out = gated_mlp(*ours, activation, backend=backend)
        out_eager = block(eager)
    out64 = block(exact)
    n = wg.shape[0] if wd is None else wd.shape[0]
    assert out.dtype == dtype and out.shape == (*x.shape[:-1], n), f"out {out.dtype} {tuple(out.shape)}"
    what = "gated_linear_act" if wd is None else "gated_mlp"
    _assert_close_or_as_eager([("out", out)], [out_eager], [out64], dtype, what)
    _backward_and_compare(out, out_eager, out64, ours, eager, exact, GATED_NAMES, dtype, what, params, False)
    _assert_unmodified(inputs, before)


@pytest.mark.gpu
def test_gated_gpu_cuda(request):
    run_cases(request, 400, lambda rng, gen, p: gated_case(rng, gen, p, "cuda", "cuda", (torch.float16, torch.bfloat16)))


@pytest.mark.gpu
@pytest.mark.parametrize("activation", reference.GATED_ACTIVATIONS)
def test_gated_gpu_triton(request, activation, untuned_triton):
    run_cases(request, 40, lambda rng, gen, p: gated_case(rng, gen, p, "triton", "cuda",
                                                          (torch.float16, torch.bfloat16), activation, True))


@needs_triton
@cpu_only
def test_gated_triton_interpreter(request):
    run_cases(request, 12, lambda rng, gen, p: gated_case(rng, gen, p, "triton", "cpu", (torch.float16,)))


def test_gated_torch_backend(request):
    run_cases(request, 30, lambda rng, gen, p: gated_case(rng, gen, p, "torch", "cpu", (torch.float32,)))


def test_gated_cuda_autograd_on_cpu(request, cpu_kernels):
    # the cuda backend's C++ autograd and routing, its kernels the CPU reference
    run_cases(request, 30, lambda rng, gen, p: gated_case(rng, gen, p, "cuda", "cpu", (torch.float32, torch.bfloat16)))


# ---------------------------------------------------------------- rotary_embedding

ROTARY_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def rotary_case(rng, gen, params, backend, device, dtypes=ROTARY_DTYPES, head_dims=None):
    """rotary_embedding against float64 autograd: q, k, cos/sin and out_dtype drawn apart,
    heads before or after the sequence, fewer k heads, head dims whose half is odd, one row,
    q and k as views of one projection, offset or strided, a cos batch of 1 or B."""
    qd, kd = rng.choice(dtypes), rng.choice(dtypes)
    csd = rng.choice([torch.float32, qd])
    out_dtype = rng.choice([None, None, rng.choice(dtypes)])
    layout = rng.choice(["bhsd", "bshd"])
    b, s = rng.randint(1, 3), rng.choice([1, rng.randint(2, 70)])
    d = rng.choice(head_dims) if head_dims else 2 * rng.choice([1, rng.randint(1, 80), 4 * rng.randint(1, 32)])
    hq = rng.randint(1, 6)
    hk = rng.randint(1, hq)
    cos_batch = rng.choice([1, b])
    source = rng.choice(["projection", "contiguous", "offset", "strided"])
    params.update(backend=backend, q=qd, k=kd, cos=csd, out_dtype=out_dtype, layout=layout, shape=(b, s, hq, hk, d),
                  cos_batch=cos_batch, source=source)

    def make(h, dtype):
        if source == "projection":  # HF: (b, s, h*d) viewed (b, s, h, d)
            t = tensor((b, s, h * d), dtype, device, gen).view(b, s, h, d)
        else:
            t = tensor((b, s, h, d), dtype, device, gen, source)
        return t.transpose(1, 2) if layout == "bhsd" else t

    q, k = make(hq, qd), make(hk, kd)
    angle = torch.randn(cos_batch, s, d, generator=gen, dtype=torch.float64) * 3
    cos, sin = (f(angle).to(device=device, dtype=csd) for f in (torch.cos, torch.sin))
    u = 1 if layout == "bhsd" else 2
    inputs = [q, k, cos, sin]
    before = [t.clone() for t in inputs]
    ours, eager = _leaves([q, k]), _leaves([q, k])
    exact = [t.detach().double().requires_grad_() for t in (q, k)]
    q_out, k_out = ampkernels.rotary_embedding(*ours, cos, sin, u, out_dtype=out_dtype, backend=backend)
    outs = [t.to(o.dtype) for t, o in zip(reference.rotary_embedding(*eager, cos, sin, u), (q_out, k_out))]
    outs64 = reference.rotary_embedding(*exact, cos.double(), sin.double(), u)
    for name, got, x in (("q_out", q_out, q), ("k_out", k_out, k)):
        want_dtype = out_dtype or torch.promote_types(x.dtype, csd)
        assert got.dtype == want_dtype and got.shape == x.shape, f"{name} {got.dtype} {tuple(got.shape)}"
    for name, got, same, want in (("q_out", q_out, outs[0], outs64[0]), ("k_out", k_out, outs[1], outs64[1])):
        _assert_close_or_as_eager([(name, got)], [same], [want], got.dtype, "rotary_embedding")
    dys = [torch.randn(t.shape, generator=gen).to(device=device, dtype=t.dtype) for t in (q_out, k_out)]
    torch.autograd.backward((q_out, k_out), dys)
    torch.autograd.backward(outs, dys)
    torch.autograd.backward(outs64, [t.double() for t in dys])
    for name, a, e, x in (("dq", ours[0], eager[0], exact[0]), ("dk", ours[1], eager[1], exact[1])):
        assert a.grad.dtype == a.dtype, f"{name}: grad {a.grad.dtype}"
        _assert_close_or_as_eager([(name, a.grad)], [e.grad], [x.grad], a.dtype, "rotary_embedding")
    _assert_unmodified(inputs, before)


@pytest.mark.gpu
def test_rotary_gpu_cuda(request):
    run_cases(request, 400, lambda rng, gen, p: rotary_case(rng, gen, p, "cuda", "cuda"))


@pytest.mark.gpu
def test_rotary_gpu_triton(request):
    # the kernel compiles once per head dim (a constexpr) and dtype signature: a palette of both
    run_cases(request, 60, lambda rng, gen, p: rotary_case(rng, gen, p, "triton", "cuda",
                                                           (torch.float16, torch.bfloat16), (8, 128)))


@needs_triton
@cpu_only
def test_rotary_triton_interpreter(request):
    run_cases(request, 30, lambda rng, gen, p: rotary_case(rng, gen, p, "triton", "cpu",
                                                           (torch.float16, torch.float32)))


def test_rotary_torch_backend(request):
    run_cases(request, 30, lambda rng, gen, p: rotary_case(rng, gen, p, "torch", "cpu"))


# ---------------------------------------------------------------- linear_cross_entropy

LCE_TRITON_VOCABS = (7, 1000, 5003, 50257)  # Triton compiles once per lane count: a fixed palette


def lce_case(rng, gen, params, backend, device, dtypes, vocabs=None):
    """One linear_cross_entropy call against float64 autograd: drawn dtype (16-bit, or fp32
    master weights under autocast), tokens, hidden, vocab, bias, reduction, smoothing,
    ignore_index and its share (all ignored too), x's layout, the chunk size (several chunks)."""
    from ampkernels.ops import linear_cross_entropy as lce
    dtype = rng.choice(dtypes)
    master = device == "cuda" and rng.random() < 0.4
    m = rng.choice([1, 2, rng.randint(1, 64), rng.randint(1, 400)])
    k = rng.choice([rng.randint(1, 24), rng.randint(8, 160), 8 * rng.randint(1, 24)])
    v = rng.choice(vocabs) if vocabs else rng.choice([2, rng.randint(2, 300), rng.randint(300, 6000), 50257])
    lead = rng.choice([(), (), (rng.randint(1, 3),)])
    bias = rng.random() < 0.5
    reduction = rng.choice(lce.REDUCTIONS)
    smoothing = rng.choice([0.0, 0.0, round(rng.uniform(0.01, 0.5), 3)])
    ignore_index = rng.choice([-100, -100, 0])
    ignore_share = rng.choice([0.0, 0.2, 0.7, 1.0])
    layout = rng.choice(("contiguous", "contiguous", "offset", "strided"))
    chunk_floor = rng.choice([lce._CHUNK_MIN_ELEMS, rng.randint(1, 4 * v)])
    params.update(backend=backend, dtype=str(dtype), master=master, m=m, k=k, v=v, lead=lead, bias=bias,
                  reduction=reduction, smoothing=smoothing, ignore_index=ignore_index, ignore_share=ignore_share,
                  layout=layout, chunk_floor=chunk_floor)
    pdt = torch.float32 if master else dtype
    x = tensor((*lead, m, k), torch.float32 if master else dtype, device, gen, layout).requires_grad_()
    w = tensor((v, k), pdt, device, gen, scale=rng.uniform(0.5, 3) / k ** 0.5).requires_grad_()
    b = tensor((v,), pdt, device, gen, scale=0.5).requires_grad_() if bias else None
    t = torch.randint(0, v, (*lead, m), generator=gen)
    t[torch.rand(t.shape, generator=gen) < ignore_share] = ignore_index
    t = t.to(device)
    inputs = [a for a in (x, w, b, t) if a is not None]
    before = [a.detach().clone() for a in inputs]
    saved, lce._CHUNK_MIN_ELEMS = lce._CHUNK_MIN_ELEMS, chunk_floor
    try:
        with torch.autocast(device, dtype=dtype, enabled=master):
            loss = ampkernels.linear_cross_entropy(x, w, t, b, ignore_index=ignore_index, label_smoothing=smoothing,
                                                   reduction=reduction, backend=backend)
        dloss = (torch.rand(loss.shape, generator=gen) + 0.5).to(device)
        loss.backward(dloss)
    finally:
        lce._CHUNK_MIN_ELEMS = saved
    leaves = [a for a in (x, w, b) if a is not None]
    d64 = [a.detach().double().requires_grad_() for a in leaves]
    ref = reference.linear_cross_entropy(d64[0], d64[1], t, d64[2] if bias else None, ignore_index=ignore_index,
                                         label_smoothing=smoothing, reduction=reduction)
    ref.backward(dloss.double())
    assert loss.dtype == torch.float32 and loss.shape == ref.shape
    valid = int((t != ignore_index).sum())
    if reduction == "mean" and valid == 0:
        assert torch.isnan(loss) and all(torch.equal(a.grad, torch.zeros_like(a)) for a in leaves)
    else:
        tol = TOL[dtype] * 2
        for name, ours, want in (("loss", loss, ref), *((f"d{n}", a.grad, r.grad) for n, a, r in
                                                          zip(("x", "w", "b"), leaves, d64))):
            if want.abs().max() == 0:
                assert torch.equal(ours, torch.zeros_like(ours)), name
                continue
            err = rel_err(ours, want)
            if name == "db":
                # db sums 16-bit logit gradients over the rows, which cancel (2 classes: p - 1 and
                # 1 - p): the rounding bound is relative to the sum of their magnitudes
                err = (ours.double() - want).norm().item() / _lce_db_magnitude(d64, t, bias, ignore_index, smoothing,
                                                                               reduction, dloss).norm().item()
            assert err <= tol, f"{name}: relative error {err:.3e} > {tol:.1e}"
    for a in leaves:
        assert a.grad.dtype == a.dtype
    _assert_unmodified(inputs, before)


def _lce_db_magnitude(d64, t, bias, ignore_index, smoothing, reduction, dloss):
    """sum over rows of |d loss / d logits| (float64): the scale of db's rounding error."""
    import torch.nn.functional as F
    x64, w64 = d64[0].detach(), d64[1].detach()
    z = F.linear(x64.reshape(-1, x64.shape[-1]), w64, d64[2].detach() if bias else None).requires_grad_()
    loss = F.cross_entropy(z, t.reshape(-1), ignore_index=ignore_index, label_smoothing=smoothing, reduction=reduction)
    (g,) = torch.autograd.grad(loss, z, dloss.double().reshape(loss.shape))
    return g.abs().sum(0)


@pytest.mark.gpu
def test_linear_cross_entropy_gpu_cuda(request):
    run_cases(request, 300, lambda rng, gen, p: lce_case(rng, gen, p, "cuda", "cuda", (torch.float16, torch.bfloat16)))


@pytest.mark.gpu
def test_linear_cross_entropy_gpu_triton(request):
    run_cases(request, 150, lambda rng, gen, p: lce_case(rng, gen, p, "triton", "cuda",
                                                         (torch.float16, torch.bfloat16), LCE_TRITON_VOCABS))


@needs_triton
@cpu_only
def test_linear_cross_entropy_triton_interpreter(request):
    run_cases(request, 12, lambda rng, gen, p: lce_case(rng, gen, p, "triton", "cpu", (torch.float16,), (7, 300)))


def test_linear_cross_entropy_torch_backend(request):
    run_cases(request, 40, lambda rng, gen, p: lce_case(rng, gen, p, "torch", "cpu", (torch.float32, torch.bfloat16),
                                                        (2, 7, 300, 1001)))


def test_fuzz_reports_the_failing_case(request, monkeypatch):
    # a wrong result is reported with the seed and parameters that reproduce it
    import ampkernels.ops.layer_norm as ln
    real = ln._torch_norm

    def off_by_one_percent(*a):
        out = real(*a)
        return (out[0] * 1.01, out[1]) if isinstance(out, tuple) else out * 1.01
    monkeypatch.setattr(ln, "_torch_norm", off_by_one_percent)
    combos = [NormCombo(False, torch.float32, weight=torch.float32)]
    with pytest.raises(AssertionError, match=r"AMPKERNELS_FUZZ_SEED=\d+: \{'backend': 'torch', 'combo': 'ln x=fp32"):
        run_cases(request, 1, lambda rng, gen, p: norm_case(rng, gen, p, "torch", "cpu", combos, N_BINS[3:4]))


@pytest.mark.parametrize("backend", [pytest.param("triton", marks=[needs_triton, cpu_only]),
                                     pytest.param("cuda", marks=pytest.mark.gpu),
                                     pytest.param("triton_gpu", marks=pytest.mark.gpu)])
def test_fused_mlp_strided_bias(backend):
    # found by this file's fuzz: F.linear takes a strided bias; fused_mlp's Triton path read b1[::2]
    # as b1's storage and its cuda path refused it
    from ampkernels.ops.mlp import fused_mlp
    device = "cpu" if backend == "triton" else "cuda"
    gen = torch.Generator().manual_seed(0)
    x, w1, b1 = (tensor(s, torch.float16, device, gen, lay, scale=sc)
                 for s, lay, sc in (((5, 16), "contiguous", 1.0), ((24, 16), "contiguous", 0.25), ((24,), "strided", 1.0)))
    w2, b2 = tensor((8, 24), torch.float16, device, gen, scale=0.2), tensor((8,), torch.float16, device, gen, "strided")
    out = fused_mlp(x, w1, b1, w2, b2, "relu", backend=backend.split("_")[0])
    d = [t.double() for t in (x, w1, b1, w2, b2)]
    ref = F.linear(torch.relu(F.linear(d[0], d[1], d[2])), d[3], d[4])
    assert rel_err(out, ref) <= 4 * TOL[torch.float16]
