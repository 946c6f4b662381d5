#!/usr/bin/env bash
# One device call on 2 GPUs (nvidia-h200-x2), everything under $OUT (7 files):
#   CPU:   mamba_ssm + causal_conv1d build (scripts/build_mamba.sh)
#   GPU 0: the GPU tests of kernels and SeCO (-v, 100 s per test, durations), then the kernel
#          benchmark rows named in $ROWS (default per-key GLA, delta rule, mamba_ssm anchors)
#   GPU 1: scripts/bench_seco.py, the pure recurrent recipe first, then the hybrid (--resume)
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source scripts/gpu_setup.sh
(MAX_JOBS=10 bash scripts/build_mamba.sh > "$OUT/mamba_build.log" 2>&1) &
BUILD=$!
(
  CUDA_VISIBLE_DEVICES=0 timeout ${TEST_S:-270} python3 -m pytest -v -m gpu -p no:cacheprovider --timeout 100 \
    --durations=0 ${TESTS:-tests} > "$OUT/gpu_tests.log" 2>&1; echo "pytest exit $?" >> "$OUT/gpu_tests.log"
  wait $BUILD 2>/dev/null; while kill -0 $BUILD 2>/dev/null; do sleep 2; done
  CUDA_VISIBLE_DEVICES=0 timeout ${BENCH_S:-270} python3 scripts/bench_kernels.py --only "${ROWS:-per-key,delta,mamba}" \
    --out "$OUT/bench_kernels.json" > "$OUT/bench_kernels.log" 2>&1
) &
GPU0=$!
(
  CUDA_VISIBLE_DEVICES=1 timeout ${SECO_S:-560} bash -c "python3 scripts/bench_seco.py --recipes gated-deltanet-340m \
      --lengths ${SECO_REC_LENGTHS:-16k,32k,128k,256k,512k,1M} --out $OUT/seco.json \
    && python3 scripts/bench_seco.py --recipes qwen35-0.8b --lengths ${SECO_HYB_LENGTHS:-16k,32k,128k,256k,512k} \
      --out $OUT/seco.json --resume" > "$OUT/seco.log" 2>&1
) &
GPU1=$!
wait $GPU0 $GPU1
echo "== mamba build"; tail -2 "$OUT/mamba_build.log"
echo "== tests"; grep -E "PASSED|FAILED|ERROR|SKIPPED|Timeout|exit|passed|failed" "$OUT/gpu_tests.log" | cut -c1-150 | tail -30
echo "== bench"; tail -9 "$OUT/bench_kernels.log" | cut -c1-200
echo "== seco"; grep -E '"status"|Error|error' "$OUT/seco.log" | cut -c1-260 | tail -25
