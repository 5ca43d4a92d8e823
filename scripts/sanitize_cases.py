"""The kernels of both op families, forward and backward, on odd and boundary shapes, for
compute-sanitizer (scripts/sanitize.sh). Small row counts keep racecheck's run short.

    [SANITIZER_DTYPES="bfloat16 float16"] [SANITIZER_OPS="norms linear_act [mlp]"] \
        python scripts/sanitize_cases.py [cuda] [triton] [torch]

Every output is also checked against the reference (a wrong result exits non-zero), so an
uninitialised-read report on an output that matches the reference points at the tool.
"torch" runs the same cases through eager PyTorch: a control for reports that stem from
cuBLAS's own kernels or the tool rather than from ours.
The cases run inside a function so that every tensor is freed before the process exits:
memcheck's leak check would otherwise count the module-level tensors still alive at exit.
"""
import gc
import os
import sys

import torch

import ampkernels
from ampkernels import reference

dev = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: "torch" only, to try the script


def check(name, got, want, tol):
    err = (got.float() - want.float()).abs().max().item() if got.numel() else 0.0
    scale = max(1.0, want.float().abs().max().item()) if want.numel() else 1.0
    if not err <= tol * scale:  # NaN fails too
        sys.exit(f"sanitize case {name}: max error {err} > {tol} * {scale}")


def norm_cases(backend, dtype, tol):
    # 768, 1000, 16384: the CUDA backward's configurations; 5000 rows of 1000 give its blocks
    # several rows each
    for n in (1, 7, 768, 1000, 8191, 16384, 65536):
        for rows in (1, 3, 5000) if n == 1000 else (1, 3):
            x = torch.randn(rows, n, device=dev, dtype=dtype, requires_grad=True)
            r = torch.randn(rows, n, device=dev, dtype=dtype, requires_grad=True)
            w = torch.randn(n, device=dev, requires_grad=True)
            b = torch.randn(n, device=dev, requires_grad=True)
            out, s = ampkernels.layer_norm(x, (n,), w, b, residual=r, backend=backend)
            check(f"{backend} layer_norm {dtype} {rows}x{n}", out,
                  reference.layer_norm(x.detach(), (n,), w.detach(), b.detach(), residual=r.detach())[0], 4 * tol)
            (out.float().sum() + s.float().sum()).backward()
            out = ampkernels.rms_norm(x, (n,), w, backend=backend)
            check(f"{backend} rms_norm {dtype} {rows}x{n}", out, reference.rms_norm(x.detach(), (n,), w.detach()),
                  4 * tol)
            out.float().sum().backward()


def linear_act_cases(backend, dtype, tol):
    for (m, k, n) in ((1, 13, 7), (5, 64, 24), (33, 13, 8), (70, 136, 200)):
        for activation in ampkernels.ACTIVATIONS:
            for bias in (True, False):
                x = torch.randn(m, k, device=dev, dtype=dtype, requires_grad=True)
                w = torch.randn(n, k, device=dev, dtype=dtype, requires_grad=True)
                bb = torch.randn(n, device=dev, dtype=dtype, requires_grad=True) if bias else None
                y = ampkernels.linear_act(x, w, bb, activation, backend=backend)
                want = reference.linear_act(x.detach(), w.detach(), None if bb is None else bb.detach(), activation)
                check(f"{backend} linear_act {activation} bias={bias} {dtype} {m}x{k}x{n}", y, want, tol)
                y.float().sum().backward()


def mlp_cases(backend, dtype, tol):
    # fused_mlp's backward applies act' in place on its own dh (act_backward_cuda_, Triton out=dy).
    # Through the public function, which loads the extension ("torch": the eager block)
    from ampkernels.ops.mlp import fused_mlp
    for (m, k, h) in ((1, 16, 40), (33, 13, 8), (70, 64, 200)):
        for activation in ampkernels.ACTIVATIONS:
            t = lambda *s: (0.5 * torch.randn(*s, device=dev)).to(dtype).requires_grad_()
            x, w1, b1, w2, b2 = t(m, k), t(h, k), t(h), t(k, h), t(k)
            out = fused_mlp(x, w1, b1, w2, b2, activation, backend=backend)
            d = [v.detach() for v in (x, w1, b1, w2, b2)]
            want = reference.linear_act(reference.linear_act(*d[:3], activation), d[3], d[4], "identity")
            check(f"{backend} fused_mlp {activation} {dtype} {m}x{k}x{h}", out, want, 4 * tol)
            out.float().sum().backward()


def main(backends):
    torch.manual_seed(0)
    ops = os.environ.get("SANITIZER_OPS", "norms linear_act").split()
    for backend in backends:
        for dtype in (getattr(torch, d) for d in os.environ.get("SANITIZER_DTYPES", "float16 bfloat16").split()):
            tol = 2e-2 if dtype == torch.bfloat16 else 4e-3
            if "norms" in ops:
                norm_cases(backend, dtype, tol)
            if "linear_act" in ops:
                linear_act_cases(backend, dtype, tol)
            if "mlp" in ops:
                mlp_cases(backend, dtype, tol)
        if dev == "cuda":
            torch.cuda.synchronize()
        print(f"sanitize cases done: {backend}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or ["cuda", "triton"])
    gc.collect()
    if dev == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        # what torch still counts as allocated: memcheck's leak list at exit is compared with it
        print(f"sanitize cases: {torch.cuda.memory_allocated()} bytes allocated at exit", flush=True)
