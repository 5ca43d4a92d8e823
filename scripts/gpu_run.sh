#!/usr/bin/env bash
# One call on the GPU machine: build + install, doctor, the GPU test tier, benchmarks.
# Logs and JSON go under $OUT (default ./out; at most 8 files come back from the device
# tool, so plots are drawn afterwards from results.jsonl); a short summary is printed last.
# docs/benchmarking.md describes the runs and how to read what comes back.
#
#   bash scripts/gpu_run.sh                       # everything: pytest -m gpu -n 12, then all benchmarks
#   GPU_TESTS="tests/test_layer_norm.py" GPU_BENCH="layer_norm" bash scripts/gpu_run.sh
#   GPU_TESTS=none GPU_BENCH="linear_act" BENCH_ARGS="--quick" bash scripts/gpu_run.sh
#   GPU_TESTS=none GPU_BENCH=none GPU_CMD='python scripts/profile_mlp_block.py --out "$OUT"' bash scripts/gpu_run.sh
#
# GPU_TESTS: pytest paths/args for `pytest -m gpu` ("tests" by default, "none" skips; split on
# spaces, so a -k expression there must be one word); GPU_TESTS_K: a -k expression of any length
# (its words also match the names of the directories above the tests: use words only test names
# have); GPU_TESTS_SHARD=K/N: the K-th of N shards of them (tests/conftest.py), so that a tier
# longer than one call runs over N warm calls; GPU_TEST_WORKERS: pytest-xdist workers (12: the
# tier's time goes to compiling kernels, on the host's cores; 0 runs in one process). Shards and
# workers are balanced by tests/gpu_durations.json. The 15 slowest tests are listed at the end of
# tests.log, every test's time is in tests.xml (scripts/test_durations.py updates the file from it).
# GPU_BENCH: benchmark ops (ampkernels/bench/bench_<op>.py; "all" by default, "none" skips);
# BENCH_ARGS: passed on.
# AMPKERNELS_COMMIT names the commit in result rows; set it literally, from this side's git (the
# copy's .git HEAD may not be the copied tree).
# GPU_JIT_CHECK=1 also checks the first-use build of a package installed without _C.
# .wheels/ (scripts/fetch_wheels.sh; carry it along) is installed after the build: public
# providers (liger-kernel) measured beside ours.
# GPU_SANITIZE=1 runs scripts/sanitize.sh after the tests (SANITIZER_* variables pass on).
# GPU_CMD: a shell command run after the benchmarks (OUT exported; output in cmd.log, capped by
# GPU_CMD_TIMEOUT seconds, 600 by default), e.g. a profile or a launch sweep.
# GPU_BG_CMD: a shell command started after the build and doctor, beside the tests, sanitizer and
# benchmarks (output in bg.log, capped by GPU_BG_TIMEOUT seconds, 600 by default; waited for
# before the summary): a check whose result is not a timing, e.g. the soak, in a call's spare
# GPU time. Its own timings then include the others' load.
# BENCH_SPREAD=1 on a machine with several GPUs runs the benchmark modules in parallel, one
# process per module queued round-robin over the GPUs, rows merged. Off by default: the host load
# of one process (autotuning, torch.compile) slows the other's host-bound rows.
# TESTS_TIMEOUT / BENCH_TIMEOUT (seconds) cap those steps so that one call fits its limit;
# what ran before the cap stays in the logs and results.jsonl.
# More than 8 files under $OUT: the *.log files go into one logs.tar.gz (8 files come back).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
export OUT MAX_JOBS=${MAX_JOBS:-16} PYTHONUNBUFFERED=1  # architectures: the visible GPU's
export AMPKERNELS_FORCE_CUDA=1   # a GPU machine must build the extension
PY=${PYTHON:-python3}
status=()
step() {  # step NAME LOGFILE CMD...: run, log, remember the exit code
  local name=$1 log=$2; shift 2
  local t0=$SECONDS
  echo "== $name"
  "$@" >"$OUT/$log" 2>&1
  local rc=$?
  status+=("$name: rc=$rc ($((SECONDS - t0))s, $log)")
  tail -n 5 "$OUT/$log"
  echo "${status[-1]}"  # now, not only in the summary: a call cut at its limit still shows each step's time
  return $rc
}

{ nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
  $PY -c "import torch, triton, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
  echo "commit ${AMPKERNELS_COMMIT:-unknown}"; echo "checkout $PWD"; } >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

if [ "${GPU_JIT_CHECK:-0}" = 1 ]; then
  # what a plain `pip install .` leaves: the package and its sources, no _C; first use compiles.
  # Before the editable install below, whose import hook would shadow this copy.
  jit=$(mktemp -d)
  cp -r ampkernels "$jit/" && rm -f "$jit"/ampkernels/_C*.so && cp -r csrc "$jit/ampkernels/csrc"
  step jit_build jit.log env -C "$jit" PYTHONPATH="$jit" TORCH_EXTENSIONS_DIR="$jit/ext" $PY -c \
    "import ampkernels, torch; ok, why = ampkernels.available_backends()['cuda']; print(ampkernels.__file__, ok, why); assert ok and '(jit)' in why"
fi
# The editable install keeps _C in the checkout (an ignored path, which a warm device machine
# keeps between calls), but pip compiles every source again each time, in a fresh build
# directory: skip the build when the sources that go into _C are those of the last build here.
sources_hash() { cat csrc/* setup.py pyproject.toml ampkernels/_build_env.py | sha256sum | cut -d' ' -f1; }
stamp=build/gpu_run.stamp sources=$(sources_hash)
if [ "$(cat "$stamp" 2>/dev/null)" = "$sources" ] && $PY -c "import ampkernels._C" 2>/dev/null; then
  echo "== build: skipped, the installed _C was built here from these sources" | tee "$OUT/build.log"
  status+=("build: skipped (sources unchanged since this machine's last build)")
else
  rm -f "$stamp"
  step build build.log $PY -m pip install --no-build-isolation --no-deps -v -e . || { printf '%s\n' "${status[@]}"; exit 1; }
  mkdir -p build && echo "$sources" >"$stamp"
fi
if [ -d .wheels ]; then
  # optional public benchmark providers carried as wheels (scripts/fetch_wheels.sh); logged into
  # build.log since at most 8 files come back; a failed install only loses those providers' rows
  echo "== wheels"
  $PY -m pip install --no-deps --no-index .wheels/*.whl >>"$OUT/build.log" 2>&1
  rc=$?; status+=("wheels: rc=$rc (build.log)"); tail -n 2 "$OUT/build.log"
fi
step doctor doctor.json $PY -m ampkernels doctor --json
if [ -n "${GPU_BG_CMD:-}" ]; then
  echo "== background: $GPU_BG_CMD"
  timeout "${GPU_BG_TIMEOUT:-600}" bash -c "$GPU_BG_CMD" >"$OUT/bg.log" 2>&1 &
  bg_pid=$! bg_t0=$SECONDS
fi

if [ "${GPU_TESTS:-tests}" != none ]; then
  # SIGINT at the cap: pytest then still reports the failures so far (a plain timeout kills it
  # before it prints which example failed)
  # shellcheck disable=SC2086
  step tests tests.log timeout -s INT -k 60 "${TESTS_TIMEOUT:-3000}" $PY -m pytest -m gpu -q -p no:cacheprovider \
    -n "${GPU_TEST_WORKERS:-12}" --dist worksteal --durations=15 --junitxml="$OUT/tests.xml" ${GPU_TESTS_K:+-k "$GPU_TESTS_K"} \
    ${GPU_TESTS_SHARD:+--shard "$GPU_TESTS_SHARD"} ${GPU_TESTS:-tests}
  grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -40
fi
if [ "${GPU_SANITIZE:-0}" = 1 ]; then
  step sanitize sanitize.log env OUT="$OUT" bash scripts/sanitize.sh
fi
bench_spread() {  # one benchmark module per process, queued round-robin over the $ngpu GPUs
  local ops=$1 i=0 op
  [ "$ops" = all ] && ops="layer_norm linear_act mlp e2e"  # layer_norm's module measures rms_norm too
  declare -A queue
  for op in $ops; do queue[$((i % ngpu))]+="$op "; i=$((i + 1)); done
  for g in "${!queue[@]}"; do
    ( for op in ${queue[$g]}; do
        # shellcheck disable=SC2086
        CUDA_VISIBLE_DEVICES=$g timeout "${BENCH_TIMEOUT:-3000}" $PY -m ampkernels bench --op "$op" \
          --out "$OUT/bench-$op" ${BENCH_ARGS:-} >"$OUT/bench-$op.log" 2>&1
        echo "bench $op on GPU $g: rc=$?"
      done ) &
  done
  wait
  # one results.jsonl / results.csv / report.txt, as a single run writes them
  echo "targets, measured in this run:" >"$OUT/report.txt"
  for op in $ops; do
    local d="$OUT/bench-$op"
    [ -f "$d/results.jsonl" ] && cat "$d/results.jsonl" >>"$OUT/results.jsonl"
    if [ -f "$d/results.csv" ]; then  # one header
      if [ -f "$OUT/results.csv" ]; then tail -n +2 "$d/results.csv" >>"$OUT/results.csv"; else cp "$d/results.csv" "$OUT/"; fi
    fi
    [ -f "$d/report.txt" ] && tail -n +2 "$d/report.txt" >>"$OUT/report.txt"
    rm -rf "$d"
  done
}
if [ "${GPU_BENCH:-all}" != none ]; then
  ngpu=$(nvidia-smi -L | wc -l)
  if [ "$ngpu" -gt 1 ] && [ "${BENCH_SPREAD:-0}" = 1 ]; then
    step bench bench.log bench_spread "${GPU_BENCH:-all}"
  else
    # shellcheck disable=SC2086
    step bench bench.log timeout "${BENCH_TIMEOUT:-3000}" $PY -m ampkernels bench --op ${GPU_BENCH:-all} --out "$OUT" ${BENCH_ARGS:-}
  fi
fi
if [ -n "${GPU_CMD:-}" ]; then
  step cmd cmd.log timeout "${GPU_CMD_TIMEOUT:-600}" bash -c "$GPU_CMD"
fi

if [ -n "${bg_pid:-}" ]; then
  wait "$bg_pid"
  status+=("background: rc=$? ($((SECONDS - bg_t0))s, bg.log)")
  tail -n 5 "$OUT/bg.log"
fi
echo "== summary"
printf '%s\n' "${status[@]}"
grep -E "passed|failed" "$OUT/tests.log" 2>/dev/null | tail -1
[ -f "$OUT/sanitizer.txt" ] && cat "$OUT/sanitizer.txt"
[ -f "$OUT/report.txt" ] && cat "$OUT/report.txt"
if [ "$(find "$OUT" -maxdepth 1 -type f | wc -l)" -gt 8 ]; then
  (cd "$OUT" && tar -czf logs.tar.gz ./*.log && rm -f ./*.log)
fi
exit 0
