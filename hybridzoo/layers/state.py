"""The state contract shared by every mixer.

``y, state = mixer(x, state=None)``: ``state=None`` starts from zero, and the returned state
continues the sequence exactly. States are small dataclasses of tensors:

* :class:`RecurrentState` for the recurrent mixers (``mamba1``, ``mamba2``, ``gla``, ``retnet``,
  ``gdn``): the float32 recurrent state, the short-conv tail (or None) and the position offset.
* :class:`KVState` for ``attn``: keys and values seen so far (see :mod:`hybridzoo.layers.attention`).

Every state knows its mixer ``kind`` and can :meth:`check` itself against the mixer that
receives it, so a state from another kind, batch size, dtype or device gives a clear error.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import torch


class StateError(ValueError):
    """A state passed to a mixer does not belong to it (kind, batch, dtype, device)."""


@dataclass
class MixerState:
    """Base class: a dataclass whose tensor fields make up the state of one mixer."""

    kind: str

    def tensors(self) -> dict[str, torch.Tensor]:
        """The tensor fields by name (None fields left out)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if isinstance(getattr(self, f.name), torch.Tensor)}

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> "MixerState":
        """A copy with ``fn`` applied to every tensor field (e.g. ``detach``, ``.to(device)``)."""
        return dataclasses.replace(self, **{k: fn(t) for k, t in self.tensors().items()})

    def detach(self) -> "MixerState":
        return self.map(torch.Tensor.detach)

    @property
    def batch_size(self) -> int:
        return next(iter(self.tensors().values())).shape[0]

    def check(self, kind: str, batch_size: int, device: torch.device,
              expected: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> None:
        """Raise :class:`StateError` unless this state fits a ``kind`` mixer on this input.

        ``expected`` maps a field name to its shape and dtype (batch dimension included);
        a dimension given as -1 may have any size (e.g. the length of a K/V store).
        """
        if not isinstance(self, MixerState):
            raise StateError(f"{kind}: state must be a MixerState, got {type(self).__name__}")
        if self.kind != kind:
            raise StateError(f"{kind}: got a state of a {self.kind!r} mixer")
        for name, (shape, dtype) in expected.items():
            tensor = getattr(self, name, None)
            if tensor is None:
                raise StateError(f"{kind}: state field {name!r} is missing")
            if tensor.shape[0] != batch_size:
                raise StateError(f"{kind}: state has batch size {tensor.shape[0]}, input has {batch_size}")
            if len(tensor.shape) != len(shape) or any(
                    want not in (-1, got) for want, got in zip(shape, tensor.shape)):
                raise StateError(f"{kind}: state field {name!r} has shape {tuple(tensor.shape)}, "
                                 f"expected {tuple(shape)}")
            if tensor.dtype != dtype:
                raise StateError(f"{kind}: state field {name!r} has dtype {tensor.dtype}, expected {dtype}")
            if tensor.device.type != device.type or (
                    device.index is not None and tensor.device.index not in (None, device.index)):
                raise StateError(f"{kind}: state field {name!r} is on {tensor.device}, input on {device}")


@dataclass
class RecurrentState(MixerState):
    """State of a recurrent mixer.

    Attributes:
        recurrent: float32 (float64 for float64 models): ``[B, H, K, V]`` for the chunkwise
            mixers, ``[B, D_inner, N]`` for Mamba-1.
        conv: short-conv tail ``[B, W-1, channels]`` in the activation dtype, or None.
        offset: number of tokens already consumed (RetNet's positions follow it).
    """

    recurrent: torch.Tensor | None = None
    conv: torch.Tensor | None = None
    offset: int = 0


def state_dtype(dtype: torch.dtype) -> torch.dtype:
    """Recurrent states are float32, or float64 for float64 inputs."""
    return torch.promote_types(dtype, torch.float32)
