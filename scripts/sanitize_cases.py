"""The kernels of both op families, forward and backward, on odd and boundary shapes, for
compute-sanitizer (scripts/sanitize.sh). Small row counts keep racecheck's run short."""
import sys

import torch

import ampkernels

backends = sys.argv[1:] or ["cuda", "triton"]
torch.manual_seed(0)
dev = "cuda"
for backend in backends:
    for dtype in (torch.float16, torch.bfloat16):
        for n in (1, 7, 8191, 65536):
            for rows in (1, 3):
                x = torch.randn(rows, n, device=dev, dtype=dtype, requires_grad=True)
                r = torch.randn(rows, n, device=dev, dtype=dtype, requires_grad=True)
                w = torch.randn(n, device=dev, requires_grad=True)
                b = torch.randn(n, device=dev, requires_grad=True)
                out, s = ampkernels.layer_norm(x, (n,), w, b, residual=r, backend=backend)
                (out.float().sum() + s.float().sum()).backward()
                ampkernels.rms_norm(x, (n,), w, backend=backend).float().sum().backward()
        for (m, k, n) in ((1, 13, 7), (5, 64, 24), (33, 13, 8), (70, 136, 200)):
            for activation in ampkernels.ACTIVATIONS:
                for bias in (True, False):
                    x = torch.randn(m, k, device=dev, dtype=dtype, requires_grad=True)
                    w = torch.randn(n, k, device=dev, dtype=dtype, requires_grad=True)
                    bb = torch.randn(n, device=dev, dtype=dtype, requires_grad=True) if bias else None
                    ampkernels.linear_act(x, w, bb, activation, backend=backend).float().sum().backward()
    torch.cuda.synchronize()
    print(f"sanitize cases done: {backend}", flush=True)
