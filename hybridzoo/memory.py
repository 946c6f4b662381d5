"""What a forward pass keeps for its backward: every tensor autograd saves, with its owner.

:func:`saved_tensors` runs a function under :class:`torch.autograd.graph.saved_tensors_hooks`,
then walks the autograd graph of its outputs and asks every node for its saved tensors (which
calls the unpack hook, so each packed tensor is matched to the node that saved it: a built-in
backward such as ``MulBackward0`` or a custom ``torch.autograd.Function``). Tensors are grouped
by their storage: views of one buffer are counted once, at the size of the whole buffer (a saved
view keeps all of it alive). Storages of the given parameters are reported apart.

Tensors a custom Function keeps as ``ctx`` attributes instead of ``save_for_backward`` are not
seen; none of hybridzoo's Functions on the training path do so.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch

__all__ = ["SavedStorage", "saved_tensors"]


@dataclass
class SavedStorage:
    """One storage kept for the backward.

    Attributes:
        nbytes: bytes of the whole storage.
        shape, dtype: of the first saved tensor that views it.
        owners: names of the autograd nodes that saved it (``"MulBackward0"``, a Function's name).
        parameter: the storage is a parameter's (not an activation).
    """

    nbytes: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    owners: list[str] = field(default_factory=list)
    parameter: bool = False


def _graph_nodes(roots: Iterable) -> list:
    seen, order, stack = set(), [], [r for r in roots if r is not None]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        order.append(node)
        stack.extend(nxt for nxt, _ in node.next_functions if nxt is not None)
    return order


def _touch_saved(node) -> None:
    """Ask ``node`` for every tensor it saved (each access runs the unpack hook)."""
    if hasattr(node, "saved_tensors"):  # a custom autograd.Function
        try:
            node.saved_tensors
        except RuntimeError:  # already freed
            pass
        return
    for name in dir(node):
        if name.startswith("_saved_"):
            try:
                getattr(node, name)
            except RuntimeError:
                pass


def saved_tensors(fn: Callable[[], object], parameters: Iterable[torch.Tensor] = ()
                  ) -> list[SavedStorage]:
    """Run ``fn()`` and list the storages its autograd graph keeps for the backward.

    Args:
        fn: a no-argument callable; its result may be a tensor or a (nested) tuple/list/dict of
            them. Grad mode must be on and something must require grad.
        parameters: tensors whose storages are marked ``parameter=True`` (a module's parameters).

    Returns:
        One :class:`SavedStorage` per distinct storage, largest first.
    """
    packed: list[torch.Tensor] = []
    owners: dict[int, list[str]] = {}
    current: list[str] = [""]

    def pack(tensor):
        packed.append(tensor)
        return len(packed) - 1

    def unpack(index):
        owners.setdefault(index, [])
        if current[0] not in owners[index]:
            owners[index].append(current[0])
        return packed[index]

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        result = fn()
    outputs = []

    def collect(obj):
        if isinstance(obj, torch.Tensor):
            outputs.append(obj)
        elif isinstance(obj, (tuple, list)):
            for item in obj:
                collect(item)
        elif isinstance(obj, dict):
            for item in obj.values():
                collect(item)
        elif hasattr(obj, "__dict__"):  # a state dataclass
            for item in vars(obj).values():
                collect(item)

    collect(result)
    for node in _graph_nodes(t.grad_fn for t in outputs):
        current[0] = node.name()
        _touch_saved(node)

    param_storages = {p.untyped_storage().data_ptr() for p in parameters}
    by_storage: dict[int, SavedStorage] = {}
    for index, tensor in enumerate(packed):
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        entry = by_storage.get(key)
        if entry is None:
            entry = by_storage[key] = SavedStorage(storage.nbytes(), tuple(tensor.shape), tensor.dtype,
                                                   parameter=key in param_storages)
        for owner in owners.get(index, ["(not reached from the outputs)"]):
            if owner not in entry.owners:
                entry.owners.append(owner)
    return sorted(by_storage.values(), key=lambda s: -s.nbytes)


def saved_bytes_per_token(run: Callable[[int], object], length: int, batch: int,
                          parameters: Iterable[torch.Tensor] = ()) -> float:
    """Bytes kept for the backward per token by ``run(T)`` (a forward on ``batch x T`` tokens),
    leaving out the storages of ``parameters``: the slope between ``length`` and ``2 * length``
    tokens, so that what does not grow with the tokens (autocast's weight copies, recurrent states
    of fixed size) drops out."""
    parameters = list(parameters)

    def total(tokens: int) -> int:
        return sum(r.nbytes for r in saved_tensors(lambda: run(tokens), parameters) if not r.parameter)

    return (total(2 * length) - total(length)) / (batch * length)
