#!/usr/bin/env bash
# Nsight Compute over single launches of the Hopper ping-pong forward (Triton/Gluon,
# ampkernels/triton/linear_act_pingpong.py), to see why erf GELU costs it ~20% more than ReLU at
# 4096x768x3072 bf16 (42.0 against 35.0 us, benchmarks/results/h200-2026-12-01-9836fa4-pingpong-
# probe.log) when ping-pong should hide one consumer's epilogue behind the other's main loop:
# tensor-pipe utilisation, issue slots, and where each warp stalls (barrier waits on the turn
# or the operand ring, the epilogue's math, the stores).
# Run on the GPU machine after installing the package (scripts/gpu_run.sh with GPU_NCU=pingpong).
# Writes $OUT/ncu-pingpong.txt (ncu's details page per case) and, per case, the per-SASS-line
# page as $OUT/ncu-source-pingpong-<act>-<M>x<K>x<N>.csv (scripts/ncu_source_summary.py reads it).
#   NCU_CASES="gelu:4096:768:3072 relu:4096:768:3072"   NCU_TIMEOUT=120 (per case)
cd "$(dirname "$0")/.."
. scripts/ncu_common.sh
report="$OUT/ncu-pingpong.txt"
CASES=${NCU_CASES:-"relu:4096:768:3072 gelu:4096:768:3072"}
SECTIONS="--section SpeedOfLight --section ComputeWorkloadAnalysis --section LaunchStats --section Occupancy \
--section WarpStateStats --section SchedulerStats --section InstructionStats"
"$NCU" --version 2>&1 | tail -1 >"$report"
for case in $CASES; do
  IFS=: read -r act m k n <<<"$case"
  echo "== $case" | tee -a "$report"
  script="
import torch
from ampkernels.reference import ACTIVATIONS
from ampkernels.triton import linear_act_pingpong as pp
m, k, n = $m, $k, $n
x = torch.randn(m, k, device='cuda', dtype=torch.bfloat16)
w = (torch.randn(n, k, device='cuda') / k ** 0.5).to(torch.bfloat16)
b = torch.randn(n, device='cuda').to(torch.bfloat16)
y = torch.empty(m, n, device='cuda', dtype=torch.bfloat16)
sms = torch.cuda.get_device_properties(0).multi_processor_count
for _ in range(3):
    pp.linear_act_fwd_pingpong(x, w, b, ACTIVATIONS.index('$act'), y, None, sms)
torch.cuda.synchronize()
"
  # shellcheck disable=SC2086
  ncu_details "$report" pingpong "$script" $SECTIONS
  ncu_source "$report" pingpong "$script" "$OUT/ncu-source-pingpong-$act-${m}x${k}x${n}.csv"
done
grep -E "^== |rc=|Duration|Compute \(SM\) Throughput|Issue Slots Busy|Executed Ipc|No Eligible|Registers Per" "$report" | head -80
