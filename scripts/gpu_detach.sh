#!/usr/bin/env bash
# Run scripts/gpu_jobs.sh past one device call's 10-minute limit: start it detached (its own
# process session, which the device keeps running until the machine goes back) from a private
# copy of the tree, then wait like scripts/gpu_poll.sh. Follow with `bash scripts/gpu_poll.sh <s>`
# calls, each within the machine's 30-second idle release, until the run has ended.
#
#   DEADLINE_S=1440 bash scripts/gpu_detach.sh <wait_s> "<jobs of GPU 0>" ["<jobs of GPU 1>" ...]
#
# Keep <wait_s> at most ~500 for a 600 s call: copying the tree (with .whl/ and .gpu_in/) and the
# snapshot come on top (session 8: <wait_s> 560 ran into the call's 600 s limit; the snapshot still
# came back, and the next poll found the run going).
#
# Each call's $OUT gets a snapshot of the results so far (results.tar.gz, summary.txt): a lost
# machine loses only what came after the last call. The run's own final files (with the Triton
# cache and the mamba_ssm build) come back with the first poll after it ends.
set -u
wait_s=$1; shift
rm -rf /tmp/hz_run /tmp/detached_out && cp -r . /tmp/hz_run && mkdir -p /tmp/detached_out
( cd /tmp/hz_run && OUT=/tmp/detached_out setsid nohup bash scripts/gpu_jobs.sh "$@" \
    > /tmp/detached.log 2>&1 < /dev/null & )
sleep 5
exec bash scripts/gpu_poll.sh "$wait_s"
