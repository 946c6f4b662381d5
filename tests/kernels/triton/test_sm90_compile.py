"""Every Triton kernel of chunk_linear_attn, chunk_delta_rule and the SeCO prefix backward compiles
for sm_90 (H100/H200), bf16 and fp32, at the largest head sizes the ops take, within the 227 KB
shared-memory limit.

No GPU needed: ``scripts/kernel_resources.py --all`` compiles each kernel for
``GPUTarget("cuda", 90, 32)`` and assembles it with the ptxas that ships with Triton. (A K = 128
delta-rule kernel once overflowed shared memory and was only caught on the device.) Runs in a
subprocess because this test session sets TRITON_INTERPRET=1, under which kernels are not compiled.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import triton

ROOT = Path(__file__).resolve().parents[3]
PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"


@pytest.mark.slow
@pytest.mark.skipif(not PTXAS.exists(), reason="this Triton wheel ships no ptxas")
def test_every_kernel_compiles_for_sm90_within_shared_memory():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(Path(os.environ.get("TMPDIR", "/tmp")) / "hybridzoo-sm90-triton-cache")
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "kernel_resources.py"), "--all"],
                            capture_output=True, text=True, env=env, timeout=900)
    lines = [line for line in result.stdout.splitlines() if " shared " in line]
    assert len(lines) == 36, result.stdout + result.stderr  # 18 kernels x (bf16, fp32)
    assert result.returncode == 0, "\n".join(line for line in lines if "error" in line or "OVER" in line)
