"""`pytest --shard K/N` (tests/conftest.py): the shards of a collection are disjoint and together
are the whole of it, so that a GPU tier split over several device calls runs every test once;
shards and pytest-xdist workers balanced by the tests' expected times."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _collect(*args):
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                          "tests/test_reference.py", *args], cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    return out.returncode, [ln for ln in out.stdout.splitlines() if "::" in ln], out.stdout + out.stderr


def test_shards_partition_the_collection():
    rc, everything, log = _collect()
    assert rc == 0 and len(everything) > 6, log
    shards = []
    for k in (1, 2, 3):
        rc, ids, log = _collect("--shard", f"{k}/3")
        assert rc == 0 and ids, log
        shards.append(ids)
    assert sorted(i for ids in shards for i in ids) == sorted(everything)
    assert max(map(len, shards)) - min(map(len, shards)) <= 1  # no times known for these: balanced by count


@pytest.mark.parametrize("spec", ["0/2", "1-2"])
def test_bad_shard_is_a_usage_error(spec):
    rc, _, log = _collect("--shard", spec)
    assert rc == 4 and "--shard" in log, log  # pytest's exit code for a usage error


def test_balanced_bins_by_time_longest_first():
    from tests.conftest import balanced
    times = [10, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 4, 6]
    bins = balanced(times, 2)
    assert sorted(i for b in bins for i in b) == list(range(len(times)))
    assert [sum(times[i] for i in b) for b in bins] == [15, 15]
    assert all([times[i] for i in b] == sorted((times[i] for i in b), reverse=True) for b in bins)
    sized = balanced(times, 3, sizes=[3, 5, 5])  # counts as given, time balanced within them
    assert list(map(len, sized)) == [3, 5, 5] and sized[0][0] == 0


def test_workers_get_blocks_of_equal_time_long_tests_first(monkeypatch, tmp_path):
    import json
    from types import SimpleNamespace

    import tests.conftest as conftest
    times = {f"t::long{i}": 100.0 - i for i in range(4)}
    (tmp_path / "d.json").write_text(json.dumps(times))
    monkeypatch.setattr(conftest, "DURATIONS", str(tmp_path / "d.json"))
    monkeypatch.setattr(conftest, "HAS_CUDA", True)
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "4")
    # collection order puts the four long tests last, where one worker would run them in turn
    items = [SimpleNamespace(nodeid=f"t::short{i}") for i in range(22)] + [SimpleNamespace(nodeid=k) for k in times]
    conftest._order_for_workers(items)
    blocks = conftest.worksteal_blocks(len(items), 4)
    assert sum(blocks) == 26 and blocks == [6, 6, 7, 7]
    starts = [sum(blocks[:w]) for w in range(4)]
    assert sorted(items[s].nodeid for s in starts) == sorted(times)  # each worker starts on a long test


def test_worksteal_hands_out_the_blocks_we_balance():
    # the assumption _order_for_workers rests on, checked against pytest-xdist's scheduler itself
    pytest.importorskip("xdist")
    from types import SimpleNamespace

    from xdist.scheduler import WorkStealingScheduling

    from tests.conftest import worksteal_blocks
    config = SimpleNamespace(getvalue=lambda name: ["12*popen"] if name == "tx" else None)
    sched = WorkStealingScheduling(config)
    got = []

    class Node:  # the part of xdist's WorkerController the scheduler uses here
        shutting_down = False

        def __init__(self, i):
            self.gateway = SimpleNamespace(id=f"gw{i}")

        def send_runtest_some(self, indices):
            got.append(list(indices))

        def shutdown(self):
            pass

    nodes = [Node(i) for i in range(12)]
    collection = [f"t::{i}" for i in range(351)]
    for node in nodes:
        sched.add_node(node)
    for node in nodes:
        sched.add_node_collection(node, collection)
    sched.schedule()
    assert [len(g) for g in got] == worksteal_blocks(351, 12)
    assert [i for g in got for i in g] == list(range(351))  # consecutive blocks in order
