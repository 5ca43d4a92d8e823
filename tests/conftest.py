"""Test tiers: the CPU tier runs everywhere (references, Triton kernels under
TRITON_INTERPRET=1, the compiled extension's schemas, dispatch, plumbing); tests marked
`gpu` need CUDA and skip cleanly without it. Run the GPU tier with `pytest -m gpu`."""
import json
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
                     help="run the K-th of N shards (1 <= K <= N): the tests split into N parts of about equal "
                          "expected time (tests/gpu_durations.json)")


# Each GPU test's time in the last tier runs (scripts/test_durations.py writes it from their junit
# XML); a test not listed (under 1 s there, or new) counts as DEFAULT_SECONDS. The tier's time goes
# to a few long tests (Triton compiles), so shards and pytest-xdist workers are balanced by time.
DURATIONS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu_durations.json")
DEFAULT_SECONDS = 0.5


def expected_seconds(nodeids):
    try:
        with open(DURATIONS) as f:
            known = json.load(f)
    except (OSError, ValueError):
        known = {}
    return [known.get(i, DEFAULT_SECONDS) for i in nodeids]


def balanced(times, n, sizes=None):
    """Indices of `times` in n bins of about equal total: longest first, each into the bin with the
    least so far (among those below their size in `sizes`, when given). Within a bin, longest
    first."""
    bins, load = [[] for _ in range(n)], [0.0] * n
    for i in sorted(range(len(times)), key=lambda i: (-times[i], i)):
        b = min((b for b in range(n) if sizes is None or len(bins[b]) < sizes[b]), key=lambda b: (load[b], b))
        bins[b].append(i)
        load[b] += times[i]
    return bins


def worksteal_blocks(count, workers):
    """The sizes of the consecutive blocks pytest-xdist's worksteal scheduler first hands its idle
    workers: each takes what is left divided by the workers left."""
    sizes = []
    for i in range(workers):
        sizes.append(count // (workers - i))
        count -= sizes[-1]
    return sizes


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
    keep = set(balanced(expected_seconds([item.nodeid for item in items]), n)[k - 1])
    config.hook.pytest_deselected(items=[item for i, item in enumerate(items) if i not in keep])
    items[:] = [item for i, item in enumerate(items) if i in keep]


def _order_for_workers(items):
    """Under pytest-xdist's worksteal on the GPU machine: the items in one block per worker, as
    worksteal first hands them out, each block of about equal expected time and longest first,
    so that the long tests start at once on different workers (in collection order they queued
    behind each other) and steals, which take a queue's tail, move short tests."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers < 2 or not HAS_CUDA:
        return
    bins = balanced(expected_seconds([item.nodeid for item in items]), workers,
                    worksteal_blocks(len(items), workers))
    items[:] = [items[i] for b in bins for i in b]


@pytest.hookimpl(trylast=True)  # after -m / -k deselect: shards and blocks of the tests that run
def pytest_collection_modifyitems(config, items):
    _shard(config, items)
    _order_for_workers(items)
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
