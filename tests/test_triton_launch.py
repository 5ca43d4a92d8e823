"""ampkernels.triton.launch: a kept kernel runs only where Triton would run the same one, with
the arguments in signature order."""
import types

import pytest
import torch

triton = pytest.importorskip("triton")
from triton._C.libtriton import native_specialize_impl
from triton.backends.nvidia.compiler import CUDABackend

from ampkernels.triton import launch as L

I32, I64 = 2**31, 2**63


def _values():
    ints = [-I64, -I32 - 16, -I32, -17, -16, -1, 0, 1, 2, 15, 16, 17, 48, I32 - 16, I32 - 1, I32, I32 + 16,
            I64 - 16, I64 - 1, I64, I64 + 16, 2**64 - 16]
    base = torch.empty(64, dtype=torch.float32)
    tensors = [base, base[1:], base[4:]]  # 16-byte aligned, 4-byte off, 16-byte aligned again
    tensors += [base.view(torch.float16)[k:] for k in (0, 1, 8)] + [base.view(torch.bfloat16)[3:]]
    tensors += [torch.empty(8, dtype=torch.int32), torch.empty(8, dtype=torch.int64)[1:]]
    return ints + [0.0, 1.0, 2.5, True, False, None] + tensors + _descriptors()


def _descriptors():
    """TMA descriptors differing in dtype, block shape and (Gluon) layout, over aligned storage."""
    x = torch.empty(256, 128, dtype=torch.float16)
    out = []
    for cls, layouts in _descriptor_kinds():
        for t in (x, x.view(torch.bfloat16), x[:, :64]):
            for block in ([64, 64], [64, 128], [128, 64]):
                if block[1] > t.shape[1]:
                    continue
                for layout in layouts(t.dtype, block):
                    out.append(cls.from_tensor(t, block, *layout))
    return out


def _descriptor_kinds():
    """(descriptor class, layouts(dtype, block) -> extra from_tensor arguments) for the classes here."""
    found = []
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor
        found.append((TensorDescriptor, lambda dtype, block: [()]))
    except ImportError:
        pass
    try:
        from triton.experimental.gluon import language as gl
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor

        def gluon_layouts(dtype, block):
            gdt = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16}[dtype]
            return [(gl.NVMMASharedLayout.get_default_for(block, gdt),),
                    (gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=16, rank=2),)]
        found.append((GluonDescriptor, gluon_layouts))
    except ImportError:
        pass
    return found


def test_key_is_at_least_as_fine_as_triton_specialization():
    values = _values()
    triton_spec = [native_specialize_impl(CUDABackend, v, False, True, True) for v in values]
    ours = [L._arg_key(v) for v in values]
    for i in range(len(values)):
        for j in range(len(values)):
            if triton_spec[i] != triton_spec[j]:
                assert ours[i] != ours[j], (values[i], values[j], triton_spec[i], triton_spec[j])


def test_unkeyed_argument_types():
    for v in ("a", (1, 2), object()):
        with pytest.raises(L._Unkeyed):
            L._arg_key(v)


class _FakeCompiled:
    function, packed_metadata = "fn", "meta"

    def __init__(self):
        self.runs = []
        self.run = lambda *a: self.runs.append(a)


class _FakeKernel:
    """kernel[grid](...) as Triton's JITFunction: launches and returns its compiled kernel."""
    params = tuple(types.SimpleNamespace(name=n, has_default=d is not None, default=d)
                   for n, d in (("X", None), ("n", None), ("eps", 1e-5), ("BLOCK", None), ("FLAG", False)))

    def __init__(self):
        self.slow_calls, self.compiled = [], _FakeCompiled()

    def __getitem__(self, grid):
        def call(*args, **kwargs):
            self.slow_calls.append((grid, args, kwargs))
            return self.compiled
        return call


@pytest.fixture
def fast_path(monkeypatch):
    monkeypatch.setattr(L, "_TRITON_PATH_ONLY", False)
    monkeypatch.setattr(L, "_COMPILED", {})
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 1234, raising=False)


def test_second_call_runs_the_kept_kernel_with_arguments_in_signature_order(fast_path):
    k, x = _FakeKernel(), torch.empty(16, dtype=torch.float16)
    L.launch(k, (3,), x, 100, BLOCK=64, num_warps=4)
    assert len(k.slow_calls) == 1 and not k.compiled.runs
    L.launch(k, (5, 2), x[8:], 200, BLOCK=64, num_warps=4)  # same key: aligned view, same int class
    assert len(k.slow_calls) == 1
    (run,) = k.compiled.runs
    assert run[:9] == (5, 2, 1, 1234, "fn", "meta", None, None, None)
    assert run[9].data_ptr() == x[8:].data_ptr() and run[10:] == (200, 1e-5, 64, False)


@pytest.mark.parametrize("change", ["misaligned", "int_one", "int_mod16", "int64", "dtype", "constexpr", "option"])
def test_a_different_specialization_takes_tritons_path(fast_path, change):
    k, x = _FakeKernel(), torch.empty(16, dtype=torch.float16)
    L.launch(k, (1,), x, 100, BLOCK=64, num_warps=4)
    args, kwargs = [x, 100], {"BLOCK": 64, "num_warps": 4}
    if change == "misaligned":
        args[0] = x[1:]
    elif change == "int_one":
        args[1] = 1
    elif change == "int_mod16":
        args[1] = 96
    elif change == "int64":
        args[1] = I32 + 4
    elif change == "dtype":
        args[0] = x.view(torch.bfloat16)
    elif change == "constexpr":
        kwargs["BLOCK"] = 128
    else:
        kwargs["num_warps"] = 8
    L.launch(k, (1,), *args, **kwargs)
    assert len(k.slow_calls) == 2 and not k.compiled.runs


def test_uncacheable_calls_always_take_tritons_path(fast_path, monkeypatch):
    k, x = _FakeKernel(), torch.empty(16, dtype=torch.float16)
    for _ in range(2):
        L.launch(k, (1,), x, 100, BLOCK=64, FLAG=x)  # a tensor keyword: keyed by identity, never kept
        L.launch(k, lambda meta: (1,), x, 7, BLOCK=64)  # a grid function
        L.launch(k, (1,), x, "s", BLOCK=64)  # an argument type without a key
    assert len(k.slow_calls) == 6 and not k.compiled.runs and not L._COMPILED
    L.launch(k, (1,), x, 100, BLOCK=64)
    monkeypatch.setattr(triton.knobs.runtime.launch_enter_hook, "calls", [print])  # a profiler's hook
    L.launch(k, (1,), x, 100, BLOCK=64)
    assert len(k.slow_calls) == 8 and not k.compiled.runs


def test_hooks_as_older_tritons_hold_them(fast_path, monkeypatch):
    """Before HookChain: None (no hook: the kept kernel runs) or a callable (Triton's path)."""
    k, x = _FakeKernel(), torch.empty(16, dtype=torch.float16)
    monkeypatch.setattr(triton.knobs.runtime, "launch_enter_hook", None)
    monkeypatch.setattr(triton.knobs.runtime, "launch_exit_hook", None)
    L.launch(k, (1,), x, 100, BLOCK=64)
    L.launch(k, (1,), x, 100, BLOCK=64)
    assert len(k.slow_calls) == 1 and len(k.compiled.runs) == 1
    monkeypatch.setattr(triton.knobs.runtime, "launch_exit_hook", print)
    L.launch(k, (1,), x, 100, BLOCK=64)
    assert len(k.slow_calls) == 2 and len(k.compiled.runs) == 1


def test_kept_launch_runs_again_with_new_arguments(fast_path, monkeypatch):
    k, x = _FakeKernel(), torch.empty(16, dtype=torch.float16)
    kept = L.launch(k, (3,), x, 100, BLOCK=64, num_warps=4)  # the first call: Triton's path, then kept
    assert isinstance(kept, L.Kept) and len(k.slow_calls) == 1 and not k.compiled.runs
    kept.run(x[8:], 200)
    (run,) = k.compiled.runs
    assert run[:9] == (3, 1, 1, 1234, "fn", "meta", None, None, None)
    assert run[9].data_ptr() == x[8:].data_ptr() and run[10:] == (200, 1e-5, 64, False)
    assert isinstance(L.launch(k, (3,), x, 100, BLOCK=64, num_warps=4), L.Kept) and len(k.compiled.runs) == 2
    monkeypatch.setattr(triton.knobs.runtime.launch_enter_hook, "calls", [print])  # a profiler's hook
    kept.run(x, 100)
    assert k.slow_calls[-1] == ((3,), (x, 100), {"BLOCK": 64, "num_warps": 4}) and len(k.compiled.runs) == 2


def test_launch_returns_none_where_tritons_path_ran(fast_path, monkeypatch):
    k, x = _FakeKernel(), torch.empty(16, dtype=torch.float16)
    assert L.launch(k, lambda meta: (1,), x, 7, BLOCK=64) is None  # a grid function
    assert L.launch(k, (1,), x, "s", BLOCK=64) is None  # an argument without a key
    assert L.launch(k, (1,), x, 100, BLOCK=64, FLAG=x) is None  # a tensor keyword
    monkeypatch.setattr(L, "_TRITON_PATH_ONLY", True)
    assert L.launch(k, (1,), x, 100, BLOCK=64) is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_kept_kernel_is_the_one_triton_picks():
    from ampkernels.triton import linear_act as tla

    base = torch.randn(4096 + 64, device="cuda", dtype=torch.float16)
    for offset, n in ((0, 4096), (1, 4095), (8, 4096), (3, 17), (0, 1), (0, 4096), (1, 4095)):
        pre = base[offset:offset + n]
        y = tla.act_forward(pre, 3)  # through launch()
        torch.testing.assert_close(y.float(), torch.nn.functional.gelu(pre.float(), approximate="tanh"),
                                   atol=2e-3, rtol=2e-3)
        args, kwargs = (pre, y, n), {"ACT": 3, "BLOCK": 4096, "num_warps": 4}
        kept = L._COMPILED[L.launch_key(tla._act_fwd_pass_kernel, torch.cuda.current_device(), args, kwargs)]
        assert tla._act_fwd_pass_kernel[(1,)](*args, **kwargs) is kept
