#!/usr/bin/env bash
# Build mamba_ssm and causal_conv1d from their source archives in .whl/ for sm_90 only (about
# 3-4 minutes on 16 cores) into /tmp/site, on a device machine that cannot download. If the CUDA
# build fails, install mamba_ssm's Triton parts only (MAMBA_SKIP_CUDA_BUILD) with a stub for the
# missing selective_scan_cuda module, so that mamba_chunk_scan_combined still imports.
# Usage: bash scripts/build_mamba.sh   (after `source scripts/gpu_setup.sh`)
# A build brought back by an earlier call (scripts/gpu_jobs.sh returns $OUT/mamba_built.tar.gz;
# put it in .gpu_in/, carried) is unpacked instead: the build took 9 minutes on a busy host.
set -u
SITE=/tmp/site
mkdir -p "$SITE"
if [ -f .gpu_in/mamba_built.tar.gz ] && tar xzf .gpu_in/mamba_built.tar.gz -C "$SITE"; then
  echo "mamba_ssm + causal_conv1d restored from .gpu_in/mamba_built.tar.gz"
  exit 0
fi
mkdir -p /tmp/src && for f in .whl/*.tar.gz; do tar xzf "$f" -C /tmp/src; done
for d in /tmp/src/mamba_ssm-* /tmp/src/causal_conv1d-*; do
  python3 - "$d/setup.py" <<'PY'
import re, sys
path = sys.argv[1]
lines, out, i = open(path).read().split("\n"), [], 0
while i < len(lines):  # drop every -gencode pair but sm_90's, leaving `pass` so no block is emptied
    pair = i + 1 < len(lines) and lines[i].strip() == 'cc_flag.append("-gencode")'
    if pair and re.search(r'arch=compute_(?!90\b)\d+a?,code=sm_', lines[i + 1]):
        out.append(lines[i][: len(lines[i]) - len(lines[i].lstrip())] + "pass")
        i += 2
        continue
    out.append(lines[i])
    i += 1
open(path, "w").write("\n".join(out))
PY
done
export MAX_JOBS=${MAX_JOBS:-16} TORCH_CUDA_ARCH_LIST=9.0
if (cd /tmp/src/causal_conv1d-* && CAUSAL_CONV1D_FORCE_BUILD=TRUE python3 -m pip install -q --no-deps --no-build-isolation --target "$SITE" .) \
   && (cd /tmp/src/mamba_ssm-* && MAMBA_FORCE_BUILD=TRUE python3 -m pip install -q --no-deps --no-build-isolation --target "$SITE" .); then
  echo "mamba_ssm + causal_conv1d built for sm_90"
  (cd "$SITE" && tar czf /tmp/mamba_built.tar.gz mamba_ssm mamba_ssm-*.dist-info causal_conv1d \
     causal_conv1d-*.dist-info ./*.so) && echo "packed for the next call: /tmp/mamba_built.tar.gz"
else
  echo "CUDA build failed: installing mamba_ssm's Triton parts only"
  (cd /tmp/src/mamba_ssm-* && MAMBA_SKIP_CUDA_BUILD=TRUE python3 -m pip install -q --no-deps --no-build-isolation --target "$SITE" .)
  [ -e "$SITE/selective_scan_cuda.py" ] || [ -n "$(ls $SITE/selective_scan_cuda*.so 2>/dev/null)" ] \
    || echo 'raise ImportError("selective_scan_cuda was not built (stub from scripts/build_mamba.sh)")' > "$SITE/selective_scan_cuda.py"
fi
