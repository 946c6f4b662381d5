"""Head bookkeeping shared by the chunkwise kernels' launchers."""

from __future__ import annotations

import torch


def sum_head_groups(x: torch.Tensor, hk: int, dtype: torch.dtype) -> torch.Tensor:
    """``x [B, T, H, D]`` (a gradient per value head) -> ``[B, T, hk, D]`` in ``dtype``: the sum
    over the ``H // hk`` value heads that share each q/k head. With ``H == hk`` only the cast
    runs (a sum over a size-1 axis would still launch a reduction: 0.45 ms of a 4 ms backward at
    B2 T16384 H16 D128 on an H200, scripts/profile_kernels.py)."""
    B, T, H, D = x.shape
    if H == hk:
        return x.to(dtype)
    return x.view(B, T, hk, H // hk, D).sum(3).to(dtype)
