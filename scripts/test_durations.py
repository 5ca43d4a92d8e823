"""Update tests/gpu_durations.json from GPU tier runs: each test's time from the junit XML that
scripts/gpu_run.sh writes (tests.xml), which tests/conftest.py uses to balance `--shard` and
the pytest-xdist workers by time. Run it on a tier's XML files (all shards of one run) after
the call:

    python scripts/test_durations.py out1/tests.xml out2/tests.xml

A test of these runs takes its new time (one under MIN_SECONDS is dropped: conftest counts it as
its default); a test they did not run keeps its entry, unless its file or function is gone.
"""
import argparse
import json
import os
import sys
import xml.etree.ElementTree as ET

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from tests.conftest import DURATIONS  # noqa: E402

MIN_SECONDS = 1.0


def junit_times(path):
    """{node id: seconds} of the test cases in one junit XML file (pytest's xunit2: classname is
    the module's dotted path; the tests here are functions, not class methods)."""
    out = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        module = case.get("classname", "").replace(".", "/") + ".py"
        out[f"{module}::{case.get('name')}"] = float(case.get("time", 0))
    return out


def still_collectable(nodeid):
    """Whether the test's file exists and still defines its function (a cheap check, no import)."""
    path, _, name = nodeid.partition("::")
    func = name.split("[", 1)[0]
    try:
        with open(os.path.join(ROOT, path)) as f:
            return f"def {func}(" in f.read()
    except OSError:
        return False


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("xml", nargs="+", help="junit XML files of one tier run (its shards)")
    p.add_argument("--out", default=DURATIONS)
    args = p.parse_args(argv)
    try:
        with open(args.out) as f:
            times = json.load(f)
    except (OSError, ValueError):
        times = {}
    new = {}
    for path in args.xml:
        new.update(junit_times(path))
    for nodeid, seconds in new.items():
        if seconds >= MIN_SECONDS:
            times[nodeid] = round(seconds, 1)
        else:
            times.pop(nodeid, None)
    times = {k: v for k, v in sorted(times.items()) if still_collectable(k)}
    with open(args.out, "w") as f:
        json.dump(times, f, indent=0)
        f.write("\n")
    print(f"{args.out}: {len(times)} tests, {sum(times.values()):.0f} s ({len(new)} in these runs)")


if __name__ == "__main__":
    main()
