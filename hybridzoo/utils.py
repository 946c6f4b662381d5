"""Small helpers shared by tests, benchmarks and the demo."""

from __future__ import annotations

import torch


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``‖out − ref‖ / ‖ref‖`` in float64; ``inf`` if either holds a NaN or an inf.

    A reference of norm 0 gives the absolute error ``‖out‖`` instead.
    """
    out = out.detach().to(torch.float64)
    ref = ref.detach().to(device=out.device, dtype=torch.float64)
    if out.shape != ref.shape:
        raise ValueError(f"rel_err: shapes differ, {tuple(out.shape)} vs {tuple(ref.shape)}")
    if not (torch.isfinite(out).all() and torch.isfinite(ref).all()):
        return float("inf")
    denom = ref.norm()
    num = (out - ref).norm()
    return float(num / denom) if denom > 0 else float(num)
