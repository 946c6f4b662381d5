#!/usr/bin/env bash
# Set up the anchors on a bare GPU machine that cannot download (the device machine):
#   - fla (pure Python wheels) and einops from .whl/ (made here with `pip download --no-deps`);
#   - mamba_ssm and causal_conv1d built from their source archives in .whl/ for sm_90 only
#     (`BUILD_MAMBA=1`, about 3-4 minutes), or mamba_ssm's Triton parts only (default).
# Usage: source scripts/gpu_setup.sh   (exports PYTHONPATH=/tmp/site and this repo)
set -u
SITE=/tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" .whl/*.whl || return 1 2>/dev/null || exit 1
export PYTHONPATH="$SITE:$PWD"
if [ "${BUILD_MAMBA:-0}" = "1" ]; then
  mkdir -p /tmp/src && for f in .whl/*.tar.gz; do tar xzf "$f" -C /tmp/src; done
  for d in /tmp/src/mamba_ssm-* /tmp/src/causal_conv1d-*; do
    python3 - "$d/setup.py" <<'PY'
import re, sys
path = sys.argv[1]
text = open(path).read()
text = re.sub(r'cc_flag\.append\("-gencode"\)\n\s*cc_flag\.append\("arch=compute_(?!90\b)\d+a?,code=sm_\d+a?"\)\n', "", text)
open(path, "w").write(text)
PY
  done
  export MAX_JOBS=16 TORCH_CUDA_ARCH_LIST=9.0
  (cd /tmp/src/causal_conv1d-* && CAUSAL_CONV1D_FORCE_BUILD=TRUE python3 -m pip install -q --no-deps --no-build-isolation --target "$SITE" . ) \
    && (cd /tmp/src/mamba_ssm-* && MAMBA_FORCE_BUILD=TRUE python3 -m pip install -q --no-deps --no-build-isolation --target "$SITE" . ) \
    || echo "mamba_ssm / causal_conv1d build failed"
fi
