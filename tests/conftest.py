"""Test tiers: the CPU tier runs everywhere (references, Triton kernels under
TRITON_INTERPRET=1, the compiled extension's schemas, dispatch, plumbing); tests marked
`gpu` need CUDA and skip cleanly without it. Run the GPU tier with `pytest -m gpu`."""
import os
import zlib

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    # Before any Triton kernel is defined: run them on CPU tensors (fp16/fp32; bf16 is GPU-only).
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.pop("AMPKERNELS_BACKEND", None)  # tests choose backends explicitly
if HAS_CUDA:
    # Tests call autograd Functions and ops with backend="cuda" directly, below the public API,
    # whose backend selection is what loads the extension; load it up front so that no test
    # depends on an earlier one having gone through the public API.
    from ampkernels import _extension

    _extension.load()


def pytest_addoption(parser):
    parser.addoption("--shard", default=None, metavar="K/N",
                     help="run the K-th of N shards (1 <= K <= N): every N-th test of the collected order, "
                          "so that the parametrizations of one test spread over the shards")


def _shard(config, items):
    spec = config.getoption("--shard")
    if not spec:
        return
    try:
        k, n = (int(v) for v in spec.split("/"))
    except ValueError:
        raise pytest.UsageError(f"--shard must be K/N with integers, got {spec!r}") from None
    if not 1 <= k <= n:
        raise pytest.UsageError(f"--shard {spec}: K must be in 1..N")
    config.hook.pytest_deselected(items=[item for i, item in enumerate(items) if i % n != k - 1])
    items[:] = items[k - 1::n]


def pytest_collection_modifyitems(config, items):
    _shard(config, items)
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def input_seed(nodeid, salt=""):
    """A test's seed: crc32 of its node id and the salt, not hash(), which PYTHONHASHSEED salts
    per process (so a GPU failure at 029995a came and went between runs)."""
    return zlib.crc32(f"{nodeid}{salt}".encode())


@pytest.fixture(autouse=True)
def _fresh_seed(request):
    # fresh random inputs per test, reproducible from the test's name. AMPKERNELS_TEST_SEED=k
    # draws other inputs, reproducibly: rerunning a test over several k is how an
    # input-dependent failure is caught again.
    torch.manual_seed(input_seed(request.node.nodeid, os.environ.get("AMPKERNELS_TEST_SEED", "")))


@pytest.fixture
def cpu_kernels(monkeypatch):
    """The GEMM ops' C++ autograd on CPU: "cuda" chosen there, its kernel ops the reference."""
    from tests.utils import cuda_kernels_on_cpu
    yield from cuda_kernels_on_cpu(monkeypatch)
