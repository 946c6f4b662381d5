#!/usr/bin/env bash
# Wait up to <wait_s> seconds for a run started by scripts/gpu_detach.sh, then put a snapshot of
# its results in $OUT: the final files if it has ended (gpu_jobs.sh wrote .done), else
# results.tar.gz of /tmp/res so far plus summary.txt with each log's tail.
#   bash scripts/gpu_poll.sh <wait_s>
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
end=$(( $(date +%s) + $1 ))
while [ "$(date +%s)" -lt "$end" ] && [ ! -f /tmp/detached_out/.done ]; do sleep 5; done
if [ -f /tmp/detached_out/.done ]; then
  cp /tmp/detached_out/* "$OUT/"
  echo "RUN ENDED"; tail -n 100 "$OUT/summary.txt"
else
  { cat /tmp/res/timeline.txt /tmp/res/skipped.txt 2>/dev/null
    for f in /tmp/res/*.log /tmp/res/*/*.log; do [ -f "$f" ] && { echo "== $f"; tail -n 8 "$f" | cut -c1-200; }; done
  } > "$OUT/summary.txt"
  rm -rf /tmp/res_snap && cp -r /tmp/res /tmp/res_snap && tar czf "$OUT/results.tar.gz" -C /tmp/res_snap .
  echo "STILL RUNNING (snapshot)"; tail -n 60 "$OUT/summary.txt"; tail -n 5 /tmp/detached.log
fi
