#!/usr/bin/env bash
# Run named jobs on the GPUs of a device machine in one call, lane by lane, and always bring the
# results back: every job writes under /tmp/res/<job>/, and at the deadline (or when all lanes
# finish) everything is packed into $OUT/results.tar.gz, with $OUT/summary.txt (the tail of each
# log). The device returns at most 8 files, so one archive holds them all.
#
#   bash scripts/gpu_jobs.sh "<jobs of GPU 0>" ["<jobs of GPU 1>" ...]
#
# Jobs (space separated, run in order within a lane; a lane is one GPU; "<job>~<s>" gives one job
# <s> seconds instead of JOB_S, within the deadline, e.g. bench=per-key~500; seco= jobs get the
# time left to the deadline unless given "~<s>"):
#   tests[=<paths>]              pytest -m gpu on the comma-separated paths (default: tests), 150 s per
#                                test (TEST_TIMEOUT), stack dump at 60 s; waits for the mamba_ssm build only when a path
#                                names mamba or backends (otherwise its adapter test skips);
#                                TEST_AUTOTUNE=0: kernels with their fixed launch settings (no
#                                autotuning compiles per test shape; test_autotune.py turns it on)
#   bench=<rows>                 scripts/bench_kernels.py --only <rows> (comma separated), --append
#   kprof=<rows>                 scripts/profile_kernels.py --only <rows>: GPU time per kernel
#   seco=<recipe>@<lengths>[@<modes>[@<args>]]   scripts/bench_seco.py $SECO_ARGS <args> --resume into
#                                seco_<recipe>.json (a previous one under .gpu_in/, carried, is continued);
#                                <args>: this job's own options, commas for spaces (--chunk-size=16384);
#                                lane n > 0 writes seco_<recipe>.lane<n>.json (resumed from .gpu_in/ too)
#   mqar=<recipes>[@<setting>]   scripts/mqar_sweep.py --setting gpu (or <setting>) $MQAR_ARGS for those
#                                recipes (comma separated)
#   profile=<recipe>@<tokens>[@<args>]   scripts/profile_step.py (<args>: commas for spaces, e.g.
#                                @--seco=4096 profiles a SeCO step)
#   script=<path>                bash <path> <output dir> (a one-off check carried in .gpu_in/)
# Logs are named by lane and by the job's place in its lane (tests_<lane>_<job>.log).
# $OUT/triton_cache.tar.gz brings Triton's caches back, $OUT/mamba_built.tar.gz a fresh mamba_ssm
# build; put them in .gpu_in/ (carried) and the next call reuses them.
# LANE_GPUS maps lanes to GPUs (default lane i on GPU i; "0 1 0 1": two lanes per GPU; small
# MQAR models leave a GPU mostly idle). Logs that would collide carry the GPU and lane number.
# HYBRIDZOO_COMMIT: the commit every results file records (the device's copy of the checkout can
# carry stale git metadata; pass the id from `git rev-parse HEAD` here).
# mamba_ssm is built (CPU, in the background) when a job names mamba, selective or conv; those
# jobs wait for it. DEADLINE_S (default 560) bounds the whole call; JOB_S (default 300) each job.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; RES=/tmp/res; rm -rf "$RES"; mkdir -p "$OUT" "$RES"  # a warm machine keeps /tmp
START=$(date +%s); DEADLINE_S=${DEADLINE_S:-560}; JOB_S=${JOB_S:-300}
source scripts/gpu_setup.sh > "$RES/setup.log" 2>&1
cp .gpu_in/seco_*.json "$RES/" 2>/dev/null  # SeCO results to resume (seco= jobs)
# Triton's compile and autotune caches at a fixed path, so that a cache carried from an earlier
# call (.gpu_in/triton_cache.tar.gz: what $OUT/triton_cache.tar.gz brought back) is found again:
# fla's chunk_gla autotuning alone outlasted 240-280 s job caps three times.
export TRITON_CACHE_DIR=/tmp/triton_cache; mkdir -p "$TRITON_CACHE_DIR"
export TRITON_CACHE_AUTOTUNING=1  # every autotuner's choices go to that cache too (fla's already did)
[ -f .gpu_in/triton_cache.tar.gz ] && tar xzf .gpu_in/triton_cache.tar.gz -C "$TRITON_CACHE_DIR"
# a job needs mamba_ssm / causal_conv1d when it names one of their ops or the adapters' tests
needs_mamba() { echo "$1" | grep -Eq "mamba|selective|conv|backends"; }
if needs_mamba "$*"; then
  (MAX_JOBS=12 bash scripts/build_mamba.sh > "$RES/mamba_build.log" 2>&1; touch "$RES/.mamba_done") &
else
  touch "$RES/.mamba_done"
fi

left() { echo $(( DEADLINE_S - ($(date +%s) - START) - 15 )); }
limit() { local l; l=$(left); [ "$l" -lt "$JOB_S" ] && echo "$l" || echo "$JOB_S"; }
# TEST_LAUNCH_BLOCKING=1: tests= jobs run with CUDA_LAUNCH_BLOCKING=1, so an illegal memory access
# is raised at the launch that made it (its traceback names the kernel), not at a later call.
# TEST_WORKERS=<n>: pytest-xdist workers for tests= jobs (.whl/ carries the wheels; tests compile
# their kernels in parallel, which is most of a GPU test's time); serial if xdist is missing
workers() { [ -n "${TEST_WORKERS:-}" ] && python3 -c "import xdist" 2>/dev/null && echo "-n $TEST_WORKERS"; }
wait_mamba() { while [ ! -e "$RES/.mamba_done" ]; do sleep 2; done; }

run_job() {  # $1 = job spec[~seconds]; runs on the lane's GPU
  local spec=${1%%~*} cap lim; lim=$(limit)
  local name=${spec%%=*} arg=${spec#*=}
  # seco= jobs resume row by row and their long rows are the point of a run: without "~<s>" they
  # get the time left, not JOB_S (session 8 lost a 1M-token row to the 300 s default)
  [ "$name" = seco ] && lim=$(left)
  [ "$spec" != "$1" ] && { cap=${1##*~}; lim=$(left); [ "$cap" -lt "$lim" ] && lim=$cap; }  # instead of JOB_S
  [ "$lim" -le 20 ] && { echo "$spec: no time left" >> "$RES/skipped.txt"; return; }
  [ "$arg" = "$spec" ] && arg=""
  echo "[$(date +%T)] GPU $CUDA_VISIBLE_DEVICES: $spec (limit ${lim}s)" >> "$RES/timeline.txt"
  case $name in
    tests) needs_mamba "$arg" && wait_mamba
           CUDA_LAUNCH_BLOCKING=${TEST_LAUNCH_BLOCKING:-0} HYBRIDZOO_AUTOTUNE=${TEST_AUTOTUNE:-1} timeout "$lim" python3 -m pytest -v -m gpu -p no:cacheprovider --timeout ${TEST_TIMEOUT:-150} \
             -o faulthandler_timeout=60 --durations=0 $(workers) ${arg:+${arg//,/ }} > "$RES/tests_${LANE}_$JOB.log" 2>&1 ;;
    bench) needs_mamba "$arg" && wait_mamba
           timeout "$lim" python3 scripts/bench_kernels.py --only "$arg" --append --out "$RES/bench_kernels.json" \
             >> "$RES/bench_kernels.log" 2>&1 ;;
    seco) IFS=@ read -r recipe lengths modes extra <<< "$arg"
          local tag=""; [ "$LANE" != 0 ] && tag=".lane$LANE"  # lanes never share a results file
          timeout "$lim" python3 scripts/bench_seco.py --recipes "$recipe" --lengths "$lengths" \
            ${modes:+--modes $modes} ${SECO_ARGS:-} ${extra:+${extra//,/ }} --resume --out "$RES/seco_$recipe$tag.json" \
            >> "$RES/seco_$recipe$tag.log" 2>&1 ;;
    mqar) IFS=@ read -r recipes setting <<< "$arg"
          timeout "$lim" python3 scripts/mqar_sweep.py --setting "${setting:-gpu}" --device cuda --recipes "$recipes" ${MQAR_ARGS:-} \
            --out-dir "$RES/mqar_$LANE" --name mqar --runs-dir /tmp/mqar_runs \
            > "$RES/mqar_$LANE.log" 2>&1 ;;
    kprof) needs_mamba "$arg" && wait_mamba
           timeout "$lim" python3 scripts/profile_kernels.py --only "$arg" --out "$RES/kprof_${LANE}_$JOB.txt" \
             > "$RES/kprof_${LANE}_$JOB.log" 2>&1 ;;
    script) timeout "$lim" bash "$arg" "$RES/script_${LANE}_$JOB" > "$RES/script_${LANE}_$JOB.log" 2>&1 ;;
    profile) IFS=@ read -r recipe tokens extra <<< "$arg"
             timeout "$lim" python3 scripts/profile_step.py "$recipe" --tokens "${tokens:-8192}" ${extra:+${extra//,/ }} \
               --out "$RES/profile_${LANE}_${JOB}_$recipe.txt" > "$RES/profile_${LANE}_${JOB}_$recipe.log" 2>&1 ;;
    *) echo "unknown job $spec" >> "$RES/skipped.txt" ;;
  esac
  local rc=$?
  echo "[$(date +%T)] GPU $CUDA_VISIBLE_DEVICES: $spec exit $rc" >> "$RES/timeline.txt"
}

pids=()
read -r -a lane_gpus <<< "${LANE_GPUS:-$(seq -s ' ' 0 $(($# - 1)))}"
i=0
for lane in "$@"; do
  ( export CUDA_VISIBLE_DEVICES=${lane_gpus[$i]} LANE=$i JOB=0
    for job in $lane; do run_job "$job"; JOB=$((JOB + 1)); done ) &
  pids+=($!); i=$((i + 1))
done
while [ "$(left)" -gt 0 ]; do
  alive=0; for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null && alive=1; done
  [ $alive = 0 ] && break; sleep 3
done
for p in "${pids[@]}"; do pkill -TERM -P "$p" 2>/dev/null; done; sleep 2
{ cat "$RES/timeline.txt" "$RES/skipped.txt" 2>/dev/null
  for f in "$RES"/*.log "$RES"/*/*.log; do [ -f "$f" ] && { echo "== $f"; tail -n 15 "$f" | cut -c1-240; }; done
} > "$OUT/summary.txt"
rm -rf /tmp/res_pack && cp -r "$RES" /tmp/res_pack && tar czf "$OUT/results.tar.gz" -C /tmp/res_pack .
# the caches for the next call: compiled kernels (binary + metadata) and autotune choices; only the
# autotune choices if that is over the 16 MiB a returned file may have
# a fresh mamba_ssm build (scripts/build_mamba.sh), if it fits the 16 MiB a returned file may have
[ -f /tmp/mamba_built.tar.gz ] && [ "$(stat -c %s /tmp/mamba_built.tar.gz)" -lt 16000000 ] \
  && cp /tmp/mamba_built.tar.gz "$OUT/"
( cd "$TRITON_CACHE_DIR" && find . -name '*.cubin' -o -name '*.json' | tar czf "$OUT/triton_cache.tar.gz" -T - )
if [ "$(stat -c %s "$OUT/triton_cache.tar.gz")" -gt 15000000 ]; then
  ( cd "$TRITON_CACHE_DIR" && find . -name '*.autotune.json' | tar czf "$OUT/triton_cache.tar.gz" -T - )
fi
touch "$OUT/.done"  # scripts/gpu_poll.sh waits for it
cat "$OUT/summary.txt" | tail -n 120
