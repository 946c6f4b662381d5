#!/usr/bin/env bash
# One device call on 2 GPUs (nvidia-h200-x2), under $OUT (8 files):
#   GPU 0: profile of one gated-deltanet-340m step while mamba_ssm builds, then the kernel
#          benchmark rows: mamba_ssm / causal_conv1d anchors, then the fla ones ($FLA_ROWS)
#   GPU 1: the SeCO GPU tests (faulthandler dump after 45 s), then bench_seco on the hybrid
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source scripts/gpu_setup.sh
(MAX_JOBS=12 bash scripts/build_mamba.sh > /tmp/mamba_build.log 2>&1) &
BUILD=$!
(
  export CUDA_VISIBLE_DEVICES=0
  timeout 100 python3 scripts/profile_step.py gated-deltanet-340m --tokens 8192 --out "$OUT/profile.txt" > /tmp/profile.log 2>&1
  while kill -0 $BUILD 2>/dev/null; do sleep 2; done
  timeout ${MAMBA_S:-100} python3 scripts/bench_kernels.py --only mamba --out "$OUT/bench_mamba.json" > "$OUT/bench.log" 2>&1
  timeout ${FLA_S:-200} python3 scripts/bench_kernels.py --only "${FLA_ROWS:-delta,per-key}" --out "$OUT/bench_fla.json" >> "$OUT/bench.log" 2>&1
) &
GPU0=$!
(
  export CUDA_VISIBLE_DEVICES=1
  timeout 150 python3 -m pytest -v -m gpu -p no:cacheprovider -o faulthandler_timeout=45 --timeout 140 \
    tests/training/test_seco.py > "$OUT/seco_tests.log" 2>&1
  timeout ${SECO_S:-220} python3 scripts/bench_seco.py --recipes qwen35-0.8b --lengths ${SECO_LENGTHS:-16k,32k,64k} \
    --out "$OUT/seco_hybrid.json" > "$OUT/seco_hybrid.log" 2>&1
) &
GPU1=$!
wait $GPU0 $GPU1
echo "== mamba build"; tail -2 /tmp/mamba_build.log
echo "== profile"; head -3 /tmp/profile.log; tail -3 /tmp/profile.log | cut -c1-200
echo "== bench"; grep -E "^\{|Error" "$OUT/bench.log" | cut -c1-330
echo "== seco tests"; grep -E "PASSED|FAILED|Timeout|passed|failed|File " "$OUT/seco_tests.log" | cut -c1-160 | head -30
echo "== seco hybrid"; grep -E '"status"|Error|error' "$OUT/seco_hybrid.log" | cut -c1-330
