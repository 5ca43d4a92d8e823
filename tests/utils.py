"""Shared test helpers: relative-error checks against float64 references."""
import pytest
import torch

from ampkernels import _extension, backends

# the norms' kernel backends run through the extension's op (ampkernels::norm)
needs_norm_triton = pytest.mark.skipif(not (backends._available("triton")[0] and _extension.load()),
                                       reason="triton unavailable, or the extension (the norms' op) not built")

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


def cuda_kernels_on_cpu(monkeypatch, impls):
    """Generator for a fixture: each op of `impls` ({"norm_fwd_cuda": fn, ...}) gets fn as its CPU
    kernel and "cuda" is chosen on CPU, so that the C++ autograd of the *_train_cuda ops, which
    reach the kernels through the dispatcher, and the Python that routes to it run on CPU."""
    if not _extension.load():
        pytest.skip(f"extension not built here: {_extension.status()[1]}")
    lib = torch.library.Library("ampkernels", "IMPL")
    for name, fn in impls.items():
        lib.impl(name, fn, "CPU")
    monkeypatch.setattr(backends, "select", lambda op, backend, device, pref, unsupported=None: "cuda")
    yield
    lib._destroy()
