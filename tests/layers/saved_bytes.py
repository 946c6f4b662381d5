"""The tensors a forward keeps for its backward, values included (test helper; byte counts per
token come from :func:`hybridzoo.memory.saved_bytes_per_token`)."""

from __future__ import annotations

from typing import Callable

import torch


def saved_tensors(fn: Callable[[], object]) -> list[torch.Tensor]:
    """Run ``fn()`` and return every tensor autograd saved for the backward (its result is kept
    alive until the list is dropped, so nothing saved is freed early)."""
    kept: list[torch.Tensor] = []

    def pack(tensor):
        kept.append(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        result = fn()
    kept.append(result)  # keeps the graph (and so its saved tensors) alive for the caller
    return kept[:-1]
