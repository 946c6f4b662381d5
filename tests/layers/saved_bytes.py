"""What a forward keeps for its backward, measured with saved_tensors_hooks (test helper)."""

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


def storage_bytes(tensors: list[torch.Tensor], exclude: tuple[torch.Tensor, ...] = ()) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a storage viewed twice counts once),
    leaving out the storages of ``exclude`` (e.g. parameters)."""
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    sizes = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(n for ptr, n in sizes.items() if ptr not in skip)


def saved_bytes_per_token(run: Callable[[int], object], length: int, batch: int,
                          exclude: tuple[torch.Tensor, ...] = ()) -> float:
    """Saved bytes per token of ``run(T)`` (a forward on ``batch x T`` tokens): the slope between
    ``length`` and ``2 * length`` tokens, so that what does not grow with the tokens (autocast's
    weight copies, recurrent states of fixed size) drops out."""
    short = storage_bytes(saved_tensors(lambda: run(length)), exclude)
    long = storage_bytes(saved_tensors(lambda: run(2 * length)), exclude)
    return (long - short) / (batch * length)
