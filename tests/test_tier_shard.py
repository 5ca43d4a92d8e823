"""`pytest --shard K/N` (tests/conftest.py): the shards of a collection are disjoint and together
are the whole of it, so that a GPU tier split over several device calls runs every test once."""
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
    assert max(map(len, shards)) - min(map(len, shards)) <= 1  # every third test: the sizes differ by one at most


@pytest.mark.parametrize("spec", ["0/2", "1-2"])
def test_bad_shard_is_a_usage_error(spec):
    rc, _, log = _collect("--shard", spec)
    assert rc == 4 and "--shard" in log, log  # pytest's exit code for a usage error
