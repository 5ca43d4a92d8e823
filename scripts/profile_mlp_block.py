"""Where the MLP-block training step spends GPU time: eager AMP vs ampkernels (torch.profiler).

    python scripts/profile_mlp_block.py [T H dtype]   # e.g. 16384 1024 bfloat16
Prints, per variant, the step time and the top CUDA kernels by total time.
"""
import copy
import sys

import torch
from torch.profiler import ProfilerActivity, profile

import ampkernels.nn as aknn

T, H = (int(sys.argv[1]), int(sys.argv[2])) if len(sys.argv) > 2 else (16384, 1024)
dtype = getattr(torch, sys.argv[3]) if len(sys.argv) > 3 else torch.bfloat16
torch.manual_seed(0)
eager = torch.nn.Sequential(torch.nn.LayerNorm(H), torch.nn.Linear(H, 4 * H), torch.nn.GELU(approximate="tanh"),
                            torch.nn.Linear(4 * H, H)).cuda()
fused = torch.nn.Sequential(aknn.LayerNorm(H, out_dtype="autocast"), aknn.FusedMLP(H, 4 * H)).cuda()
converted = copy.deepcopy(eager)
aknn.convert(converted, norm_out_dtype="autocast")
x = torch.randn(T, H, device="cuda", requires_grad=True)
for name, block in (("eager", eager), ("fusedmlp", fused), ("convert", converted)):
    def step():
        with torch.autocast("cuda", dtype=dtype):
            y = x + block(x)
        y.float().square().mean().backward()
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            step()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    total = sum(e.self_device_time_total for e in events) / 10 / 1e3
    print(f"\n== {name}: {total:.3f} ms of GPU kernel time per step")
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:12]:
        print(f"  {e.self_device_time_total / 10 / 1e3:7.3f} ms  x{e.count // 10:<3d} {e.key[:110]}")
