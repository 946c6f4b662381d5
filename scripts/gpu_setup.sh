#!/usr/bin/env bash
# Set up the anchors on a bare GPU machine that cannot download (the device machine):
#   - fla (pure Python wheels) and einops from .whl/ (made here with `pip download --no-deps`);
#   - with BUILD_MAMBA=1, mamba_ssm and causal_conv1d built from their source archives in .whl/
#     (scripts/build_mamba.sh: sm_90 only, about 3-4 minutes; Triton parts only if that fails).
# Usage: source scripts/gpu_setup.sh   (exports PYTHONPATH=/tmp/site and this repo)
set -u
SITE=/tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" .whl/*.whl || return 1 2>/dev/null || exit 1
export PYTHONPATH="$SITE:$PWD"
if [ "${BUILD_MAMBA:-0}" = "1" ]; then
  bash scripts/build_mamba.sh || echo "mamba_ssm / causal_conv1d build failed"
fi
