"""Launch-side helpers shared by every Triton op: interpreter detection, loop bounds, dot
precision, launch width, output buffers and head-group sums.

Modules call these through the module (``launch.empty(...)``), so a test or a probe that sets
``launch.POISON_OUTPUTS`` or replaces ``launch.warps`` reaches every op at once.
"""

from __future__ import annotations

import os

import torch

POISON_OUTPUTS = False  # tests set this: every buffer starts as NaN, so an unwritten element shows

# Warps of a chunk-kernel launch whose tiles are 64 wide on every head dimension: with Triton's
# default of 4, ptxas spills up to 3.4 KB per thread in the linear-attention backward at
# K = V = 128 in bf16; with 8 none spills more than 260 B (``scripts/kernel_resources.py``).
# Narrower tiles keep 4: a Mamba-2 MQAR model (K = 64, V = 32: [64, 64] x [64, 32] dots) hit an
# illegal memory access on an H200 with 8 warps (Triton 3.6; ``scripts/probe_warps.py``), and 4
# is the setting every such shape was verified with.
WARPS = 8


def interpret() -> bool:
    """Whether kernels run in Triton's CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def loop_count(n: int) -> int:
    """A sequential loop's trip count as a constexpr under the interpreter (which cannot loop
    over a runtime int with numpy 2), 0 (= use the runtime argument) when compiled."""
    return n if interpret() else 0


def dot_precision(dtype: torch.dtype) -> str:
    """``input_precision`` of the dots: 3xTF32 for float32 inputs (float32 accuracy on tensor
    cores; one TF32 pass misses the 1e-4 bar, exact "ieee" dots spill 16-37 KB per thread),
    tensor cores on the 16-bit operands otherwise."""
    return "tf32x3" if dtype == torch.float32 else "tf32"


def warps(*tiles: int) -> int:
    """num_warps of a launch from its tile widths (a setting only: the results are the same)."""
    return WARPS if min(tiles) >= 64 else 4


def empty(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """A buffer the kernels fully write: uninitialised, or NaN-filled when POISON_OUTPUTS is set."""
    if POISON_OUTPUTS:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def sum_head_groups(x: torch.Tensor, hk: int, dtype: torch.dtype) -> torch.Tensor:
    """``x [B, T, H, D]`` (a gradient per value head) -> ``[B, T, hk, D]`` in ``dtype``: the sum
    over the ``H // hk`` value heads that share each q/k head. With ``H == hk`` only the cast
    runs (a sum over a size-1 axis would still launch a reduction: 0.45 ms of a 4 ms backward at
    B2 T16384 H16 D128 on an H200, scripts/profile_kernels.py)."""
    B, T, H, D = x.shape
    if H == hk:
        return x.to(dtype)
    return x.view(B, T, hk, H // hk, D).sum(3).to(dtype)
