#!/usr/bin/env bash
# compute-sanitizer (memcheck, racecheck, initcheck, synccheck) over the CUDA and Triton
# kernels of every op family, forward and backward, on boundary shapes (scripts/sanitize_cases.py,
# which also checks every output against the reference).
# Run on the GPU machine after installing the package. Writes $OUT/sanitizer.txt (per run:
# exit code, time, the tool's summary, error kinds by kernel) and $OUT/sanitizer-logs.tar.gz
# (packed after every run, so a call cut short still brings back what ran).
#   SANITIZER_TOOLS="memcheck initcheck"  SANITIZER_BACKENDS="cuda"  SANITIZER_TIMEOUT=300
#   SANITIZER_FAMILIES="norms gated"       (op families: norms norm_mixes linear_act mlp gated lce rotary)
#   SANITIZER_JOBS=4                       (tool runs at once on the one GPU; 1 by default)
#   SANITIZER_SHARDS=2                     (memcheck/racecheck/synccheck: processes per family and
#                                           backend, each running every 2nd case; 1 by default)
#   RACECHECK_DTYPES="float16 bfloat16"    (racecheck runs float16 only by default)
#   SANITIZER_CASES=2050x                  (a regex: only the cases whose names it finds)
# memcheck, racecheck and synccheck run one process per op family and backend: all families in
# one process outlasted a 100 s cap under memcheck and racecheck, the norms of both backends a
# 120 s one under memcheck.
# SANITIZER_JOBS runs several of them side by side (each run's time then includes the others'
# load): memcheck and synccheck gain from it, racecheck much less (it keeps the GPU busy).
# initcheck runs the norms (no cuBLAS involved: any report is ours) apart from the GEMM ops,
# whose cases also run through eager PyTorch ("torch", the control) with every report printed:
# reports it shares with the control come from reading what cuBLAS wrote (the tool does not
# see those writes), not from our kernels.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
logs=$(mktemp -d)
SAN=${COMPUTE_SANITIZER:-$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)}
BACKENDS=${SANITIZER_BACKENDS:-cuda triton}
summary="$OUT/sanitizer.txt"
"$SAN" --version | tail -1 >"$summary"
# one Triton config per kernel (AMPKERNELS_TRITON_AUTOTUNE=0): the masking and indexing under
# test are the same for every tile size, and tuning would compile and time dozens per shape
export AMPKERNELS_TRITON_AUTOTUNE=0
FAMILIES=${SANITIZER_FAMILIES:-norms norm_mixes linear_act mlp gated lce rotary}
# compile the Triton kernels once outside the tool (it slows the compiler down tenfold); the
# runs below load them from Triton's cache. One process per family and backend, all at once:
# the warm-up is bound by Triton's compiler, a core a process (one process took 3 minutes)
t0=$SECONDS
warm=()  # "pid log what" of each warm-up process
for family in $FAMILIES; do for backend in $BACKENDS; do
  SANITIZER_OPS=$family python3 scripts/sanitize_cases.py "$backend" >"$logs/warmup-$family-$backend.log" 2>&1 &
  warm+=("$! $logs/warmup-$family-$backend.log $family [$backend]")
done; done
case " $BACKENDS " in *" triton "*)  # the initcheck control below runs Triton without TMA too
  AMPKERNELS_TRITON_TMA=0 SANITIZER_OPS="linear_act mlp" python3 scripts/sanitize_cases.py triton \
    >"$logs/warmup-tma0.log" 2>&1 &
  warm+=("$! $logs/warmup-tma0.log linear_act mlp [triton] AMPKERNELS_TRITON_TMA=0") ;; esac
failed=0
for w in "${warm[@]}"; do
  read -r pid log what <<<"$w"
  wait "$pid" || { echo "warm-up $what failed:"; tail -20 "$log"; failed=1; }
done
[ "$failed" = 0 ] || exit 1
echo "warm-up (the cases without the tool, compiling the Triton kernels): $((SECONDS - t0))s, ${#warm[@]} processes" \
  | tee -a "$summary"
export PYTORCH_NO_CUDA_MEMORY_CACHING=1  # let the tool see each allocation's real bounds
JOBS=${SANITIZER_JOBS:-1}
CUBLAS_KERNELS="nvjet_|xmma|cutlass|gemv|gemmk|splitKreduce"
SEQ=0
run() {  # run TOOL OPS BACKENDS...: OPS one family or several quoted
  local tool=$1 ops=$2; shift 2
  local log="$logs/$tool-${ops// /+}-${*// /-}${AMPKERNELS_TRITON_TMA:+-tma$AMPKERNELS_TRITON_TMA}${SANITIZER_SHARD:+-shard${SANITIZER_SHARD/\//of}}.log"
  local extra="" t0=$SECONDS
  local part="$logs/summary-$SEQ.txt"
  [ "$tool" = memcheck ] && extra="--leak-check full"
  [ "$tool" = initcheck ] && extra="--print-limit 1000000 --show-backtrace no"  # count every report
  # every hazard displayed, so that none past the default 100 (cuBLAS's fill them) goes unnamed.
  # cuBLAS's kernels stay instrumented: excluding them (--kernel-name-exclude) aborted the tool
  # at the first cuBLAS GEMM ("failed to handle a hardware exception")
  [ "$tool" = racecheck ] && extra="--print-limit 1000000"
  SANITIZER_OPS="$ops" timeout "${SANITIZER_TIMEOUT:-600}" "$SAN" --tool "$tool" $extra --target-processes all \
    python3 scripts/sanitize_cases.py "$@" >"$log" 2>&1
  local rc=$?
  local line
  line=$(grep -E "ERROR SUMMARY|RACECHECK SUMMARY|LEAK SUMMARY|sanitize case" "$log" | tail -4 | tr '\n' ' ')
  [ "$rc" -ne 0 ] && line="$line(last case started: $(grep '^case ' "$log" | tail -1))"
  { echo "$tool $ops [$*]${AMPKERNELS_TRITON_TMA:+ AMPKERNELS_TRITON_TMA=$AMPKERNELS_TRITON_TMA}${SANITIZER_DTYPES:+ ($SANITIZER_DTYPES)}${SANITIZER_SHARD:+ shard $SANITIZER_SHARD}: rc=$rc $((SECONDS - t0))s ${line:-no summary}"
    # each report: its kind and the kernel(s) it names (racecheck: both accesses), counted; then
    # how many name cuBLAS's kernels (nvjet, xmma, cutlass, gemv: in the eager control as well)
    awk '/^========= [A-Z]/ && !/COMPUTE-SANITIZER|SUMMARY/ {kind=substr($0, 1, 160)}
         /^=========     (at|and) / && kind {print kind " | " substr($0, 1, 160); kind=""}' "$log" >"$log.reports"
    sort "$log.reports" | uniq -c | sort -rn | head -8
    echo "  reports: $(wc -l <"$log.reports"), naming cuBLAS's kernels: $(grep -cE "$CUBLAS_KERNELS" "$log.reports")"
    rm -f "$log.reports"; } >"$part"
  cat "$part"
  cat "$part" >>"$summary"  # one short append: whole even with runs finishing side by side
}
pack() {  # the logs so far, renamed into place so that a call cut short keeps a whole archive
  tar -czf "$OUT/.sanitizer-logs.tar.gz" -C "$logs" . && mv "$OUT/.sanitizer-logs.tar.gz" "$OUT/sanitizer-logs.tar.gz"
}
start() {  # start TOOL OPS BACKENDS...: run it, in the background while fewer than $JOBS are
  SEQ=$((SEQ + 1))
  if [ "$JOBS" -le 1 ]; then run "$@"; pack; return; fi
  while [ "$(jobs -rp | wc -l)" -ge "$JOBS" ]; do wait -n; pack; done
  run "$@" &
}
NORM_OPS=$(for f in $FAMILIES; do case $f in norm*) echo -n "$f " ;; esac; done)  # no cuBLAS involved
NORM_OPS=${NORM_OPS% }
GEMM_OPS=$(for f in $FAMILIES; do case $f in norm*) ;; *) echo -n "$f " ;; esac; done)  # their cases also run cuBLAS
GEMM_OPS=${GEMM_OPS% }
for tool in ${SANITIZER_TOOLS:-memcheck racecheck initcheck synccheck}; do
  if [ "$tool" = initcheck ]; then
    for backend in $BACKENDS; do
      [ -n "$NORM_OPS" ] && start initcheck "$NORM_OPS" "$backend"
      [ -n "$GEMM_OPS" ] && start initcheck "$GEMM_OPS" "$backend"
    done
    if [ -n "$GEMM_OPS" ]; then
      start initcheck "$GEMM_OPS" torch
      # Triton with plain stores instead of TMA descriptors: if the tool misses TMA-store writes,
      # the reports of the Triton run above vanish here (but for the reads of what cuBLAS wrote,
      # e.g. the MLP backward's dh = dout @ W2, a torch matmul read by the act' kernel); the
      # gated and cross-entropy kernels use no TMA
      case " $BACKENDS " in *" triton "*) AMPKERNELS_TRITON_TMA=0 start initcheck "$GEMM_OPS" triton ;; esac
    fi
  else
    # racecheck, the slowest tool, takes one 16-bit dtype: fp16 and bf16 kernels differ in their
    # conversions only, not in what they keep in shared memory or how they synchronize
    # (RACECHECK_DTYPES="float16 bfloat16": both)
    dtypes=${SANITIZER_DTYPES:-}
    [ "$tool" = racecheck ] && dtypes=${RACECHECK_DTYPES:-float16}
    shards=${SANITIZER_SHARDS:-1}
    for family in $FAMILIES; do for backend in $BACKENDS; do for ((k = 1; k <= shards; k++)); do
      shard=""; [ "$shards" -gt 1 ] && shard=$k/$shards
      SANITIZER_SHARD=$shard SANITIZER_DTYPES=$dtypes start "$tool" "$family" "$backend"
    done; done; done
  fi
done
wait
pack
