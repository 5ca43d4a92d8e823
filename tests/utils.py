"""Shared test helpers: relative-error checks against float64 references, CPU stand-ins for the
extension's kernels."""
import contextlib

import pytest
import torch
import torch.nn.functional as F

from ampkernels import _extension, backends, reference

# the norms' and the GEMM ops' kernel backends run through the extension's ops (ampkernels::norm, ...)
needs_triton_ops = pytest.mark.skipif(not (backends._available("triton")[0] and _extension.load()),
                                      reason="triton unavailable, or the extension (the ops) not built")
needs_extension = pytest.mark.skipif(not _extension.load(), reason="the extension (the ops) not built")

# ‖out − ref‖ / ‖ref‖ bounds (docs/design.md).
TOL = {torch.float16: 1e-3, torch.bfloat16: 8e-3, torch.float32: 1e-5, torch.float64: 1e-12}


def rel_err(out, ref):
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def assert_rel_close(out, ref, dtype=None, factor=1.0, what="output"):
    """Relative Frobenius error within TOL[dtype] * factor; NaN never passes; shapes must match."""
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    assert not torch.isnan(out).any() or torch.isnan(ref).any(), f"{what}: NaN in output"
    tol = TOL[dtype or out.dtype] * factor
    err = rel_err(out, ref)
    assert err <= tol, f"{what}: relative error {err:.3e} > {tol:.1e}"


def poison_(t):
    """Fill a tensor with NaN so that a kernel that skips a write is caught."""
    return t.fill_(float("nan")) if t.is_floating_point() else t.fill_(-1)


def randn(*shape, dtype=torch.float32, device="cpu", scale=1.0, offset=0.0, requires_grad=False):
    t = torch.randn(*shape, dtype=torch.float32, device=device) * scale + offset
    return t.to(dtype).requires_grad_(requires_grad)


def _name(act):
    return reference.ACTIVATIONS[act]


def _linear_fwd(x, w, b, act, store_pre, fuse):
    z = F.linear(x, w, b)
    return reference.act_fwd(z, _name(act)), z.clone() if store_pre else x.new_empty(0, 0)


def _dz(dy, saved, act):
    return dy if act == 0 else reference.act_backward_into(dy, saved, _name(act), torch.empty_like(dy))


def _linear_bwd(dy, x, w, saved, act, need_dx, need_dw, need_db, fuse):
    dz, empty = _dz(dy, saved, act), dy.new_empty(0)
    return (dz.mm(w) if need_dx else empty, dz.t().mm(x) if need_dw else empty.clone(),
            dz.sum(0, dtype=torch.float32).to(dy.dtype) if need_db else empty.clone())


def _fp32_sums(t, need):
    return t.sum(0, dtype=torch.float32) if need else t.new_empty(0, dtype=torch.float32)


def _act_backward_(dy, saved, act, need_db):
    dy.copy_(_dz(dy, saved, act))
    return _fp32_sums(dy, need_db)


def _bias_act_fwd(z, bias, act, store_pre):
    pre = z if bias is None else z + bias
    return reference.act_fwd(pre, _name(act)), pre.clone() if store_pre else z.new_empty(0)


def _gated_fwd(x, wg, wu, bg, bu, act, store):
    gu = torch.cat([F.linear(x, wg, bg), F.linear(x, wu, bu)], 1)
    return _gated_act_fwd(gu, act), gu if store else x.new_empty(0, 0)


def _gated_act_fwd(gu, act):
    return reference.gated_act_into(gu, _name(act), gu.new_empty(gu.shape[0], gu.shape[1] // 2))


def _gated_act_bwd(dh, gu, dgu, act, need_db):
    reference.gated_act_backward_into(dh, gu, _name(act), dgu)
    return _fp32_sums(dgu, need_db)


# CPU stand-ins for the extension's GEMM kernel ops: their contracts, on the reference
REFERENCE_GEMM_KERNELS = {
    "linear_act_fwd_cuda": _linear_fwd, "linear_act_bwd_cuda": _linear_bwd, "act_backward_cuda_": _act_backward_,
    "bias_act_fwd_cuda": _bias_act_fwd, "gated_linear_act_fwd_cuda": _gated_fwd,
    "gated_act_fwd_cuda": _gated_act_fwd, "gated_act_bwd_cuda": _gated_act_bwd,
}


@contextlib.contextmanager
def kernels_on_cpu(impls):
    """Each op of `impls` ({"norm_fwd_cuda": fn, ...}) gets fn as its CPU kernel, for the block."""
    lib = torch.library.Library("ampkernels", "IMPL")
    try:
        for name, fn in impls.items():
            lib.impl(name, fn, "CPU")
        yield
    finally:
        lib._destroy()


def cuda_kernels_on_cpu(monkeypatch, impls=REFERENCE_GEMM_KERNELS):
    """Generator for a fixture: each op of `impls` gets its CPU kernel and "cuda" is chosen on
    CPU, so that the ops' C++ autograd, which reaches the kernels through the dispatcher, and the
    Python that routes to it run on CPU."""
    if not _extension.load():
        pytest.skip(f"extension not built here: {_extension.status()[1]}")
    monkeypatch.setattr(backends, "select", lambda op, backend, device, pref, unsupported=None: "cuda")
    with kernels_on_cpu(impls):
        yield
