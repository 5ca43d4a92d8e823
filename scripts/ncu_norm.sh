#!/usr/bin/env bash
# Nsight Compute (ncu) over single norm forward launches, to see why the CUDA LayerNorm forward
# runs 3.3-3.5 TB/s where CUDA RMSNorm (the same kernel, one reduction) and the Triton
# LayerNorm forward reach 3.9-4.0 (benchmarks/results/h200-2026-11-30-a519255-norms.jsonl), and
# why fp32 params (the AMP case) cost LayerNorm 10-15% more at N >= 8192. Two tuning guesses
# measured blind did not move it (one-barrier statistics at dcf3d2b, fewer vectors a thread at
# 1622f6b): this reads the counters instead (stall reasons, occupancy, L1/L2 traffic).
# Run on the GPU machine after installing the package (scripts/gpu_run.sh with GPU_NCU=1).
# Writes $OUT/ncu-norm.txt: per case, ncu's details page for the one profiled launch.
#   NCU_CASES="layer_norm:cuda:4096:x rms_norm:cuda:4096:x"   NCU_TIMEOUT=120 (per case)
#   NCU_SOURCE=1: also the per-SASS-instruction page (SourceCounters: executed instructions per
#   line) of each case as $OUT/ncu-source-<op>-<backend>-<N>-<params>.csv, to see where a
#   kernel's instructions go (at c2c6bb7 the CUDA LayerNorm forward issued ~990 a warp at
#   N = 4096 against Triton's ~540).
cd "$(dirname "$0")/.."
. scripts/ncu_common.sh
report="$OUT/ncu-norm.txt"
# op:backend:N:params (params "x" = x's dtype, "fp32" = the AMP case); x is bf16, M*N = 2^27
CASES=${NCU_CASES:-"layer_norm:cuda:4096:x rms_norm:cuda:4096:x layer_norm:triton:4096:x layer_norm:cuda:4096:fp32 layer_norm:cuda:16384:fp32 rms_norm:cuda:16384:fp32"}
SECTIONS="--section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats \
--section SchedulerStats --section MemoryWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables"
"$NCU" --version 2>&1 | tail -1 >"$report"
for case in $CASES; do
  IFS=: read -r op backend n params <<<"$case"
  echo "== $case" | tee -a "$report"
  # three calls: the first compiles (Triton) and warms the caches; ncu profiles the third launch
  # of the forward kernel (CUDA: norm_fwd*; Triton: _norm_fwd*)
  script="
import torch, ampkernels
n = $n; m = 2**27 // n
x = torch.randn(m, n, device='cuda', dtype=torch.bfloat16)
pd = torch.float32 if '$params' == 'fp32' else x.dtype
w, b = torch.rand(n, device='cuda', dtype=pd), torch.randn(n, device='cuda', dtype=pd)
for _ in range(3):
    y = ampkernels.layer_norm(x, (n,), w, b, backend='$backend') if '$op' == 'layer_norm' else \
        ampkernels.rms_norm(x, (n,), w, backend='$backend')
torch.cuda.synchronize()
"
  # shellcheck disable=SC2086
  ncu_details "$report" norm_fwd "$script" $SECTIONS
  if [ "${NCU_SOURCE:-0}" = 1 ]; then
    ncu_source "$report" norm_fwd "$script" "$OUT/ncu-source-$op-$backend-$n-$params.csv"
  fi
done
grep -E "^== |rc=|Duration|Memory Throughput|DRAM Throughput|Achieved Occupancy|Registers Per|Theoretical Occupancy|L1/TEX Hit|L2 Hit" "$report" | head -120
