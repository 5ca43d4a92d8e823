"""Reliability on the GPU: streams, CUDA graphs, devices, determinism, large tensors,
numerics at the edges, GradScaler overflow, memory growth, host syncs (issue 7).
Every test runs each kernel backend that is live."""
import pytest
import torch

import ampkernels
import ampkernels.nn as aknn
from ampkernels import reference
from tests.utils import assert_rel_close

pytestmark = pytest.mark.gpu
KERNELS = ["cuda", "triton"]


def _ops(backend, dtype=torch.float16, n=1000, device="cuda"):
    """(name, fn(x) -> out, input) for each op family, with fresh params."""
    from ampkernels.ops.mlp import fused_mlp
    w = torch.randn(n, device=device) * 0.1 + 1
    b = torch.randn(n, device=device) * 0.1
    lw, uw = ((torch.randn(264, n, device=device) * n**-0.5).to(dtype) for _ in range(2))
    lb = torch.randn(264, device=device).to(dtype)
    dw = (torch.randn(n, 264, device=device) * 264**-0.5).to(dtype)
    x = torch.randn(333, n, device=device).to(dtype)
    target = torch.randint(0, 264, (333,), device=device)
    target[::7] = -100
    k = torch.randn(1, 333, 2, 100, device=device).to(dtype)
    angle = torch.randn(1, 333, 100, device=device)
    cos, sin = angle.cos(), angle.sin()
    return [
        ("layer_norm", lambda t: ampkernels.layer_norm(t, (n,), w, b, backend=backend), x),
        ("rms_norm", lambda t: ampkernels.rms_norm(t, (n,), w, 1e-6, backend=backend), x),
        ("linear_act", lambda t: ampkernels.linear_act(t, lw, lb, "gelu_tanh", backend=backend), x),
        ("fused_mlp", lambda t: fused_mlp(t, lw, lb, dw, None, "relu", backend=backend), x),
        ("gated_linear_act", lambda t: ampkernels.gated_linear_act(t, lw, uw, lb, None, "silu", backend=backend), x),
        ("linear_cross_entropy", lambda t: ampkernels.linear_cross_entropy(t, lw, target, lb, backend=backend), x),
        ("rotary_embedding", lambda t: ampkernels.rotary_embedding(t.view(1, 333, 10, 100), k, cos, sin, 2,
                                                                   backend=backend)[0], x),
    ]


@pytest.mark.parametrize("backend", KERNELS)
def test_non_default_and_concurrent_streams(backend):
    for name, fn, x in _ops(backend):
        expected = fn(x)
        s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
        torch.cuda.synchronize()
        with torch.cuda.stream(s1):
            a = fn(x)
        with torch.cuda.stream(s2):
            b = fn(x * 1)  # a different buffer computed concurrently
        torch.cuda.synchronize()
        assert torch.equal(a, expected) and torch.equal(b, expected), name


@pytest.mark.parametrize("backend", KERNELS)
def test_cuda_graph_capture_and_replay(backend):
    for name, fn, x in _ops(backend):
        static_x = x.clone()
        fn(static_x)  # warm up (Triton compiles, cuBLASLt picks its algorithm) outside capture
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn(static_x)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            static_out = fn(static_x)
        fresh = torch.randn_like(x, dtype=torch.float32).to(x.dtype)
        static_x.copy_(fresh)
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_out, fn(fresh)), name


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("backend", KERNELS)
def test_runs_on_the_tensors_device(backend):
    for name, fn, x in _ops(backend, device="cuda:1"):
        with torch.cuda.device(0):
            out = fn(x)
        assert out.device == torch.device("cuda:1"), name
        with torch.cuda.device(1):
            assert torch.equal(out, fn(x)), name


@pytest.mark.parametrize("backend", KERNELS)
def test_norm_param_grads_bitwise_repeatable(backend):
    x = torch.randn(8192, 2048, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(2048, device="cuda", requires_grad=True)
    b = torch.randn(2048, device="cuda", requires_grad=True)
    dy = torch.randn_like(x)
    grads = []
    for _ in range(3):
        w.grad = b.grad = None
        ampkernels.layer_norm(x, (2048,), w, b, backend=backend).backward(dy)
        grads.append((w.grad.clone(), b.grad.clone()))
    assert all(torch.equal(g[0], grads[0][0]) and torch.equal(g[1], grads[0][1]) for g in grads)


def test_linear_act_deterministic_mode(monkeypatch):
    # use_deterministic_algorithms: cuBLASLt's first heuristic pick (a plan of its own, never
    # chosen by timing); outputs and grads bitwise repeatable (auto's choice: test_linear_act.py)
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # what torch asks of any cuBLAS user in this mode
    x = torch.randn(512, 768, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(1024, 768, device="cuda") * 768**-0.5).to(torch.bfloat16).requires_grad_()
    b = torch.randn(1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(512, 1024, device="cuda", dtype=torch.bfloat16)
    before = torch.are_deterministic_algorithms_enabled()
    plans = torch.ops.ampkernels.linear_act_lt_plans_cuda()[0]
    torch.use_deterministic_algorithms(True)
    try:
        runs = []
        for _ in range(3):
            w.grad = b.grad = None
            y = ampkernels.linear_act(x, w, b, "gelu_tanh", backend="cuda")
            y.backward(dy)
            runs.append((y, w.grad.clone(), b.grad.clone()))
    finally:
        torch.use_deterministic_algorithms(before)
    assert torch.ops.ampkernels.linear_act_lt_plans_cuda()[0] > plans  # deterministic plans are keyed apart
    assert all(torch.equal(r[i], runs[0][i]) for r in runs for i in range(3))
    assert_rel_close(runs[0][0], reference.linear_act(x.double(), w.detach().double(), b.detach().double(),
                                                      "gelu_tanh"), torch.bfloat16)


@pytest.mark.parametrize("backend", KERNELS)
def test_norm_over_2_31_elements(backend):
    n = 8192
    rows = (2**31) // n + 3  # past 2^31 elements: 64-bit indexing
    x = torch.randn(rows, n, device="cuda", dtype=torch.float16)
    w = torch.randn(n, device="cuda")
    out = ampkernels.rms_norm(x, (n,), w, 1e-6, backend=backend)
    for r in (0, rows // 2, rows - 1):  # spot rows across the tensor, including the last
        assert_rel_close(out[r], reference.rms_norm(x[r:r + 1].double(), n, w.double(), 1e-6)[0], torch.float16)
    del x, out
    torch.cuda.empty_cache()


@pytest.mark.parametrize("backend", KERNELS)
def test_linear_act_output_over_2_31_elements(backend):
    m, k, n = (2**31) // 16384 + 8, 64, 16384
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(n, k, device="cuda") * 0.1).to(torch.bfloat16)
    try:
        y = ampkernels.linear_act(x, w, None, "relu", backend=backend)
    except RuntimeError as e:  # a clear error is acceptable, an overflowing index is not
        assert "2^31" in str(e) or "too large" in str(e), e
        return
    for r in (0, m - 1):
        assert_rel_close(y[r], reference.linear_act(x[r:r + 1].double(), w.double(), None, "relu")[0],
                         torch.bfloat16)
    del x, y
    torch.cuda.empty_cache()


@pytest.mark.parametrize("backend", KERNELS)
def test_numerics_at_the_edges(backend):
    n = 1024
    x = torch.randn(6, n, device="cuda").half()
    x[0] = 65000.0 * torch.sign(torch.randn(n, device="cuda"))  # near fp16 max: fp32 statistics cope
    x[1] = 3.0  # constant row: zero variance
    x[2, 5] = float("nan")
    x[3, 7] = float("inf")
    x[4] = x[4] * 1e-4 + 1000  # large mean, small spread
    for name, fn in (("layer_norm", lambda t: ampkernels.layer_norm(t, (n,), backend=backend)),
                     ("rms_norm", lambda t: ampkernels.rms_norm(t, (n,), backend=backend))):
        out = fn(x)
        expected = torch.nn.functional.layer_norm(x.float(), (n,)) if name == "layer_norm" else \
            torch.nn.functional.rms_norm(x.float(), (n,))  # default eps: fp32's, as for the fp16 input
        for r in (0, 1, 4, 5):
            assert torch.isfinite(out[r]).all(), (name, r)
            assert_rel_close(out[r], expected[r], torch.float16, factor=2 if r != 4 else 10, what=f"{name} row {r}")
        assert torch.isnan(out[2]).all() == torch.isnan(expected[2]).all(), name  # NaN spreads over its row
        assert torch.isnan(out[3]).any() and torch.isnan(expected[3]).any(), name


@pytest.mark.parametrize("backend", KERNELS)
def test_grad_scaler_skips_overflowing_steps(backend):
    torch.manual_seed(0)
    model = torch.nn.Sequential(aknn.LayerNorm(256, backend=backend),
                                aknn.Linear(256, 256, activation="gelu_tanh", backend=backend)).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**16)
    before = [p.detach().clone() for p in model.parameters()]
    x = torch.randn(64, 256, device="cuda")
    with torch.autocast("cuda", dtype=torch.float16):
        loss = model(x).float().sum() * 1e6  # the scaled grads overflow fp16
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() < 2.0**16  # overflow seen: scale shrank
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))  # step skipped


@pytest.mark.parametrize("backend", KERNELS)
def test_no_memory_growth_and_no_host_sync(backend):
    model = torch.nn.Sequential(aknn.LayerNorm(512, backend=backend), aknn.FusedMLP(512, 1024, backend=backend),
                                aknn.RMSNorm(512, backend=backend)).cuda()
    x = torch.randn(128, 512, device="cuda", requires_grad=True)

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            model(x).float().sum().backward()

    for _ in range(5):
        step()
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(10_000):
            step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == start
