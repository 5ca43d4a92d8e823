# Sourced by scripts/ncu_*.sh: one Nsight Compute setup and the two ways they profile a case.
# ncu runs with --clock-control none (the device notes ask to leave the clocks alone) and
# profiles the third matching launch of the case's script (the first compiles and warms up).
set -uo pipefail
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
NCU=${NCU:-$(command -v ncu || echo /usr/local/cuda/bin/ncu)}

# ncu_details REPORT REGEX SCRIPT SECTIONS...: ncu's details page for the kernel, appended to REPORT
ncu_details() {
  local report=$1 regex=$2 script=$3
  shift 3
  timeout "${NCU_TIMEOUT:-120}" "$NCU" --clock-control none --target-processes all "$@" \
    -k "regex:$regex" --launch-skip 2 --launch-count 1 python3 -c "$script" >>"$report" 2>&1
  echo "rc=$?" >>"$report"
}

# ncu_source REPORT REGEX SCRIPT CSV: the per-SASS-line page (scripts/ncu_source_summary.py reads it)
ncu_source() {
  local report=$1 regex=$2 script=$3 csv=$4
  timeout "${NCU_TIMEOUT:-120}" "$NCU" --clock-control none --target-processes all --section SourceCounters \
    --page source --print-source sass --csv -k "regex:$regex" --launch-skip 2 --launch-count 1 \
    python3 -c "$script" >"$csv" 2>&1
  echo "source page rc=$? ($csv)" >>"$report"
}
