"""`ampkernels doctor`: what this machine can run, and why not.

Reports the GPU and its Tensor Core generation (and whether fp16/bf16 AMP pays off on
it), torch / CUDA / cuDNN / Triton versions and whether they agree, the compiled
extension (loaded? for which archs? do they cover this GPU?), each backend's status, a
one-step autocast + GradScaler smoke run through ampkernels, and a verdict line.
"""
import importlib.metadata
import json
import re
import sys

import torch

from . import _extension, backends

# compute capability major -> (architecture, Tensor Cores, what AMP buys)
_ARCH = {
    6: ("Pascal", "none", "memory only: fp16 halves activation memory but gives no speed-up; no bf16"),
    7: ("Volta/Turing", "1st/2nd gen (fp16)", "fp16 AMP speeds up matmuls; bf16 is not supported in hardware"),
    8: ("Ampere/Ada", "3rd/4th gen (fp16, bf16, tf32)", "fp16 and bf16 AMP both speed up matmuls"),
    9: ("Hopper", "4th gen (fp16, bf16, fp8, wgmma)", "fp16 and bf16 AMP both speed up matmuls"),
    10: ("Blackwell", "5th gen (fp16, bf16, fp8, fp4)", "fp16 and bf16 AMP both speed up matmuls"),
    12: ("Blackwell", "5th gen (fp16, bf16, fp8, fp4)", "fp16 and bf16 AMP both speed up matmuls"),
}


def _gpu():
    if not torch.cuda.is_available():
        return None
    p = torch.cuda.get_device_properties(0)
    arch, tc, amp = _ARCH.get(p.major, ("unknown", "unknown", "unknown"))
    if p.major < 6:
        arch, tc, amp = "pre-Pascal", "none", "no benefit: fp16 arithmetic is slow on this GPU"
    return {"name": p.name, "cc": f"{p.major}.{p.minor}", "sms": p.multi_processor_count,
            "memory_gb": round(p.total_memory / 2**30, 1), "architecture": arch, "tensor_cores": tc,
            "amp": amp, "bf16": p.major >= 8}


def _versions():
    v = {"python": sys.version.split()[0], "torch": torch.__version__, "torch_cuda": torch.version.cuda,
         "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
         "triton": None, "triton_expected_by_torch": None, "driver_cuda": None}
    try:
        import triton
        v["triton"] = triton.__version__
    except Exception:
        pass
    try:  # the triton release this torch wheel was built against
        reqs = importlib.metadata.requires("torch") or []
        pins = [re.match(r"triton\s*(?:==|~=)\s*([0-9][\w.]*)", r) for r in reqs]
        v["triton_expected_by_torch"] = next((m.group(1) for m in pins if m), None)
    except importlib.metadata.PackageNotFoundError:
        pass
    if torch.cuda.is_available():
        try:
            from ctypes import CDLL, byref, c_int
            ver = c_int()
            CDLL("libcuda.so.1").cuDriverGetVersion(byref(ver))
            v["driver_cuda"] = f"{ver.value // 1000}.{ver.value % 1000 // 10}"
        except Exception:
            pass
    return v


def _agreement(v, ext):
    """Problems with the versions fitting together; [] when they agree."""
    issues = []
    minor = lambda s: tuple(str(s).split(".")[:2])  # noqa: E731
    if v["triton"] and v["triton_expected_by_torch"] and minor(v["triton"]) != minor(v["triton_expected_by_torch"]):
        issues.append(f"triton {v['triton']} differs from the {v['triton_expected_by_torch']} torch was built with")
    major = lambda s: int(str(s).split(".")[0])  # noqa: E731
    if v["driver_cuda"] and v["torch_cuda"] and major(v["driver_cuda"]) < major(v["torch_cuda"]):
        issues.append(f"driver supports CUDA {v['driver_cuda']} < torch's CUDA {v['torch_cuda']}")
    if ext.get("cuda_runtime") and v["torch_cuda"]:
        ext_cuda = f"{ext['cuda_runtime'] // 1000}.{ext['cuda_runtime'] % 1000 // 10}"
        if major(ext_cuda) != major(v["torch_cuda"]):
            issues.append(f"extension built with CUDA {ext_cuda}, torch uses CUDA {v['torch_cuda']}")
    return issues


def _smoke():
    """One autocast + GradScaler training step through ampkernels ops; returns a status line."""
    if not torch.cuda.is_available():
        return {"ok": None, "detail": "skipped: no CUDA device"}
    from . import nn as ak_nn
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(ak_nn.LayerNorm(256), ak_nn.Linear(256, 512, activation="gelu_tanh"),
                                    torch.nn.Linear(512, 256)).cuda()
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        scaler = torch.amp.GradScaler("cuda")
        x = torch.randn(64, 256, device="cuda")
        dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        with torch.autocast("cuda", dtype=dtype):
            loss = model(x).float().square().mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        grads_ok = all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
        ok = bool(torch.isfinite(loss).item() and grads_ok)
        return {"ok": ok, "detail": f"{dtype} autocast step, loss {loss.item():.4f}, finite grads: {grads_ok}"}
    except Exception as e:
        return {"ok": False, "detail": f"{type(e).__name__}: {str(e)[:300]}"}


def collect():
    gpu = _gpu()
    v = _versions()
    avail = backends.available_backends()
    ext_loaded, ext_reason, ext_how = _extension.status()
    ext = _extension.build_info() if ext_loaded else {}
    covers = None
    if gpu and ext.get("archs"):
        cc = int(gpu["cc"].replace(".", ""))
        covers = cc in ext["archs"] or any(a <= cc and a // 10 == cc // 10 for a in ext["archs"])
    report = {
        "gpu": gpu, "versions": v, "version_issues": _agreement(v, ext),
        "extension": {"loaded": bool(ext_loaded), "how": ext_how, "detail": ext_reason, **ext,
                      "covers_this_gpu": covers},
        "backends": {k: {"available": a, "reason": r} for k, (a, r) in avail.items()},
        "smoke": _smoke(),
    }
    report["verdict"] = _verdict(report)
    return report


def _verdict(r):
    if r["gpu"] is None:
        return "NO GPU: ampkernels runs its torch reference path here (correct, not fast); kernels need a CUDA GPU"
    live = [k for k in ("cuda", "triton") if r["backends"][k]["available"]]
    if r["smoke"]["ok"] is False:
        return f"PROBLEM: the AMP smoke step failed ({r['smoke']['detail']})"
    if not live:
        return "DEGRADED: no kernel backend is live; only the torch reference runs (see backends above)"
    issues = "; ".join(r["version_issues"])
    return f"OK: {', '.join(live)} backend(s) live on {r['gpu']['name']} (sm_{r['gpu']['cc'].replace('.', '')})" + \
        (f"; check: {issues}" if issues else "")


def format_text(r):
    lines = []
    g = r["gpu"]
    if g:
        lines += [f"GPU           {g['name']}  compute capability {g['cc']}, {g['sms']} SMs, {g['memory_gb']} GiB",
                  f"Tensor Cores  {g['architecture']}: {g['tensor_cores']}",
                  f"AMP           {g['amp']}"]
    else:
        lines += ["GPU           none visible to torch (torch.cuda.is_available() is False)"]
    v = r["versions"]
    lines += [f"versions      python {v['python']}, torch {v['torch']} (CUDA {v['torch_cuda']}), "
              f"cuDNN {v['cudnn']}, triton {v['triton']}, driver CUDA {v['driver_cuda']}"]
    for issue in r["version_issues"]:
        lines.append(f"  mismatch    {issue}")
    e = r["extension"]
    ext_line = f"loaded ({e['how']}), archs {e.get('archs')}, covers this GPU: {e['covers_this_gpu']}" \
        if e["loaded"] else f"not loaded: {e['detail']}"
    lines.append(f"extension     {ext_line}")
    for name, b in r["backends"].items():
        lines.append(f"backend       {name:7s} {'live' if b['available'] else 'off '}  {b['reason']}")
    lines.append(f"smoke         {r['smoke']['detail']}")
    lines.append(f"verdict       {r['verdict']}")
    return "\n".join(lines)


def main(argv=None):
    import argparse
    p = argparse.ArgumentParser(prog="ampkernels doctor", description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    _extension.load()  # report the real state (on a GPU machine this may build at first use)
    r = collect()
    print(json.dumps(r, indent=2) if args.json else format_text(r))
    return 0 if r["smoke"]["ok"] is not False else 1


if __name__ == "__main__":
    sys.exit(main())
