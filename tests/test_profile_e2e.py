"""scripts/profile_e2e.py's analyses on synthetic events and on CPU (the profile itself needs a GPU)."""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))
import profile_e2e  # noqa: E402


def test_idle_gaps_name_the_waited_kernel_and_the_launching_op():
    us = 1000  # ns
    kernels = [("gemm", 0, 100 * us, 1), ("norm_fwd", 150 * us, 10 * us, 2),  # 50 us idle before norm_fwd
               ("add", 165 * us, 5 * us, 3),  # 5 us: launch latency, not counted
               ("norm_fwd", 300 * us, 10 * us, 4)]  # 130 us idle
    launch_at = {2: 120 * us, 3: 125 * us, 4: 280 * us}
    ops = [("MyModule.forward_op", 100 * us, 300 * us),  # not an aten op: named for launches inside it
           ("aten::empty", 119 * us, 2 * us),
           ("aten::add", 124 * us, 3 * us)]
    gaps = profile_e2e.idle_gaps(kernels, launch_at, ops)
    assert set(gaps) == {("norm_fwd", "MyModule.forward_op")}
    ms, n = gaps[("norm_fwd", "MyModule.forward_op")]
    assert n == 2 and abs(ms - 0.180) < 1e-9
    # only aten ops around a launch: the innermost is named; none: "?"
    starts = [o[1] for o in ops[1:]]
    assert profile_e2e.enclosing_op(ops[1:], starts, 125 * us) == "aten::add"
    assert profile_e2e.enclosing_op(ops[1:], starts, 500 * us) == "?"
    assert profile_e2e.idle_gaps(kernels, {}, ops)[("norm_fwd", "?")][1] == 2


def test_python_time_counts_own_time_per_step(monkeypatch):
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)

    def work():
        return sum(i * i for i in range(2000))

    ms, calls = profile_e2e.python_time(work, 4)
    key = next(k for k in ms if k.endswith("(work)"))
    assert calls[key] == 1 and ms[key] > 0


def test_step_gaps_reads_the_profilers_events():
    # on CPU no kernels ran: nothing idles, but the raw-event reading is exercised
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(2):
            with torch.profiler.record_function(profile_e2e._STEP):
                torch.randn(16, 16) @ torch.randn(16, 16)
    assert profile_e2e._step_gaps(prof) == {}
