#!/usr/bin/env bash
# One device call on 2 GPUs (nvidia-h200-x2): the GPU tests of every kernel on GPU 0, while
# mamba_ssm builds (CPU) and the fla-anchored benchmark rows run on GPU 1; then the mamba_ssm /
# causal_conv1d rows on GPU 1. Results and logs under $OUT (6 files).
#   bash scripts/gpu_kernels_session.sh
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source scripts/gpu_setup.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
(MAX_JOBS=12 bash scripts/build_mamba.sh > "$OUT/mamba_build.log" 2>&1) &
BUILD=$!
(CUDA_VISIBLE_DEVICES=0 timeout ${TEST_S:-480} python3 -m pytest -q -m gpu -p no:cacheprovider tests \
  > "$OUT/gpu_tests.log" 2>&1; echo "pytest exit $?" >> "$OUT/gpu_tests.log") &
TESTS=$!
CUDA_VISIBLE_DEVICES=1 timeout ${FLA_S:-300} python3 scripts/bench_kernels.py --only fla --out "$OUT/bench_fla.json" > "$OUT/bench_fla.log" 2>&1
wait $BUILD; tail -3 "$OUT/mamba_build.log"
CUDA_VISIBLE_DEVICES=1 timeout ${MAMBA_S:-150} python3 scripts/bench_kernels.py --only mamba --out "$OUT/bench_mamba.json" > "$OUT/bench_mamba.log" 2>&1
wait $TESTS
echo "== tests"; grep -E "passed|failed|error|FAILED|ERROR|exit" "$OUT/gpu_tests.log" | tail -25
echo "== bench"; tail -12 "$OUT/bench_fla.log"; tail -6 "$OUT/bench_mamba.log"
