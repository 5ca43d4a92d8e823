#!/usr/bin/env bash
# compute-sanitizer (memcheck, racecheck, initcheck, synccheck) over the CUDA and Triton
# kernels of both ops, forward and backward, on boundary shapes (scripts/sanitize_cases.py).
# Run on the GPU machine after installing the package; writes $OUT/sanitizer.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
SAN=${COMPUTE_SANITIZER:-$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)}
export PYTORCH_NO_CUDA_MEMORY_CACHING=1  # let the sanitizer see each allocation's real bounds
summary="$OUT/sanitizer.txt"
: >"$summary"
for tool in ${SANITIZER_TOOLS:-memcheck racecheck initcheck synccheck}; do
  log="$OUT/sanitizer-$tool.log"
  extra=""
  [ "$tool" = memcheck ] && extra="--leak-check full"
  t0=$SECONDS
  timeout "${SANITIZER_TIMEOUT:-900}" "$SAN" --tool "$tool" $extra --target-processes all \
    python3 scripts/sanitize_cases.py ${SANITIZER_BACKENDS:-cuda triton} >"$log" 2>&1
  rc=$?
  line=$(grep -E "ERROR SUMMARY|RACECHECK SUMMARY|LEAK SUMMARY" "$log" | tail -3 | tr '\n' ' ')
  echo "$tool: rc=$rc $((SECONDS - t0))s ${line:-no summary (see $log)}" | tee -a "$summary"
  grep -E "^========= (Invalid|Uninitialized|Race|Barrier|Error)" "$log" | sort | uniq -c | head -10 | tee -a "$summary"
done
