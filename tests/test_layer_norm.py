"""layer_norm / rms_norm: every backend against float64 math, forward and all gradients.

CPU tier: the reference (forward and backward) against float64 math and autograd; the Triton
kernels under TRITON_INTERPRET=1 in fp16/fp32 (bf16 is broken in the interpreter), their
looped variants for long rows; dispatch and errors; opcheck; torch.compile(fullgraph); the
compiled extension's schemas and its error for CPU tensors.
GPU tier (`pytest -m gpu`): cuda, triton and torch for every dtype x param dtype, N from 1
to 65536, large-mean and all-zero rows, strided and misaligned views, 3-D input, residual
paths, out_dtype, autocast, bitwise determinism of the param grads, torch.compile, CUDA-graph
capture, opcheck, NaN/Inf, empty batches, and a tensor over 2^31 elements; the opt-in Gluon
kernels (ampkernels/triton/layer_norm_gluon.py) the same way (their gates on the CPU tier).

Tolerances (tests/utils.py TOL): relative Frobenius error vs float64, fp16 1e-3, bf16 8e-3,
fp32 1e-5; gradients factor 2 (one more rounding of dx, sums over many rows).
"""

import pytest
import torch
import torch.nn.functional as F

from ampkernels import _extension, backends, reference
from ampkernels.ops import layer_norm as ln
from ampkernels.ops.layer_norm import layer_norm, rms_norm
from tests.utils import TOL, assert_rel_close, cuda_kernels_on_cpu, needs_triton_ops, randn

HAS_CUDA = torch.cuda.is_available()
GRAD_FACTOR = 2
needs_triton = needs_triton_ops


def _norm(is_rms, x, n, w, b, eps, **kw):
    if is_rms:
        return rms_norm(x, n, w, eps, **kw)
    return layer_norm(x, n, w, b, eps, **kw)


def _inputs(m, n, dtype, device, pdtype=None, affine=True, lead=(), mean=0.0):
    x = randn(*lead, m, n, dtype=dtype, device=device, offset=mean)
    pdtype = pdtype or dtype
    w = randn(n, dtype=pdtype, device=device, scale=0.5, offset=1.0) if affine else None
    b = randn(n, dtype=pdtype, device=device, scale=0.5) if affine else None
    return x, w, b


def _assert_inference_matches(inf, train, out_scale, term_scale, backend):
    """The inference forward against the training forward: the same kernel (bit for bit) on the
    cuda backend and the reference. Triton's register kernel compiles an inference variant
    without the stats stores, and ptxas contracts a different set of its mul + add pairs into
    FMAs (N = 1536 fp32, sm_90: 41 FFMA against 25). So the two round differently in fp32: the
    mean and the sums of squares (a few units in the last place, up to about log2 N), hence
    x - mean, whose units are those of |x| and |mean|, not of the difference (for a row of mean
    1000 and unit noise one unit of the mean is 6e-5 of x_hat: at 9dcde36, 1 of 60 seeds of
    test_gpu_sizes[False-768-triton] put a 6.6e-5 gap on an output of -0.001); then
    x_hat * w + b, of units |x_hat * w| + |b|. Allowed: 4 units of the output dtype of out_scale
    (|x_hat * w| + |b|, the output's terms) and 16 fp32 units of term_scale (the same with
    (|x| + |mean|) * rstd for |x_hat|)."""
    if backend != "triton":
        assert torch.equal(inf, train), "inference forward differs from the training forward"
        return
    gap = (inf.double() - train.double()).abs()
    allowed = _inference_allowance(train.dtype, out_scale, term_scale)
    excess = gap - allowed
    if bool((excess > 0).any()):
        n = train.shape[-1]
        at = divmod(int(excess.argmax()), n)  # (row, column) of the worst element, rows flattened
        inf, train, gap, allowed = (t.reshape(-1, n) for t in (inf, train, gap, allowed))
        raise AssertionError(f"inference forward differs from the training forward by {gap[at].item():.3g} at row, "
                             f"column {at}: inference {inf[at].item():.6g}, training {train[at].item():.6g}, "
                             f"allowed {allowed[at].item():.3g}")


def _inference_allowance(dtype, out_scale, term_scale):
    return (4 * torch.finfo(dtype).eps * out_scale + 16 * torch.finfo(torch.float32).eps * term_scale
            + torch.finfo(dtype).tiny)


def _check(is_rms, x, w, b, backend, eps=1e-5, residual=None, residual_in_fp32=False, out_dtype=None, factor=1.0,
           use_res_out=True):
    """Forward and every gradient of one call against float64 autograd on the same inputs."""
    n = x.shape[-1]
    b = None if is_rms else b
    leaves = [t for t in (x, w, b, residual) if t is not None]
    ins = [t.detach().clone().requires_grad_() for t in leaves]
    ins64 = [t.detach().double().requires_grad_() for t in leaves]
    before = [t.detach().clone() for t in leaves]

    def unpack(ts):
        it = iter(ts)
        return [next(it) if t is not None else None for t in (x, w, b, residual)]

    xx, ww, bb, rr = unpack(ins)
    x6, w6, b6, r6 = unpack(ins64)
    res = _norm(is_rms, xx, n, ww, bb, eps, residual=rr, residual_in_fp32=residual_in_fp32, out_dtype=out_dtype,
                backend=backend)
    if is_rms:
        ref = reference.rms_norm(x6, n, w6, eps, residual=r6)
    else:
        ref = reference.layer_norm(x6, n, w6, b6, eps, residual=r6)
    out, out64 = (res[0], ref[0]) if residual is not None else (res, ref)
    assert out.dtype == (out_dtype or x.dtype) and out.shape == x.shape
    with torch.no_grad():  # inference: no mean/rstd stored
        res_inf = _norm(is_rms, xx, n, ww, bb, eps, residual=rr, residual_in_fp32=residual_in_fp32,
                        out_dtype=out_dtype, backend=backend)
    scales = [_output_scales(is_rms, x6, w6, b6, r6, out64, eps)]
    if residual is not None:
        scales.append((ref[1].detach().abs(),) * 2)
    for a, c, (out_scale, term_scale) in zip(res_inf if residual is not None else [res_inf],
                                             res if residual is not None else [res], scales):
        _assert_inference_matches(a, c.detach(), out_scale, term_scale, backend)
    what = f"{backend} {'rms' if is_rms else 'ln'} {x.dtype} n={n}"
    tol_dtype = x.dtype if out_dtype is None or out_dtype == torch.float32 else out_dtype
    assert_rel_close(out, out64, tol_dtype, factor=factor, what=f"{what} out")
    loss_terms = [(out, out64)]
    if residual is not None:
        s, s64 = res[1], ref[1]
        assert s.dtype == (torch.float32 if residual_in_fp32 else x.dtype)
        assert_rel_close(s, s64, s.dtype if s.dtype != torch.float32 else x.dtype, what=f"{what} residual_out")
        if use_res_out:
            loss_terms.append((s, s64))
    grads = [torch.randn(o.shape, device=o.device) for o, _ in loss_terms]
    torch.autograd.backward([o for o, _ in loss_terms], [g.to(o.dtype) for g, (o, _) in zip(grads, loss_terms)])
    torch.autograd.backward([o for _, o in loss_terms], [g.to(o.dtype).double() for g, (o, _) in
                                                       zip(grads, loss_terms)])
    for name, t, t64, orig in zip(("dx", "dweight", "dbias", "dresidual"), unpack(ins), unpack(ins64),
                                  (x, w, b, residual)):
        if t is None:
            continue
        assert t.grad is not None and t.grad.dtype == orig.dtype, f"{what} {name} dtype"
        if t64.grad.abs().max() == 0:  # e.g. LayerNorm's dx at N = 1: no relative error to speak of
            assert t.grad.abs().max() <= 1e-3, f"{what} {name}: {t.grad.abs().max()} where 0 is exact"
            continue
        tol_dtype = orig.dtype if orig.dtype != torch.float32 else x.dtype
        if name in ("dweight", "dbias"):
            terms = grads[0].double().reshape(-1, n).abs()
            if name == "dweight":
                terms = terms * _xhat64(is_rms, x6, r6, eps, n).abs()
            _assert_column_sum_close(t.grad, t64.grad, terms.sum(0), terms.shape[0], tol_dtype,
                                     GRAD_FACTOR * factor, f"{what} {name}")
            continue
        assert_rel_close(t.grad, t64.grad, tol_dtype, factor=GRAD_FACTOR * factor, what=f"{what} {name}")
    for t, t0 in zip(leaves, before):
        assert torch.equal(t, t0), "an input was modified"
    return res


def _output_scales(is_rms, x6, w6, b6, r6, out64, eps):
    """(out_scale, term_scale) of _assert_inference_matches, in float64: |x_hat * w| + |b|, and
    the same with x_hat's terms, (|x| + |mean|) * rstd (RMSNorm: |x| * rstd, so both agree)."""
    with torch.no_grad():
        out64 = out64.detach()
        b_abs = 0 if b6 is None else b6.detach().abs()
        out_scale = (out64 if b6 is None else out64 - b6.detach()).abs() + b_abs
        if is_rms:
            return out_scale, out_scale
        xin = (x6 if r6 is None else x6 + r6).detach()
        mean = xin.mean(-1, keepdim=True)
        rstd = ((xin - mean).square().mean(-1, keepdim=True) + eps).rsqrt()
        w_abs = 1 if w6 is None else w6.detach().abs()
        return out_scale, (xin.abs() + mean.abs()) * rstd * w_abs + b_abs


def _xhat64(is_rms, x6, r6, eps, n):
    """The normalised input in float64, rows of n."""
    h = (x6 if r6 is None else x6 + r6).detach().reshape(-1, n)
    if not is_rms:
        h = h - h.mean(-1, keepdim=True)
    return h / torch.sqrt((h * h).mean(-1, keepdim=True) + eps)


def _assert_column_sum_close(got, want, magnitude, rows, dtype, factor, what):
    """dweight / dbias, sums over rows: relative error as assert_rel_close, but relative to at
    least magnitude / (10 sqrt(rows)), magnitude = sum_rows |term|. A sum of random-signed terms
    is ~ magnitude / sqrt(rows); one that cancels far below that (few rows, N = 1) carries the
    rounding error of its terms, not of itself: at 5 rows of N = 1 an fp32 dbias within a few
    ulp of the terms missed a plain 2e-5 relative bound (CI at b9e4fde). A dropped or doubled
    row still fails (its error is ~ magnitude / rows)."""
    scale = max(want.norm().item(), magnitude.norm().item() / (10 * rows ** 0.5))
    err = (got.double() - want).norm().item() / max(scale, 1e-30)
    assert not torch.isnan(got).any(), f"{what}: NaN in output"
    assert err <= TOL[dtype] * factor, f"{what}: relative error {err:.3e} > {TOL[dtype] * factor:.1e}"


def _eps(n):
    # N = 1: RMSNorm's dx = eps / (x^2 + eps)^1.5 is all cancellation; a large eps keeps it
    # well-conditioned enough for a relative-error check (LayerNorm's dx is exactly 0 there)
    return 1.0 if n == 1 else 1e-5


# ---------------------------------------------------------------- CPU tier: reference

@pytest.mark.parametrize("is_rms", [False, True])
def test_reference_matches_float64_math(is_rms):
    x, w, b = _inputs(9, 33, torch.float32, "cpu", lead=(2,), mean=3.0)
    r = randn(2, 9, 33)
    eps = 1e-5
    s = x.double() + r.double()
    if is_rms:
        want = F.rms_norm(s, (33,), w.double(), eps)
        out, s_out = reference.rms_norm(x, 33, w, eps, residual=r)
    else:
        want = F.layer_norm(s, (33,), w.double(), b.double(), eps)
        out, s_out = reference.layer_norm(x, 33, w, b, eps, residual=r)
    assert out.dtype == torch.float32 and s_out.dtype == torch.float32
    assert_rel_close(out, want, torch.float32)
    assert_rel_close(s_out, s, torch.float32)
    x16 = x.half()
    out16 = reference.layer_norm(x16, (33,), w, b) if not is_rms else reference.rms_norm(x16, (33,), w)
    assert out16.dtype == torch.float16  # x.dtype, also with fp32 params
    assert reference.rms_norm(x16, 33, w)[0].dtype == torch.float16


@pytest.mark.parametrize("is_rms", [False, True])
@pytest.mark.parametrize("with_dres", [False, True])
def test_reference_backward_matches_autograd(is_rms, with_dres):
    x, w, b = _inputs(7, 40, torch.float64, "cpu", mean=2.0)
    x.requires_grad_(), w.requires_grad_(), b.requires_grad_()
    out, _, mean, rstd = reference.norm_forward(x, w, None if is_rms else b, 1e-5, is_rms=is_rms)
    dy, dres = torch.randn_like(out), torch.randn_like(out) if with_dres else None
    out.backward(dy)
    dx, dw, db = reference.norm_backward(dy, x.detach(), w.detach(), None if is_rms else mean.detach(),
                                         rstd.detach(), dresidual_out=dres, is_rms=is_rms, want_dbias=not is_rms)
    assert_rel_close(dx, x.grad + (0 if dres is None else dres), torch.float64)
    assert_rel_close(dw, w.grad, torch.float64)
    if not is_rms:
        assert_rel_close(db, b.grad, torch.float64)


@pytest.mark.parametrize("is_rms", [False, True])
def test_torch_backend(is_rms):
    x, w, b = _inputs(6, 50, torch.float32, "cpu", lead=(2,))
    _check(is_rms, x, w, b, "torch")
    _check(is_rms, x, w, b, "torch", residual=randn(2, 6, 50), residual_in_fp32=True)
    _check(is_rms, x, None, None, "torch")


def test_rms_eps_default_is_finfo_eps():
    x = randn(4, 16)
    assert torch.equal(rms_norm(x, 16, backend="torch"), F.rms_norm(x, (16,), eps=torch.finfo(torch.float32).eps))


def test_all_zero_row_is_finite_and_nan_propagates():
    x, w, b = _inputs(4, 32, torch.float32, "cpu")
    x[1] = 0
    x[2, 5] = float("nan")
    x[3, 7] = float("inf")
    for is_rms in (False, True):
        out = _norm(is_rms, x, 32, w, b, 1e-5, backend="torch")
        want = F.rms_norm(x, (32,), w, 1e-5) if is_rms else F.layer_norm(x, (32,), w, b, 1e-5)
        assert torch.isfinite(out[:2]).all()
        assert torch.isnan(out[2]).all() == torch.isnan(want[2]).all()
        assert torch.equal(torch.isnan(out), torch.isnan(want))


# ---------------------------------------------------------------- CPU tier: Triton under the interpreter

def _interp():
    if HAS_CUDA:
        pytest.skip("GPU tier covers triton on CUDA tensors")


@needs_triton
@pytest.mark.parametrize("is_rms", [False, True])
@pytest.mark.parametrize("dtype,pdtype", [(torch.float16, torch.float32), (torch.float16, torch.float16),
                                          (torch.float32, torch.float32)])
def test_triton_interpret(is_rms, dtype, pdtype):
    _interp()
    for m, n in ((5, 1), (3, 7), (9, 64), (4, 200)):
        x, w, b = _inputs(m, n, dtype, "cpu", pdtype)
        _check(is_rms, x, w, b, "triton", eps=_eps(n))
    x, w, b = _inputs(6, 48, dtype, "cpu", pdtype, mean=1000.0)
    x[2] = 0
    # fp32 at mean 1000: the fp32 row sum (~5e4, ulp 4e-3) puts ~1e-4 relative error into x - mean,
    # as in any fp32 implementation (torch's included); 16-bit outputs round far above that
    f = 20 if dtype == torch.float32 else 1
    _check(is_rms, x, w, b, "triton", factor=f)
    _check(is_rms, x, None, None, "triton", factor=f)


@needs_triton
@pytest.mark.parametrize("is_rms", [False, True])
@pytest.mark.parametrize("residual_in_fp32", [False, True])
def test_triton_interpret_residual_and_out_dtype(is_rms, residual_in_fp32):
    _interp()
    x, w, b = _inputs(5, 40, torch.float16, "cpu", torch.float32, lead=(2,))
    for r in (randn(2, 5, 40, dtype=torch.float16), randn(2, 5, 40)):
        _check(is_rms, x, w, b, "triton", residual=r, residual_in_fp32=residual_in_fp32)
    _check(is_rms, x, w, b, "triton", residual=randn(2, 5, 40, dtype=torch.float16), use_res_out=False)
    _check(is_rms, x, w, b, "triton", out_dtype=torch.float32)


@needs_triton
def test_triton_norm_bwd_keeps_its_launches_per_key(monkeypatch):
    """norm_bwd runs its kept launches again only for a call that specializes as the kept one
    did (shapes, dtypes, flags, pointer alignment); any other call launches anew. The launches
    are faked: what is tested is the keying (the kernels run in the tests above and on the GPU)."""
    _interp()
    from ampkernels.triton import layer_norm as tln
    launched = []

    class FakeKept:
        runs = 0

        def run(self, *args):
            self.runs += 1

    def fake_launch(kernel, grid, *args, **kwargs):
        launched.append(kernel)
        return FakeKept()

    monkeypatch.setattr(tln, "launch", fake_launch)
    monkeypatch.setattr(tln, "_BWD_KEPT", {})

    def launches(m=64, n=96, dtype=torch.float16, is_rms=False, offset=0, weight=True, dx_dtype=None):
        x = torch.randn(m * n + offset, dtype=dtype)[offset:].view(m, n)  # offset 1: x is 2 bytes off
        w = torch.randn(n, dtype=dtype) if weight else None
        before = len(launched)
        tln.norm_bwd(x.clone(), x, w, torch.ones(m), torch.ones(m), None, is_rms, weight, False,
                     dx_dtype or dtype, None, None)
        return len(launched) - before

    assert launches() == 2  # the backward and the column sums, launched and kept
    assert launches() == 0  # the same key: the kept launches ran
    (kept,) = tln._BWD_KEPT.values()
    assert kept[0].runs == kept[1].runs == 1
    for change in ({"m": 65}, {"n": 97}, {"dtype": torch.bfloat16}, {"is_rms": True}, {"offset": 1},
                   {"weight": False}, {"dx_dtype": torch.float32}):
        assert launches(**change) > 0, change
        assert launches(**change) == 0, change
    # without norm_bwd's key (scripts/norm_bwd_sweep.py calls _bwd_launch so): launched, never kept
    kept_before, before = dict(tln._BWD_KEPT), len(launched)
    x = torch.randn(64, 96, dtype=torch.float16)
    outs = (torch.empty_like(x), x.new_empty(0), torch.empty(96, dtype=torch.float16), torch.empty(96, dtype=torch.float16))
    for _ in range(2):
        tln._bwd_launch(tln._bwd_config(96), x.clone(), x, x[0].clone(), torch.ones(64), torch.ones(64), None, False,
                        True, True, *outs)
    assert len(launched) - before == 4 and tln._BWD_KEPT == kept_before
    monkeypatch.setattr(tln, "_MAX_KEPT", 3)  # bounded: a full cache starts over
    for m in range(10, 16):
        launches(m=m)
        assert len(tln._BWD_KEPT) <= 3


@needs_triton
@pytest.mark.parametrize("is_rms", [False, True])
def test_triton_interpret_looped_kernels(is_rms, monkeypatch):
    """Rows longer than the register tile: force the chunked forward and the looped backward on
    small rows (100 = 3 chunks of 32 and a partial one; 96 = 3 whole chunks, no masks)."""
    _interp()
    from ampkernels.triton import layer_norm as tln
    monkeypatch.setattr(tln, "_MAX_FWD_BLOCK", 32)
    monkeypatch.setattr(tln, "_MAX_BWD_BLOCK", 32)
    monkeypatch.setattr(tln, "_MAX_BWD_RELOAD_BLOCK", 32)
    monkeypatch.setattr(tln, "_LOOP_BLOCK", 32)
    monkeypatch.setattr(tln, "_CHUNKED_LONG", (32, 4, 2))
    tln._bwd_config.cache_clear()
    try:
        assert tln._bwd_config(100)[4], "looped backward"
        for n in (100, 96):
            x, w, b = _inputs(5, n, torch.float32, "cpu", mean=5.0)
            _check(is_rms, x, w, b, "triton", residual=randn(5, n))
            _check(is_rms, x, w, b, "triton")
    finally:
        tln._bwd_config.cache_clear()


@needs_triton
@pytest.mark.parametrize("is_rms", [False, True])
def test_triton_interpret_fwd_params_first(is_rms, monkeypatch):
    """The forward with its params loaded before the reductions (PARAMS_FIRST, a sweep option),
    one and several rows a step, every optional input."""
    _interp()
    from ampkernels.triton import layer_norm as tln
    for rows in (1, 4):
        monkeypatch.setattr(tln, "_fwd_config", lambda n, wide=False, r=rows: (tln.triton.next_power_of_2(n), r, 4, True))
        x, w, b = _inputs(6, 40, torch.float16, "cpu", torch.float32)
        _check(is_rms, x, w, b, "triton", residual=randn(6, 40, dtype=torch.float16))
        _check(is_rms, x, w, None, "triton")
        _check(is_rms, x, None, None, "triton")


@needs_triton
@pytest.mark.parametrize("is_rms", [False, True])
def test_triton_interpret_bwd_reload(is_rms, monkeypatch):
    """The backward's RELOAD path (x, dy and weight read again after the row sums: N = 16384 by
    default), forced on a short row, with every optional input; the interpreter ignores num_stages."""
    _interp()
    from ampkernels.triton import layer_norm as tln
    monkeypatch.setattr(tln, "_MAX_BWD_BLOCK", 32)
    tln._bwd_config.cache_clear()
    try:
        cfg = tln._bwd_config(100)
        assert not cfg[4] and cfg[0] > tln._MAX_BWD_BLOCK, cfg
        x, w, b = _inputs(7, 100, torch.float16, "cpu", torch.float32)
        _check(is_rms, x, w, b, "triton", residual=randn(7, 100), residual_in_fp32=True)
        _check(is_rms, x, None, None, "triton")
        x, w, b = _inputs(5, 64, torch.float16, "cpu")  # N = BLOCK_N, one row a step: no masks
        _check(is_rms, x, w, b, "triton", residual=randn(5, 64, dtype=torch.float16))
    finally:
        tln._bwd_config.cache_clear()


@needs_triton
def test_triton_interpret_bwd_after_a_refused_launch(monkeypatch):
    """A backward launch Triton refuses for shared memory (the compiled kernel outgrew the fit's
    model: Triton 3.8, N = 16384 with dresidual_out) runs a stage fewer, then the looped kernel,
    with the right gradients; the config that fit is remembered for the next call."""
    _interp()
    from triton.runtime.errors import OutOfResources

    from ampkernels.triton import layer_norm as tln
    real, tried = tln._bwd_launch, []

    def launch(cfg, *args):
        tried.append(cfg)
        if not cfg[4]:  # every register-tile config refused: the looped kernel must run
            raise OutOfResources(245780, 232448, "shared memory")
        return real(cfg, *args)

    monkeypatch.setattr(tln, "_bwd_launch", launch)
    monkeypatch.setattr(tln, "_BWD_CONFIGS", {})
    x, w, b = _inputs(5, 40, torch.float16, "cpu", torch.float32)
    _check(False, x, w, b, "triton", residual=randn(5, 40, dtype=torch.float16))
    assert [c[5] for c in tried[:-1]] == list(range(tried[0][5], 0, -1)) and tried[-1][4], tried
    n = len(tried)
    _check(False, x, w, b, "triton", residual=randn(5, 40, dtype=torch.float16))
    assert len(tried) == n + 1 and tried[-1][4], tried[n:]


@needs_triton
@pytest.mark.parametrize("is_rms", [False, True])
def test_triton_interpret_bwd_real_n(is_rms):
    """The default backward configs at the benchmark's N, a few rows each (N = 2048: no masks;
    16384: RELOAD, no masks)."""
    _interp()
    from ampkernels.triton import layer_norm as tln
    tln._bwd_config.cache_clear()
    assert not tln._bwd_config(16384)[4], "N = 16384 takes the register (RELOAD) kernel"
    for n, pdtype in ((768, torch.float16), (2048, torch.float16), (16384, torch.float32)):
        x, w, b = _inputs(3, n, torch.float16, "cpu", pdtype)
        _check(is_rms, x, w, b, "triton")


@needs_triton
def test_gluon_bwd_takes_only_what_it_can(monkeypatch):
    """The Gluon backward's gate: rows from GLUON_MIN_N; 16-bit x and dy, rows of 8200-16384
    elements, a multiple of 8, starting 16-byte aligned, no residual gradients, the shared memory
    for its ring (an H200 block has it, an A100's not); never on CPU tensors (no interpreter)."""
    from ampkernels.triton import layer_norm as tln
    from ampkernels.triton import layer_norm_gluon as gluon
    if not gluon.available():
        pytest.skip("this Triton has no Gluon")
    meta = lambda *shape, dtype=torch.bfloat16: torch.empty(*shape, dtype=dtype, device="meta")
    none = meta(0)
    x = meta(4, 16384)
    for ok, xx, dy, dro, dres in ((True, x, x, None, none), (True, meta(4, 8200, dtype=torch.float16), None, None, none),
                                  (False, meta(4, 8192), None, None, none), (False, meta(4, 16392), None, None, none),
                                  (False, meta(4, 12290), None, None, none),
                                  (False, meta(4, 16384, dtype=torch.float32), None, None, none),
                                  (False, x, meta(4, 16384, dtype=torch.float32), None, none),
                                  (False, x, x, x, none), (False, x, x, None, x)):
        assert gluon.bwd_eligible(xx, xx if dy is None else dy, dro, dres) == ok, (xx.shape, xx.dtype, ok)
    misaligned = torch.empty(4 * 16384 + 1, dtype=torch.bfloat16)[1:].view(4, 16384)
    assert not gluon.bwd_eligible(misaligned, misaligned, None, none)

    monkeypatch.setattr(tln, "_smem_per_program", lambda device: 232448)  # an H100/H200 block
    assert tln._gluon_bwd_takes(x, x, None, none)  # by default at 16384, where it measured faster
    x12 = meta(4, 12296)
    assert not tln._gluon_bwd_takes(x12, x12, None, none)  # not measured there: the Triton kernel
    monkeypatch.setattr(tln, "GLUON_MIN_N", dict.fromkeys(tln.GLUON_MIN_N, 0))
    assert tln._gluon_bwd_takes(x12, x12, None, none)
    monkeypatch.setattr(tln, "_smem_per_program", lambda device: 166912)  # an A100 block
    assert not tln._gluon_bwd_takes(x, x, None, none)
    cpu = torch.empty(4, 16384, dtype=torch.bfloat16)
    monkeypatch.setattr(tln, "_smem_per_program", lambda device: 232448)
    assert not tln._gluon_bwd_takes(cpu, cpu, None, cpu.new_empty(0))


@needs_triton
def test_gluon_fwd_takes_only_what_it_can(monkeypatch):
    """The Gluon forward's gate: the AMP case (16-bit x, fp32 weight), rows of 4104-16384, a
    multiple of 8, 16-byte aligned, no residual; two programs an SM where two fit (N <= 8192)."""
    from ampkernels.triton import layer_norm as tln
    if not tln._gluon.available():
        pytest.skip("this Triton has no Gluon")
    meta = lambda *shape, dtype=torch.bfloat16: torch.empty(*shape, dtype=dtype, device="meta")
    monkeypatch.setattr(tln, "_smem_per_program", lambda device: 232448)
    w32 = lambda n: meta(n, dtype=torch.float32)
    x = meta(4, 16384)
    # by default where it measured faster: LayerNorm from 8192, RMSNorm at 16384
    assert tln._gluon_fwd_programs_per_sm(x, w32(16384), w32(16384), None, False) == 1
    assert tln._gluon_fwd_programs_per_sm(x, w32(16384), None, None, True) == 1
    x8k = meta(4, 8192)
    assert tln._gluon_fwd_programs_per_sm(x8k, w32(8192), w32(8192), None, False) == 2
    assert tln._gluon_fwd_programs_per_sm(x8k, w32(8192), None, None, True) == 0
    assert tln._gluon_fwd_programs_per_sm(meta(4, 5000), w32(5000), w32(5000), None, False) == 0
    monkeypatch.setattr(tln, "GLUON_MIN_N", dict.fromkeys(tln.GLUON_MIN_N, 0))
    for want, xx, w, b, r in ((1, x, w32(16384), w32(16384), None), (1, x, w32(16384), None, None),
                              (2, meta(4, 8192, dtype=torch.float16), w32(8192), w32(8192), None),
                              (2, meta(4, 4104), w32(4104), None, None),
                              (0, meta(4, 4096), w32(4096), None, None), (0, meta(4, 16392), w32(16392), None, None),
                              (0, meta(4, 12290), w32(12290), None, None), (0, x, meta(16384), None, None),
                              (0, x, None, None, None), (0, meta(4, 16384, dtype=torch.float32), w32(16384), None, None),
                              (0, x, w32(16384), None, x)):
        assert tln._gluon_fwd_programs_per_sm(xx, w, b, r, False) == want, (xx.shape, xx.dtype, w is not None,
                                                                           r is not None)
    misaligned = torch.empty(4 * 8192 + 1, dtype=torch.bfloat16)[1:].view(4, 8192)
    assert not tln._gluon.fwd_eligible(misaligned, None)
    monkeypatch.setattr(tln, "_smem_per_program", lambda device: 166912)  # an A100 block: 16384 does not fit
    assert tln._gluon_fwd_programs_per_sm(x, w32(16384), w32(16384), None, False) == 0


def test_triton_bwd_config_stages_and_fit():
    """Launch-config choice (pure Python), and the shared-memory fit that lowers num_stages or
    takes the looped kernel."""
    pytest.importorskip("triton")
    from ampkernels.triton import layer_norm as tln
    h200_smem = 232448
    try:
        tln._bwd_config.cache_clear()
        assert tln._bwd_config(768) == (1024, 2, 4, 4, False, 3)
        assert tln._bwd_config(16384) == (16384, 1, 16, 1, False, 2)
        assert tln._bwd_config(65536)[4]
        # RMSNorm's own launch at 16384, by params width
        assert tln._bwd_config(16384, True) == (16384, 1, 32, 1, False, 1)
        assert tln._bwd_config(16384, True, True) == (16384, 1, 16, 1, False, 1)
        assert tln._bwd_config(8192, True) == tln._bwd_config(8192)
        t = {dt: torch.empty(0, dtype=dt) for dt in (torch.float16, torch.float32)}
        h, f = t[torch.float16], t[torch.float32]
        cfg = tln._bwd_config(16384)
        assert tln._bwd_fit(cfg, h200_smem, h, h, h, None) == cfg  # 160 KB of buffers
        assert tln._bwd_fit(cfg, h200_smem, h, h, f, h) == cfg  # 224 KB
        assert tln._bwd_fit(cfg, h200_smem, h, h, f, f)[4]  # 256 KB: looped
        assert tln._bwd_fit(cfg, h200_smem, f, f, f, None)[4]
        assert tln._bwd_fit(tln._bwd_config(8192), h200_smem, f, f, f, f)[5] == 3
        assert tln._bwd_fit(tln._bwd_config(8192), 100_000, f, f, f, f)[5] == 1
    finally:
        tln._bwd_config.cache_clear()


def test_bench_sweep_times_the_default_bwd_launch():
    """ampkernels/bench/bench_layer_norm.py --sweep: for every benchmark N, the default backward
    config is among the launches it times."""
    pytest.importorskip("triton")
    from ampkernels.triton import layer_norm as tln
    from ampkernels.bench import bench_layer_norm as bench
    tln._bwd_config.cache_clear()
    cases = bench._sweep_cases(bench.NS, ("bwd",))
    ln = {(n, cfg) for n, _, op, w32, cfg in cases if op == "layer_norm" and not w32}
    for n in bench.NS:
        assert (n, tln._bwd_config(n)) in ln, n
    assert all(len(c[4]) == 6 for c in cases) and len(cases) <= 40, len(cases)  # ~3 s of compile each


def test_triton_fwd_config_for_every_row_length_and_params_dtype():
    """A launch for any N, 16-bit or fp32 params (rows longer than _MAX_FWD_BLOCK take the looped
    kernel, which ignores the config, but the lookup must not fail for them)."""
    pytest.importorskip("triton")
    from ampkernels.triton import layer_norm as tln
    for n in (1, 7, 768, 1000, 2048, 3000, 8191, 16384, 16385, 65536):
        for wide in (False, True):
            block, rows, warps, _ = tln._fwd_config(n, wide)
            assert block >= n and block & (block - 1) == 0 and rows >= 1 and warps in (2, 4, 8, 16, 32), (n, wide)


def test_triton_fwd_chunked_dispatch():
    """Which rows the chunked forward takes: all past the register kernel; with params in x's
    dtype, RMSNorm's of 8192 and 16384 elements and LayerNorm's of 16384; never with fp32 params
    up to 16384."""
    pytest.importorskip("triton")
    from ampkernels.triton import layer_norm as tln
    for block in (1024, 8192, 16384):
        assert tln._fwd_chunked(block, True, True) is None  # fp32 params: the register kernel's table
        assert tln._fwd_chunked(block, False, True) is None
    for block in (1024, 4096, 8192):
        assert tln._fwd_chunked(block, False, False) is None
    assert tln._fwd_chunked(4096, True, False) is None
    assert tln._fwd_chunked(8192, True, False) and tln._fwd_chunked(16384, True, False)
    assert tln._fwd_chunked(16384, False, False)
    for is_rms in (False, True):
        for wide in (False, True):
            chunk, warps, unroll = tln._fwd_chunked(32768, is_rms, wide)
            assert chunk & (chunk - 1) == 0 and warps * 32 <= chunk and unroll >= 1


def test_bench_sweep_fwd_covers_the_default_for_both_param_dtypes():
    """--sweep-pass fwd: at each N of the fp32-params table the default forward config is timed
    with 16-bit and with fp32 params, beside the several-rows-a-step alternatives."""
    pytest.importorskip("triton")
    from ampkernels.triton import layer_norm as tln
    from ampkernels.bench import bench_layer_norm as bench
    cases = bench._sweep_cases(bench.NS, ("fwd",))
    assert all(c[1] == "fwd" and len(c[4]) == 4 for c in cases)
    for n in bench.SWEEP_FWD_W32:
        for w32 in (False, True):
            assert (n, "fwd", "layer_norm", w32, tln._fwd_config(n, w32)) in cases, (n, w32)
        assert any(c[0] == n and c[3] and c[4][1] > 1 for c in cases), n


# Compiles the default backward config for sm_90 without a GPU (triton.compile with a
# GPUTarget; ptxas ships with Triton) in a process of its own: this one runs the kernels under
# TRITON_INTERPRET=1, where @triton.jit functions cannot be compiled.
_SM90_PROBE = """
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from ampkernels.triton import layer_norm as tln
fn = tln._norm_bwd_kernel
out = {}
for arg in sys.argv[1:]:  # N, or N/R: N with the RELOAD kernel taking rows over R (16384 is slow to compile)
    n, _, reload_above = arg.partition("/")
    n = int(n)
    tln._MAX_BWD_BLOCK = int(reload_above or tln._MAX_BWD_BLOCK)
    tln._bwd_config.cache_clear()
    block, rows, warps, _, looped, stages = tln._bwd_config(n)
    ptrs = {"DY": "*fp16", "X": "*fp16", "W": "*fp16", "MEAN": "*fp32", "RSTD": "*fp32", "DRO": "*fp16",
            "DX": "*fp16", "DRES": "*fp32", "DW_P": "*fp32", "DB_P": "*fp32"}
    ce = {"IS_RMS": False, "HAS_W": True, "HAS_DRO": False, "HAS_DRES": False, "WANT_DW": True, "WANT_DB": True,
          "BLOCK_N": block, "ROWS": rows, "STAGES": stages, "RELOAD": block > tln._MAX_BWD_BLOCK,
          "MASKED": rows > 1 or block != n}
    sig = {**ptrs, "M": "i32", "N": "i32", "rows_per_prog": "i32", **{k: "constexpr" for k in ce}}
    # as the launcher specializes 16-byte aligned pointers and N % 16 == 0
    attrs = {(fn.arg_names.index(k),): [["tt.divisibility", 16]] for k in [*ptrs, "N"]}
    ck = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=ce, attrs=attrs),
                        target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    out[arg] = {"cfg": [block, rows, warps, 1, looped, stages], "smem": ck.metadata.shared,
                "cp_async": "cp.async" in ck.asm["ptx"], "reload": ce["RELOAD"], "masked": ce["MASKED"],
                "reload_above": tln._MAX_BWD_BLOCK}
print(json.dumps(out))
"""


@needs_triton
def test_triton_bwd_compiles_for_sm90_pipelined():
    """The interpreter ignores num_stages: compile the default backward config for sm_90 at
    N = 768 and a RELOAD config (N = 4096 taking it; 16384, the default one, takes ~20 s to
    compile here), check that the row loop's loads became async copies and that _bwd_fit's
    shared-memory estimate is conservative (the H200 allows 232448 bytes a block)."""
    import json
    import os
    import pathlib
    import subprocess
    import sys

    from ampkernels.triton import layer_norm as tln
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = pathlib.Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, "-c", _SM90_PROBE, "768", "4096/2048"], cwd=root, env=env,
                       capture_output=True, text=True, timeout=300, check=False)
    if r.returncode != 0:
        if "ImportError" in r.stderr or "cannot import" in r.stderr or "ptxas" in r.stderr:
            pytest.skip(f"this Triton cannot compile for sm_90 here: {r.stderr.strip().splitlines()[-1]}")
        raise AssertionError(r.stderr[-3000:])
    h = torch.empty(0, dtype=torch.float16)
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert [(v["reload"], v["masked"]) for v in res.values()] == [(False, True), (True, False)], res
    for arg, v in res.items():
        cfg, smem = tuple(v["cfg"]), v["smem"]
        assert cfg[5] >= 2 and v["cp_async"], f"{arg}: the row loop was not pipelined: {v}"
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(tln, "_MAX_BWD_BLOCK", v["reload_above"])
            assert smem <= 232448 and tln._bwd_fit(cfg, 232448, h, h, h, None) == cfg, v
            # conservative: the estimate does not claim the config fits in less than the compiler takes
            assert tln._bwd_fit(cfg, smem - 1, h, h, h, None) != cfg, v


# ---------------------------------------------------------------- CPU tier: dispatch, errors, plumbing

def test_bad_inputs_are_clear_errors():
    x, w, b = _inputs(4, 16, torch.float32, "cpu")
    with pytest.raises(ValueError, match="normalized_shape"):
        layer_norm(x, 8, w, b)
    with pytest.raises(ValueError, match="weight must have shape"):
        layer_norm(x, 16, w[:8], b)
    with pytest.raises(ValueError, match="bias must have shape"):
        layer_norm(x, 16, w, b[:8])
    with pytest.raises(ValueError, match="residual must have"):
        layer_norm(x, 16, w, b, residual=x[:2])
    with pytest.raises(ValueError, match="weight is on meta"):
        layer_norm(x, 16, w.to("meta"), b)
    with pytest.raises(TypeError, match="floating-point"):
        layer_norm(torch.ones(4, 16, dtype=torch.int32), 16)
    with pytest.raises(ValueError, match="out_dtype"):
        layer_norm(x, 16, out_dtype=torch.int8)
    with pytest.raises(ValueError, match="backend must be one of"):
        layer_norm(x, 16, backend="cudnn")


@pytest.mark.skipif(HAS_CUDA, reason="CPU-only behaviour")
def test_explicit_cuda_on_cpu_is_a_clear_error():
    x, w, b = _inputs(4, 16, torch.float32, "cpu")
    with pytest.raises(RuntimeError, match="layer_norm: backend 'cuda'"):
        layer_norm(x, 16, w, b, backend="cuda")
    with pytest.raises(RuntimeError, match="rms_norm: backend 'cuda'"):
        rms_norm(x, 16, w, backend="cuda")


def test_unsupported_inputs_fall_back_to_the_reference(monkeypatch):
    x, w, b = _inputs(4, 16, torch.float64, "cpu")
    out = layer_norm(x, 16, w, b)  # float64: the reference, exactly torch's math
    assert out.dtype == torch.float64
    assert_rel_close(out, F.layer_norm(x, (16,), w, b), torch.float64)
    xb = randn(4, 16, dtype=torch.bfloat16)
    if not _extension.load():  # the kernel backends' op is missing, whatever the input
        with pytest.raises(RuntimeError, match="the norm kernels run through ampkernels._C"):
            layer_norm(xb, 16, None, None, backend="triton")
    elif backends._available("triton")[0]:
        with pytest.raises(RuntimeError, match="x dtype torch.float64"):
            layer_norm(x, 16, w, b, backend="triton")
        with pytest.raises(RuntimeError, match="weight dtype torch.float16 is neither"):
            layer_norm(xb, 16, w.half(), None, backend="triton")
    seen = []
    monkeypatch.setattr(ln.backends, "select", lambda op, be, dev, pref, unsupported=None: seen.append(
        (op, pref, unsupported)) or "torch")
    layer_norm(xb, 16, w.half(), None)
    rms_norm(x.float(), 16)
    assert seen[0][0] == "layer_norm" and "neither" in seen[0][2]
    # one choice: both passes prefer the same
    assert seen[1:] == [("rms_norm", ("cuda", "triton"), None if _extension.load() else seen[1][2])]


def test_auto_preference_per_pass():
    x = torch.empty(1).expand(ln._HOST_BOUND_ELEMENTS)  # the size counts, not the values
    assert ln._preferences(x, None, False) == ln._preferences(x, torch.float32, False) == \
        (("triton", "cuda"), ("cuda", "triton"))
    # the AMP case, 16-bit x with fp32 params: the CUDA forward
    xh = torch.empty(1, dtype=torch.float16).expand(ln._HOST_BOUND_ELEMENTS)
    assert ln._preferences(xh, torch.float32, False) == (("cuda", "triton"), ("cuda", "triton"))
    assert ln._preferences(xh, torch.float16, False) == (("triton", "cuda"), ("cuda", "triton"))
    # smaller: host-bound, the extension's cheaper launch first in both passes
    assert ln._preferences(randn(2, 8), None, False) == (("cuda", "triton"), ("cuda", "triton"))
    # under torch.compile: inductor gets the op, both passes
    assert ln._preferences(x, None, True) == (("torch",), ("torch",))


@needs_triton
@pytest.mark.parametrize("is_rms", [False, True])
def test_forward_and_backward_backends_can_differ(reference_as_cuda_kernels, is_rms):
    """What "auto" relies on: one backend's saved tensors feed the other's backward (the op's
    passes, "cuda" standing for the reference on CPU)."""
    _interp()
    x, w, b = _inputs(6, 40, torch.float16, "cpu", torch.float32)
    r = randn(6, 40, dtype=torch.float16)
    grads = []
    for fwd_be, bwd_be in (("triton", "cuda"), ("cuda", "triton"), ("cuda", "cuda")):
        ins = [t.detach().clone().requires_grad_() for t in (x, w, b, r)]
        out, s = torch.ops.ampkernels.norm(ins[0], ins[1], None if is_rms else ins[2], ins[3], 1e-5, is_rms, None,
                                           True, fwd_be, bwd_be)
        (out.float().square().sum() + s.sum()).backward()
        grads.append([t.grad for t in ins])
    for got in grads[:2]:
        for a, c in zip(got, grads[2]):
            if c is not None:
                assert_rel_close(a, c.double(), a.dtype if a.dtype != torch.float32 else torch.float16)


def test_auto_on_cpu_runs_torch():
    x, w, b = _inputs(4, 16, torch.float32, "cpu")
    assert backends.select("layer_norm", None, x.device, ln._preferences(x, None, False)[0]) == "torch"


@pytest.mark.parametrize("is_rms", [False, True])
def test_fp32_params_and_bias_dtype_mix(is_rms):
    x, w, b = _inputs(5, 24, torch.float16, "cpu", torch.float32)
    _check(is_rms, x, w, b.half() if b is not None else None, "torch")


def _opcheck(backend, dtype, device="cpu"):
    """The op and its kernels: schemas, fakes, autograd registration, AOT tracing."""
    x, w, b = _inputs(6, 24, dtype, device, torch.float32)
    r = randn(6, 24, dtype=dtype, device=device)
    op = torch.ops.ampkernels.norm.default
    torch.library.opcheck(op, (x, w, b, r, 1e-5, False, None, True, backend, backend))
    torch.library.opcheck(op, (x, w, None, None, 1e-6, True, torch.float32, False, backend, backend))
    fwd = getattr(torch.ops.ampkernels, f"norm_fwd_{backend}").default
    bwd = getattr(torch.ops.ampkernels, f"norm_bwd_{backend}").default
    torch.library.opcheck(fwd, (x, w, b, r, 1e-5, False, None, True, True))
    torch.library.opcheck(fwd, (x, w, b, r, 1e-5, False, None, False, False))  # inference: no stats
    out, s, mean, rstd = fwd(x, w, b, r, 1e-5, False, None, True, True)
    dy = randn(6, 24, dtype=dtype, device=device)
    torch.library.opcheck(bwd, (dy, s, w, mean, rstd, s.clone(), False, True, True, dtype, torch.float32,
                                torch.float32))
    _, _, mean, rstd = fwd(x, None, None, None, 1e-6, True, None, False, True)
    torch.library.opcheck(bwd, (dy, x, None, mean, rstd, None, True, False, False, dtype, None, None))


def test_opcheck_cpu_reference_as_cuda_kernels(reference_as_cuda_kernels):
    _opcheck("cuda", torch.float32)


@needs_triton
def test_opcheck_cpu_triton_interpret():
    _interp()
    _opcheck("triton", torch.float16)


@pytest.mark.parametrize("backend", ["torch"] + ([pytest.param("triton", marks=needs_triton)] if not HAS_CUDA else []))
def test_compile_fullgraph_cpu(backend):
    dtype = torch.float32 if backend == "torch" else torch.float16
    x, w, b = _inputs(6, 32, dtype, "cpu", torch.float32, lead=(2,))
    r = randn(2, 6, 32, dtype=dtype)

    def block(x, r, w, b):
        h, s = layer_norm(x, 32, w, b, residual=r, residual_in_fp32=True, backend=backend)
        return rms_norm(h * 2, 32, w, 1e-6, backend=backend).float().sum() + s.sum()

    torch._dynamo.reset()
    fn = torch.compile(block, fullgraph=True, backend="aot_eager")
    ins = [t.detach().requires_grad_() for t in (x, r, w, b)]
    ins_ref = [t.detach().requires_grad_() for t in (x, r, w, b)]
    fn(*ins).backward()
    block(*ins_ref).backward()
    for a, c in zip(ins, ins_ref):
        if backend == "torch":  # compiled, "torch" is torch's own norms (traced), eager the reference
            assert_rel_close(a.grad, c.grad, torch.float32, factor=10, what="grad")
        else:  # the same kernels both ways
            assert torch.equal(a.grad, c.grad)


needs_ext = pytest.mark.skipif(not _extension.load(), reason=f"extension not built: {_extension.status()[1]}")


@needs_ext
@pytest.mark.parametrize("name", ["norm_fwd_cuda", "norm_bwd_cuda"])
def test_extension_schemas(name):
    assert getattr(torch.ops.ampkernels, name).default._schema.name == f"ampkernels::{name}"


@needs_ext
def test_extension_cpu_tensor_is_a_clear_error():
    x, w, b = _inputs(4, 16, torch.float16, "cpu")
    with pytest.raises(RuntimeError, match="norm_fwd_cuda: x must be a CUDA tensor, got a tensor on cpu"):
        torch.ops.ampkernels.norm_fwd_cuda(x, w, b, None, 1e-5, False, None, False)
    rstd = torch.ones(4)
    with pytest.raises(RuntimeError, match="norm_bwd_cuda: x must be a CUDA tensor"):
        torch.ops.ampkernels.norm_bwd_cuda(x, x, w, rstd, rstd, None, False, True, True, torch.float16, None, None)


# ---------------------------------------------------------------- GPU tier

GPU_BACKENDS = ["cuda", "triton", "torch"]
NS = [1, 7, 768, 1000, 1024, 1536, 2048, 4096, 8192, 10000, 12288, 16384, 65536]  # 10000: a partial chunk
DTYPE_COMBOS = [(torch.float16, torch.float16), (torch.float16, torch.float32), (torch.bfloat16, torch.bfloat16),
                (torch.bfloat16, torch.float32), (torch.float32, torch.float32)]


def _rows(n):
    return max(4, min(300, 2**18 // n))


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cuda", "triton"])
@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("is_rms", [False, True])
def test_gpu_sizes(backend, n, is_rms):
    x, w, b = _inputs(_rows(n), n, torch.bfloat16, "cuda", torch.float32)
    x[1] = 0  # an all-zero row
    _check(is_rms, x, w, b, backend, eps=_eps(n))
    if n > 1:  # (at N = 1 and mean 1000, RMSNorm's dx ~ 1e-9 is below fp16's range)
        x, w, b = _inputs(_rows(n), n, torch.float16, "cuda", mean=1000.0)  # large mean + noise
        _check(is_rms, x, w, b, backend, eps=_eps(n))


@pytest.mark.gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("dtype,pdtype", DTYPE_COMBOS)
@pytest.mark.parametrize("is_rms", [False, True])
def test_gpu_dtype_combos(backend, dtype, pdtype, is_rms):
    for n in (1000, 4096):
        x, w, b = _inputs(257, n, dtype, "cuda", pdtype)
        _check(is_rms, x, w, b, backend)
    x, w, b = _inputs(64, 1024, dtype, "cuda", pdtype, affine=False)
    _check(is_rms, x, w, b, backend)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cuda", "triton"])
@pytest.mark.parametrize("is_rms", [False, True])
@pytest.mark.parametrize("n", [1000, 2048, 65536])
def test_gpu_residual_paths(backend, is_rms, n):
    m = _rows(n)
    x, w, b = _inputs(m, n, torch.bfloat16, "cuda", torch.float32, lead=(2,))
    for r, in_fp32 in ((randn(2, m, n, dtype=torch.bfloat16, device="cuda"), False),
                       (randn(2, m, n, device="cuda"), True), (randn(2, m, n, device="cuda"), False)):
        _check(is_rms, x, w, b, backend, residual=r, residual_in_fp32=in_fp32)
    _check(is_rms, x, w, b, backend, residual=randn(2, m, n, dtype=torch.bfloat16, device="cuda"),
           use_res_out=False)
    _check(is_rms, x, w, b, backend, out_dtype=torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cuda", "triton"])
def test_gpu_strided_misaligned_and_3d(backend):
    big = randn(64, 3, 1030, dtype=torch.float16, device="cuda")
    w, b = randn(1024, device="cuda"), randn(1024, device="cuda")
    for x in (big[:, 1, 3:1027], big[:, 0, :1024], big[:, :, :1024].transpose(0, 1)):
        for is_rms in (False, True):
            _check(is_rms, x, w, b, backend)
    base = randn(300 * 768 + 1, dtype=torch.bfloat16, device="cuda")
    _check(False, base[1:].view(3, 100, 768), randn(768, device="cuda"), randn(768, device="cuda"), backend)
    x4 = randn(2, 3, 5, 16, 48, dtype=torch.bfloat16, device="cuda")
    out = layer_norm(x4, (16, 48), backend=backend)
    assert_rel_close(out, F.layer_norm(x4.double(), (16, 48)), torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("is_rms", [False, True])
@pytest.mark.parametrize("dtype,pdtype", [(torch.bfloat16, torch.float32), (torch.float32, torch.float32),
                                          (torch.float16, torch.float16)])
def test_gpu_few_and_many_rows_param_grads(is_rms, dtype, pdtype):
    # the cuda backward writes fp32 parameter grads of a one-block call in place (no partials,
    # no reduce kernel), and keeps both partials of a larger call in one buffer
    for m, n in ((1, 256), (3, 256), (8, 256), (5, 1000), (2, 4096), (2, 20000), (300, 256), (1000, 1000)):
        x, w, b = _inputs(m, n, dtype, "cuda", pdtype, lead=(2,) if m == 3 else ())
        _check(is_rms, x, w, b, "cuda")
        _check(is_rms, x, w, None, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cuda", "triton"])
@pytest.mark.parametrize("n", [1024, 8192, 65536])
def test_gpu_param_grads_bitwise_repeatable(backend, n):
    x, w, b = _inputs(2**20 // n, n, torch.bfloat16, "cuda", torch.float32)
    dy = randn(*x.shape, dtype=torch.bfloat16, device="cuda")
    grads = []
    for _ in range(2):
        ww, bb = w.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
        layer_norm(x, n, ww, bb, backend=backend).backward(dy)
        grads.append((ww.grad, bb.grad))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cuda", "triton"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_autocast_keeps_activation_dtype(backend, dtype):
    lin = torch.nn.Linear(512, 768, device="cuda")
    norm = torch.nn.LayerNorm(768, device="cuda")
    x = randn(64, 512, device="cuda")
    with torch.autocast("cuda", dtype=dtype):
        h = lin(x)
        out = layer_norm(h, 768, norm.weight, norm.bias, backend=backend)
        out2 = rms_norm(h, 768, norm.weight, 1e-6, backend=backend)
    assert h.dtype == dtype and out.dtype == dtype and out2.dtype == dtype
    (out.float().sum() + out2.float().sum()).backward()
    assert norm.weight.grad.dtype == torch.float32 and lin.weight.grad is not None
    assert_rel_close(out, F.layer_norm(h.detach().double(), (768,), norm.weight.double(), norm.bias.double()), dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cuda", "triton"])
def test_gpu_nan_inf_zero_rows_and_empty(backend):
    x, w, b = _inputs(8, 1024, torch.float16, "cuda", torch.float32)
    x[1] = 0
    x[2, 5] = float("nan")
    x[3, 7] = float("inf")
    for is_rms in (False, True):
        out = _norm(is_rms, x, 1024, w, b, 1e-5, backend=backend)
        want = F.rms_norm(x.float(), (1024,), w, 1e-5) if is_rms else F.layer_norm(x.float(), (1024,), w, b, 1e-5)
        assert torch.equal(torch.isnan(out), torch.isnan(want))
        assert torch.isfinite(out[[0, 1, 4, 5, 6, 7]]).all()
    x0 = randn(0, 256, dtype=torch.float16, device="cuda", requires_grad=True)
    ww = randn(256, device="cuda", requires_grad=True)
    out = layer_norm(x0, 256, ww, None, backend=backend)
    assert out.shape == (0, 256)
    out.sum().backward()
    assert torch.equal(ww.grad, torch.zeros_like(ww))


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cuda", "triton"])
def test_gpu_opcheck(backend):
    _opcheck(backend, torch.float16, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cuda", "triton"])
def test_gpu_compile_fullgraph(backend):
    x, w, b = _inputs(128, 1024, torch.bfloat16, "cuda", torch.float32)
    r = randn(128, 1024, dtype=torch.bfloat16, device="cuda")

    def block(x, r, w, b):
        h, s = layer_norm(x, 1024, w, b, residual=r, backend=backend)
        return (rms_norm(h, 1024, w, 1e-6, backend=backend).float() * 3).sum() + s.float().sum()

    torch._dynamo.reset()
    fn = torch.compile(block, fullgraph=True, backend="inductor" if backend == "cuda" else "aot_eager")
    ins = [t.detach().requires_grad_() for t in (x, r, w, b)]
    ins_ref = [t.detach().requires_grad_() for t in (x, r, w, b)]
    fn(*ins).backward()
    block(*ins_ref).backward()
    for a, c in zip(ins, ins_ref):
        assert_rel_close(a.grad, c.grad, torch.bfloat16, factor=0.1)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cuda", "triton"])
def test_gpu_cuda_graph_capture(backend):
    x, w, b = _inputs(512, 2048, torch.float16, "cuda", torch.float32)
    x.requires_grad_(), w.requires_grad_(), b.requires_grad_()
    dy = randn(512, 2048, dtype=torch.float16, device="cuda")

    def step():
        for t in (x, w, b):
            t.grad = None
        out = layer_norm(x, 2048, w, b, backend=backend)
        out.backward(dy)
        return out

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            step()  # warm up (Triton compiles, allocator pools) outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    want = (step().detach().clone(), x.grad.clone(), w.grad.clone())
    graph = torch.cuda.CUDAGraph()
    for t in (x, w, b):
        t.grad = None
    with torch.cuda.graph(graph):
        out = layer_norm(x, 2048, w, b, backend=backend)
        out.backward(dy)
    with torch.no_grad():
        x.mul_(1.0)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want[0]) and torch.equal(x.grad, want[1]) and torch.equal(w.grad, want[2])


@pytest.mark.gpu
@pytest.mark.parametrize("n,wdtype", [(4096, torch.float32), (32768, torch.float16)])  # Triton: register / chunked
def test_gpu_64bit_indexing(n, wdtype):
    """A tensor over 2^31 elements: the last rows must be right (offsets need 64 bits)."""
    m = 2**31 // n + 3
    x = torch.randn(m, n, dtype=torch.float16, device="cuda")
    w = randn(n, device="cuda", dtype=wdtype)
    for backend in ("cuda", "triton"):
        out = layer_norm(x, n, w, None, backend=backend)
        tail = slice(m - 5, m)
        assert_rel_close(out[tail], F.layer_norm(x[tail].double(), (n,), w.double()), torch.float16)
        del out
    torch.cuda.empty_cache()


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1024, 8192])
@pytest.mark.parametrize("is_rms", [False, True])
def test_gpu_auto_per_pass_backends(n, is_rms):
    """"auto" may run the forward on Triton and the backward on CUDA (N > 4096): still exact."""
    x, w, b = _inputs(_rows(n), n, torch.bfloat16, "cuda", torch.float32)
    _check(is_rms, x, w, b, None, residual=randn(*x.shape, device="cuda"), residual_in_fp32=True)
    _check(is_rms, x, w, b, None)


def _spy_launches(monkeypatch, tln):
    """The kernels tln launches through launch() (a kept launch reruns without it)."""
    ran, real = [], tln.launch

    def spy(kernel, *args, **kwargs):
        ran.append(kernel)
        return real(kernel, *args, **kwargs)
    monkeypatch.setattr(tln, "launch", spy)
    return ran


@pytest.mark.gpu
@pytest.mark.parametrize("n", [16384, 12296, 8200])
@pytest.mark.parametrize("is_rms", [False, True])
def test_gpu_gluon_bwd(n, is_rms, monkeypatch):
    """The Gluon backward (at every N it takes) against float64: both 16-bit dtypes, 16-bit
    and fp32 params and none, one row, rows not a multiple of the programs, an all-zero row, a
    large mean, a 3-D input; its dweight/dbias bitwise repeatable."""
    from ampkernels.triton import layer_norm as tln
    if not tln._gluon.available():
        pytest.skip("this Triton has no Gluon")
    monkeypatch.setattr(tln, "GLUON_MIN_N", dict.fromkeys(tln.GLUON_MIN_N, 0))
    ran = _spy_launches(monkeypatch, tln)
    for dtype, pdtype, m in ((torch.bfloat16, torch.float32, 300), (torch.float16, torch.float16, 133),
                             (torch.bfloat16, torch.bfloat16, 1)):
        x, w, b = _inputs(m, n, dtype, "cuda", pdtype)
        x[m // 2] = 0
        _check(is_rms, x, w, b, "triton")
    x, _, _ = _inputs(64, n, torch.float16, "cuda", mean=1000.0)
    _check(is_rms, x, None, None, "triton")
    x, w, b = _inputs(70, n, torch.bfloat16, "cuda", torch.float32, lead=(3,))
    _check(is_rms, x, w, b, "triton")
    assert tln._gluon.norm_bwd_smem_kernel in ran, "the Gluon backward did not run"

    dy = randn(*x.shape, dtype=torch.bfloat16, device="cuda")
    grads = []
    for _ in range(2):
        ww, bb = w.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
        _norm(is_rms, x, n, ww, bb, 1e-5, backend="triton").backward(dy)
        grads.append((ww.grad, bb.grad))
    assert torch.equal(grads[0][0], grads[1][0])
    if not is_rms:
        assert torch.equal(grads[0][1], grads[1][1])


@pytest.mark.gpu
@pytest.mark.parametrize("n", [16384, 12296, 8192, 5000])
@pytest.mark.parametrize("is_rms", [False, True])
def test_gpu_gluon_fwd(n, is_rms, monkeypatch):
    """The Gluon forward (at every N it takes; 16-bit x with fp32 params) against float64, for
    training and inference: both 16-bit dtypes, one row, rows not a multiple of the programs, an
    all-zero row, a large mean, a 3-D input."""
    from ampkernels.triton import layer_norm as tln
    if not tln._gluon.available():
        pytest.skip("this Triton has no Gluon")
    monkeypatch.setattr(tln, "GLUON_MIN_N", dict.fromkeys(tln.GLUON_MIN_N, 0))
    ran = _spy_launches(monkeypatch, tln)
    for dtype, m in ((torch.bfloat16, 300), (torch.float16, 133), (torch.bfloat16, 1)):
        x, w, b = _inputs(m, n, dtype, "cuda", torch.float32)
        x[m // 2] = 0
        _check(is_rms, x, w, b, "triton")
    x, w, b = _inputs(64, n, torch.float16, "cuda", torch.float32, mean=1000.0)
    _check(is_rms, x, w, b, "triton")
    x, w, b = _inputs(70, n, torch.bfloat16, "cuda", torch.float32, lead=(3,))
    _check(is_rms, x, w, None, "triton")
    assert tln._gluon.norm_fwd_smem_kernel in ran, "the Gluon forward did not run"


@pytest.mark.gpu
def test_gpu_gluon_bwd_64bit_indexing(monkeypatch):
    """The Gluon kernels over a tensor of more than 2^31 elements: the last rows' output and dx
    right."""
    from ampkernels.triton import layer_norm as tln
    if not tln._gluon.available():
        pytest.skip("this Triton has no Gluon")
    monkeypatch.setattr(tln, "GLUON_MIN_N", dict.fromkeys(tln.GLUON_MIN_N, 0))
    ran = _spy_launches(monkeypatch, tln)
    n = 16384
    m = 2**31 // n + 3
    x = torch.randn(m, n, dtype=torch.bfloat16, device="cuda")
    dy = torch.randn(m, n, dtype=torch.bfloat16, device="cuda")
    w = randn(n, device="cuda", scale=0.5, offset=1.0)
    out, _, mean, rstd = tln.norm_fwd(x, w, None, None, 1e-5, False, None, False)
    dx = tln.norm_bwd(dy, x, w, mean, rstd, None, False, True, False, torch.bfloat16, None, torch.float32)[0]
    assert tln._gluon.norm_fwd_smem_kernel in ran and tln._gluon.norm_bwd_smem_kernel in ran, ran
    tail = slice(m - 5, m)
    x6 = x[tail].double().requires_grad_()
    out6 = F.layer_norm(x6, (n,), w.double())
    out6.backward(dy[tail].double())
    assert_rel_close(out[tail], out6, torch.bfloat16)
    assert_rel_close(dx[tail], x6.grad, torch.bfloat16, factor=GRAD_FACTOR)
    del x, dy, dx, out
    torch.cuda.empty_cache()


# ---------------------------------------------------------------- the C++ autograd of the cuda backend

def _reference_fwd(x, weight, bias, residual, eps, is_rms, out_dtype, residual_in_fp32, want_stats=True):
    out, s, mean, rstd = reference.norm_forward(x, weight, bias, eps, residual=residual,
                                                residual_in_fp32=residual_in_fp32, out_dtype=out_dtype,
                                                is_rms=is_rms)
    none = x.new_empty(0, dtype=torch.float32)
    return (out, x.new_empty(0) if s is None else s,
            mean.contiguous() if mean is not None and want_stats else none.clone(),
            rstd.contiguous() if want_stats else none.clone())


def _reference_bwd(dy, x, weight, mean, rstd, dresidual_out, is_rms, want_dweight, want_dbias, dx_dtype,
                   dresidual_dtype, param_dtype):
    dx, dw, db = reference.norm_backward(dy, x, weight, None if is_rms else mean, rstd, dresidual_out=dresidual_out,
                                         is_rms=is_rms, want_dweight=want_dweight, want_dbias=want_dbias,
                                         dx_dtype=torch.float32, param_dtype=param_dtype)
    dres = x.new_empty(0)
    if dresidual_dtype is not None and dresidual_dtype != dx_dtype:
        dres = dx.to(dresidual_dtype, copy=True)
    pd = param_dtype or (weight.dtype if weight is not None else x.dtype)
    return (dx.to(dx_dtype, copy=True), dres, x.new_empty(0, dtype=pd) if dw is None else dw,
            x.new_empty(0, dtype=pd) if db is None else db)


@pytest.fixture
def reference_as_cuda_kernels(monkeypatch):
    """norm_{fwd,bwd}_cuda run the reference on CPU: the op's C++ autograd checked there."""
    yield from cuda_kernels_on_cpu(monkeypatch, {"norm_fwd_cuda": _reference_fwd, "norm_bwd_cuda": _reference_bwd})


def _grads_of(outs, leaves, seed):
    g = torch.Generator().manual_seed(seed)
    loss = sum((o.float() * torch.randn(o.shape, generator=g)).sum() for o in outs)
    return torch.autograd.grad(loss, [t for t in leaves if t is not None and t.requires_grad], allow_unused=True)


@pytest.mark.parametrize("is_rms", [False, True])
@pytest.mark.parametrize("xdt,pdt", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                     (torch.float16, torch.float16), (torch.bfloat16, None)])
@pytest.mark.parametrize("res", [None, "same", "fp32"])
@pytest.mark.parametrize("lead", [(5,), (2, 3), ()])
def test_cpp_autograd_matches_torch_backend(reference_as_cuda_kernels, is_rms, xdt, pdt, res, lead):
    # x of any rank goes to the C++ op as it is (the rows are viewed below autograd)
    n = 48
    for out_dtype, bias_dt, grad_of in ((None, pdt, "all"), (torch.bfloat16, torch.float32, "x"),
                                        (None, pdt, "residual_out")):
        x = randn(*lead, n, dtype=xdt).requires_grad_(grad_of != "none")
        w = None if pdt is None else randn(n, dtype=pdt, scale=0.5, offset=1.0).requires_grad_(grad_of == "all")
        b = None if is_rms or bias_dt is None else randn(n, dtype=bias_dt).requires_grad_(grad_of == "all")
        if w is not None and b is not None and b.dtype != w.dtype and pdt != torch.float32:
            b = b.to(w.dtype).detach().requires_grad_(grad_of == "all")
        r = None if res is None else randn(*lead, n, dtype=torch.float32 if res == "fp32" else xdt).requires_grad_()
        kw = dict(residual=r, residual_in_fp32=res == "fp32", out_dtype=out_dtype)
        leaves = (x, w, b, r)
        got = _norm(is_rms, x, n, w, b, 1e-5, backend="cuda", **kw)  # the op: its C++ autograd
        want = _norm(is_rms, x, n, w, b, 1e-5, backend="torch", **kw)  # the same math, torch's autograd
        got, want = (t if isinstance(t, tuple) else (t,) for t in (got, want))
        assert "NormBackward" in got[0].grad_fn.name() and all(t.shape == x.shape for t in got)
        assert all(torch.equal(a, e) and a.dtype == e.dtype for a, e in zip(got, want))
        used = got[1:] if grad_of == "residual_out" and r is not None else got
        want_used = want[1:] if grad_of == "residual_out" and r is not None else want
        for a, e in zip(_grads_of(used, leaves, 1), _grads_of(want_used, leaves, 1)):
            assert (a is None) == (e is None)
            if a is not None:
                assert a.dtype == e.dtype
                assert_rel_close(a, e.double(), a.dtype if a.dtype != torch.float32 else torch.float16)


def test_cpp_autograd_of_nd_x_keeps_inplace_checks(reference_as_cuda_kernels):
    # as linear_act's: the outputs are no views, and the saved residual sum is the returned tensor,
    # version-checked in backward
    x = randn(2, 3, 48, dtype=torch.bfloat16).requires_grad_()
    r = randn(2, 3, 48, dtype=torch.bfloat16).requires_grad_()
    w = randn(48, dtype=torch.float32, offset=1.0).requires_grad_()
    out, s = layer_norm(x, 48, w, residual=r, backend="cuda")
    assert "NormBackward" in out.grad_fn.name() and out._base is None and s._base is None
    out.mul_(2)  # outputs may be edited in place (no views)
    s.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (out.float().sum() + s.float().sum()).backward()


def test_cpp_autograd_node_lifecycle(reference_as_cuda_kernels):
    # the hand-written node as torch's own: saved tensors go through saved-tensor hooks (what
    # activation checkpointing and offloading build on), retain_graph replays, a second backward
    # without it fails clearly, and forward-mode AD is refused rather than silently dropped
    x = randn(3, 5, 48, dtype=torch.bfloat16).requires_grad_()
    r = randn(3, 5, 48, dtype=torch.float32).requires_grad_()
    w = randn(48, dtype=torch.float32, offset=1.0).requires_grad_()
    b = randn(48, dtype=torch.float32).requires_grad_()
    packed = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or len(packed) - 1,
                                                  lambda i: packed[i]):
        out, s = layer_norm(x, 48, w, b, residual=r, residual_in_fp32=True, backend="cuda")
    assert len(packed) == 4 and packed[0] is s  # the residual sum, the weight, mean, rstd
    g = randn(*out.shape, dtype=out.dtype)
    first = torch.autograd.grad(out, (x, r, w, b), g, retain_graph=True)
    again = torch.autograd.grad(out, (x, r, w, b), g)
    assert all(torch.equal(a, e) and a.dtype == p.dtype for a, e, p in zip(first, again, (x, r, w, b)))
    with pytest.raises(RuntimeError, match="second time"):
        torch.autograd.grad(out, (x,), g)

    def block(x):
        return layer_norm(x, 48, w, b, backend="cuda").float().square().sum()
    plain = torch.autograd.grad(block(x), (x, w, b))
    ckpt = torch.autograd.grad(torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False), (x, w, b))
    assert all(torch.equal(a, e) for a, e in zip(plain, ckpt))

    import torch.autograd.forward_ad as fwAD
    for params in ((w, b), (w.detach(), b.detach())):  # building a graph or not
        with fwAD.dual_level(), pytest.raises(RuntimeError, match="forward-mode AD"):
            layer_norm(fwAD.make_dual(x.detach().float(), torch.ones(3, 5, 48)), 48, *params, backend="cuda")
