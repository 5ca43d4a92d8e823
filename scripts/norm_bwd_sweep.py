"""Launch-config sweep of the Triton norm backward at long rows (default N = 16384, M = 2^27 // N).

For LayerNorm (dweight, dbias) and RMSNorm (dweight), x in bf16 and fp16, params in x's dtype
and fp32 (the AMP case): mean/rstd from tln.norm_fwd, then norm_bwd with the library's choice
(marked *) as the reference, then each candidate (BLOCK_N, ROWS, num_warps, programs per SM,
looped, num_stages) launched through tln._bwd_launch: its dx (atol/rtol 1e-2) and dweight/dbias
(rtol 1e-3, or 2 ulps of 16-bit params, atol scaled by the largest value) checked against the
reference, then timed as a CUDA-graph replay (GPU time). TB/s counts x and dy read and dx
written (3 * M * N * 2 bytes). A config that raises (OutOfResources, compile errors) or
mismatches is reported and not timed. Lines sorted by TB/s per case, a cross-case summary last;
also written to OUT/norm-bwd-sweep.log.
Candidates, pruned as pointless on an H200 (sm_90 ptxas, Triton 3.8):
  reg:    the register kernel, BLOCK_N = next_power_of_2(N) (RELOAD above 8192), one row a step,
          8/16/32 warps, stages 1-3 where the library's shared-memory model fits (RELOAD: 2 at
          most), 1 program per SM (every variant takes the whole register file: 255/128/64
          registers at 8/16/32 warps; a second program per SM would run in a second wave).
  looped: chunks of 1024-8192 columns, 4/8/16 warps, 1/2/4 programs per SM, stages 1-3, kept
          when 4-32 elements a thread, 8-32 warps resident per SM, the programs fit one SM's
          registers (estimated 32 + 4 per element) and shared memory, and they keep >= 16 KB
          of x/dy loads in flight per SM.
  gluon:  the Gluon backward (ampkernels/triton/layer_norm_gluon.py; off by default in the
          library from tln.GLUON_MIN_N; here at any N) where this Triton has Gluon and the call is one it takes.
  cuda:   the CUDA backend's backward, for reference (not a Triton launch).
At N = 16384: 58 configs per case, 464 in all; about 3 minutes with compiles; --budget-s caps it.
--gluon-ab times only the library's choice, the Gluon backward and the CUDA backend's (the A/B that
decides the Gluon backward's default).

    GPU_TESTS=none GPU_BENCH=none GPU_CMD='python scripts/norm_bwd_sweep.py 16384 --out "$OUT"' bash scripts/gpu_run.sh
    python scripts/norm_bwd_sweep.py [N] [--out DIR] [--budget-s 230] [--gluon-ab]
    python scripts/norm_bwd_sweep.py --cpu-smoke   # TRITON_INTERPRET=1, CPU, N = 64, fp16, no timing
"""
import argparse
import math
import os
import sys
import time

if "--cpu-smoke" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # before any Triton kernel is defined
import torch
from ampkernels.bench.common import environment, graph_replay_ms, probe_log


def candidates(tln, n, xdy, smem, smoke):
    """(configs to try, how many were pruned); xdy: bytes of an x plus a dy element."""
    block = 1 << (n - 1).bit_length()
    if smoke:  # RELOAD (forced by the caller), the looped kernel, and one that cannot compile
        return [(block, 1, 4, 1, False, 1), (block, 1, 4, 1, False, 2), (block // 4, 1, 4, 1, True, 2),
                (block // 2, 1, 4, 2, True, 1), (48, 1, 4, 1, True, 1)], 0
    x16, w32 = torch.empty(0, dtype=torch.float16), torch.empty(0, dtype=torch.float32)

    def fits(cfg):  # the library's shared-memory model, a program's share of an SM, fp32 params (the larger)
        return tln._bwd_fit(cfg, smem // cfg[3], x16, x16, w32, None) == cfg
    everything = [(block, 1, w, 1, False, s) for w in (8, 16, 32) for s in (1, 2, 3)]
    everything += [(c, 1, w, p, True, s) for c in (1024, 2048, 4096, 8192) if c <= block for w in (4, 8, 16)
                   for p in (1, 2, 4) for s in (1, 2, 3)]
    kept = []
    for cfg in everything:
        block_n, _, warps, per_sm, looped, stages = cfg
        e = block_n // (32 * warps)  # elements a thread
        ok = fits(cfg) if not looped else (
            4 <= e <= 32 and 8 <= per_sm * warps <= 32 and per_sm * warps * (32 + 4 * e) <= 2048
            and fits(cfg) and per_sm * stages * block_n * xdy >= 16384)
        kept += [cfg] * ok
    return kept, len(everything) - len(kept)


GLUON = "gluon"  # the candidate that runs the library's RELOAD config with the Gluon kernel
CUDA = "cuda"    # the CUDA backend's backward (torch.ops.ampkernels.norm_bwd_cuda), for reference


def label(cfg):
    if cfg == GLUON:
        return "gluon (layer_norm_gluon.py)"
    if cfg == CUDA:
        return "cuda backend (reference)"
    block, rows, warps, per_sm, looped, stages = cfg
    return f"{'looped' if looped else 'reg'} {block}x{rows} w{warps} p{per_sm} s{stages}"


def close(a, b, tol):
    a, b = a.float(), b.float()
    return bool(torch.allclose(a, b, rtol=tol, atol=tol * b.abs().max().item())), (a - b).abs().max().item()


def run_case(tln, op, dtype, pdtype, n, m, dev, cands, case_end, smoke):
    """(default config, rows of (TB/s or -1 mismatch / -2 failed / nan untimed, config, text), skipped)."""
    is_rms = op == "rms_norm"
    x = torch.randn(m, n, device=dev, dtype=dtype)
    dy = torch.randn(m, n, device=dev, dtype=dtype)
    w = torch.rand(n, device=dev, dtype=pdtype) + 0.5
    b = None if is_rms else torch.randn(n, device=dev, dtype=pdtype)
    _, _, mean, rstd = tln.norm_fwd(x, w, b, None, 1e-5, is_rms, None, False)
    tln._BWD_CONFIGS.clear()  # so that the one config norm_bwd settles on is the only entry
    ref = tln.norm_bwd(dy, x, w, mean, rstd, None, is_rms, True, not is_rms, dtype, None, pdtype)
    default = next(iter(tln._BWD_CONFIGS.values()))
    tol = max(1e-3, 2 * torch.finfo(pdtype).eps)
    rows, skipped = [], 0
    for cfg in dict.fromkeys([default, *cands]):
        if time.time() > case_end:
            skipped += 1
            continue
        outs = (torch.full_like(x, math.nan), x.new_empty(0), torch.full_like(w, math.nan),
                torch.full((0 if is_rms else n,), math.nan, device=dev, dtype=pdtype))

        def launch(cfg=cfg, outs=outs):
            if cfg == CUDA:  # its outputs are its own: copied into outs (the copy is not timed below)
                return torch.ops.ampkernels.norm_bwd_cuda(dy, x, w, mean, rstd, None, is_rms, True, not is_rms,
                                                          dtype, None, pdtype)
            if cfg != GLUON:
                tln._bwd_launch(cfg, dy, x, w, mean, rstd, None, is_rms, True, not is_rms, *outs)
                return
            if not tln._gluon.available():
                raise RuntimeError("this Triton has no Gluon")
            saved, tln.GLUON_MIN_N = tln.GLUON_MIN_N, dict.fromkeys(tln.GLUON_MIN_N, 0)
            try:
                if not tln._gluon_bwd_takes(x, dy, None, x.new_empty(0)):
                    raise RuntimeError("the Gluon backward does not take this call")
                tln._bwd_launch(default, dy, x, w, mean, rstd, None, is_rms, True, not is_rms, *outs)
            finally:
                tln.GLUON_MIN_N = saved
        try:
            got = launch()
            if cfg == CUDA:
                for o, g in zip(outs, got):
                    o.copy_(g)
            checks = [close(outs[0], ref[0], 1e-2)] + [close(outs[k], ref[k], tol) for k in ((2,) if is_rms else (2, 3))]
            if not all(ok for ok, _ in checks):
                rows.append((-1.0, cfg, "MISMATCH max |err| dx/dw/db " + " ".join(f"{e:.3g}" for _, e in checks)))
            elif smoke:
                rows.append((math.nan, cfg, "ok (not timed)"))
            else:
                ms = graph_replay_ms(launch, warmup=10, rep=60)
                tbps = 3 * m * n * x.element_size() / ms / 1e9
                rows.append((tbps, cfg, f"{tbps:6.3f} TB/s {ms * 1e3:7.1f} us"))
        except Exception as e:  # noqa: BLE001 -- a config that cannot run is reported, the sweep goes on
            rows.append((-2.0, cfg, f"failed: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"))
    return default, rows, skipped


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("n", type=int, nargs="?", help="row length (default 16384; 64 with --cpu-smoke)")
    ap.add_argument("--out", default=".")
    ap.add_argument("--budget-s", type=float, default=230, help="seconds for the whole sweep, shared over the cases")
    ap.add_argument("--cpu-smoke", action="store_true")
    ap.add_argument("--gluon-ab", action="store_true", help="only the library's choice and the Gluon backward")
    args = ap.parse_args()
    from ampkernels.triton import layer_norm as tln  # after TRITON_INTERPRET is set
    smoke = args.cpu_smoke
    n = args.n or (64 if smoke else 16384)
    m, dev = (16, torch.device("cpu")) if smoke else (2**27 // n, torch.device("cuda"))
    if smoke:
        tln._MAX_BWD_BLOCK = (1 << (n - 1).bit_length()) // 2  # the register candidates take RELOAD, as at 16384
    os.makedirs(args.out, exist_ok=True)
    cases = [(op, dt, pd) for op in ("layer_norm", "rms_norm") for dt in ((torch.float16,) if smoke else
             (torch.bfloat16, torch.float16)) for pd in (dt, torch.float32)]
    cands, pruned = candidates(tln, n, 4, tln._smem_per_program(dev), smoke)
    if not smoke:  # (no Gluon interpreter, no CUDA extension on CPU tensors)
        cands, pruned = ([GLUON, CUDA], pruned + len(cands)) if args.gluon_ab else (cands + [GLUON, CUDA], pruned)
    env = environment()
    results, tried, failed, skipped, t_end = {}, 0, 0, 0, time.time() + args.budget_s
    with probe_log(os.path.join(args.out, "norm-bwd-sweep.log")) as say:
        say(f"# {env['gpu']} (cc {env['cc']}), torch {env['torch']} (cuda {env['cuda']}), triton {env['triton']}, "
            f"commit {env['commit']}; N={n} M={m}; {len(cands)} configs per case ({pruned} pruned) x {len(cases)} cases; "
            f"TB/s = 3*M*N*2 B / CUDA-graph replay median; * = norm_bwd's own choice")
        for i, (op, dtype, pdtype) in enumerate(cases):
            case_end = time.time() + (t_end - time.time()) / (len(cases) - i)
            default, rows, skip = run_case(tln, op, dtype, pdtype, n, m, dev, cands, case_end, smoke)
            name = f"{op} {str(dtype)[6:]} params={str(pdtype)[6:]}"
            tried, failed, skipped = tried + len(rows), failed + sum(r[0] < 0 for r in rows), skipped + skip
            for tbps, cfg, what in sorted(rows, key=lambda r: -r[0] if r[0] == r[0] else 0.0):
                say(f"{name:38s} {label(cfg):30s} {what}{'  *' if cfg == default else ''}")
                if tbps > 0:
                    results.setdefault(cfg, {})[name] = tbps
        say(f"# {tried} configs tried ({failed} failed or mismatched), {skipped} skipped past --budget-s {args.budget_s:g}")
        full = sorted((min(v.values()), cfg) for cfg, v in results.items() if len(v) == len(cases))
        for worst, cfg in full[::-1][:10]:
            mean_tbps = sum(results[cfg].values()) / len(cases)
            say(f"# over all {len(cases)} cases: {label(cfg):30s} min {worst:6.3f} mean {mean_tbps:6.3f} TB/s")


if __name__ == "__main__":
    main()
