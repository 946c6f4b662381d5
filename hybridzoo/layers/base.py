"""The base class of every token mixer: input checks and the recurrent/chunked split."""

from __future__ import annotations

import math

from typing import ClassVar

import torch
from torch import nn

from hybridzoo.layers.state import MixerState, StateError
from hybridzoo.parallel.context import check_mixer


def activation_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the mixer's projections produce from ``x``: the autocast dtype when autocast
    is on for x's device, else ``x.dtype``. Conv tails and K/V stores are kept in it."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def projection_input(x: torch.Tensor) -> torch.Tensor:
    """``x`` cast once the way autocast casts a linear layer's input (to the autocast dtype when
    autocast is on for x's device and x is a float tensor other than float64), else ``x`` itself.

    Several projections of one input then share (and keep for their backward) one cast copy
    instead of making one each; the values are those each projection would have computed."""
    device = x.device.type
    if torch.is_autocast_enabled(device) and x.is_floating_point() and x.dtype != torch.float64:
        return x.to(torch.get_autocast_dtype(device))
    return x


@torch.no_grad()
def init_dt_bias_(bias: torch.Tensor, dt_min: float, dt_max: float, floor: float) -> None:
    """mamba_ssm's / fla's init of a step-size bias ``[n]``: ``softplus(bias)`` log-uniform in
    ``[dt_min, dt_max]``, clamped below at ``floor`` (draws ``n`` numbers from torch's RNG)."""
    dt = torch.exp(torch.rand(bias.shape[0]) * (math.log(dt_max) - math.log(dt_min))
                   + math.log(dt_min)).clamp(min=floor)
    bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # inverse of softplus


class Mixer(nn.Module):
    """A token mixer: ``y, state = mixer(x, state=None)`` with ``x, y: [B, T, d_model]``.

    Subclasses set ``kind`` and implement :meth:`mix` (``x`` already checked) and
    :meth:`expected_state` (the shapes/dtypes of the state fields for a batch). ``forward``
    validates the input and the incoming state so that mistakes give a clear message
    instead of a shape error deep inside a kernel.
    """

    kind: ClassVar[str] = ""
    #: runs with its sequence sharded inside :func:`hybridzoo.parallel.context.context_parallel`
    context_parallel: ClassVar[bool] = False

    def __init__(self, d_model: int):
        super().__init__()
        if d_model <= 0:
            raise ValueError(f"{type(self).__name__}: d_model must be positive, got {d_model}")
        self.d_model = d_model

    def expected_state(self, batch_size: int, dtype: torch.dtype
                       ) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Field name -> (shape, dtype) of a valid state for this mixer and batch."""
        raise NotImplementedError

    def mix(self, x: torch.Tensor, state: MixerState | None, cu_seqlens: torch.Tensor | None = None
            ) -> tuple[torch.Tensor, MixerState]:
        raise NotImplementedError

    def state_batch(self, x: torch.Tensor, cu_seqlens: torch.Tensor | None) -> int:
        """The batch size of a state for this call: ``B``, or the number of documents N with
        ``cu_seqlens`` (a recurrent state is per document; :class:`~hybridzoo.layers.attention.Attention`
        overrides this: its K/V store is that of one document)."""
        return x.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1

    def forward(self, x: torch.Tensor, state: MixerState | None = None, *,
                cu_seqlens: torch.Tensor | None = None) -> tuple[torch.Tensor, MixerState]:
        """``x [B, T, d_model]`` -> ``(y [B, T, d_model], state)``.

        ``cu_seqlens`` (int32 ``[N + 1]``, packed documents; see :mod:`hybridzoo.kernels.varlen`):
        ``x`` is ``[1, total, d_model]`` and no state, conv tail or position crosses a document
        boundary; each document runs as if alone. A recurrent state then holds one row per
        document (``[N, ...]`` in and out); see :func:`document_positions` for the positions."""
        name = type(self).__name__
        if not isinstance(x, torch.Tensor) or x.dim() != 3:
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"{name}: expected x of shape [B, T, d_model={self.d_model}], got {shape}")
        if x.shape[-1] != self.d_model:
            raise ValueError(f"{name}: x has last dimension {x.shape[-1]}, expected d_model={self.d_model}")
        if x.shape[1] == 0:
            raise ValueError(f"{name}: x has no tokens (T=0)")
        if cu_seqlens is not None:
            cu_seqlens = check_documents(name, x, cu_seqlens)
        if state is not None:
            if not isinstance(state, MixerState):
                raise StateError(f"{name}: state must be a MixerState or None, got {type(state).__name__}")
            batch = self.state_batch(x, cu_seqlens)
            state.check(self.kind, batch, x.device, self.expected_state(batch, activation_dtype(x)))
        check_mixer(self, state, cu_seqlens)
        if cu_seqlens is None:
            return self.mix(x, state)
        return self.mix(x, state, cu_seqlens=cu_seqlens)


def check_documents(name: str, x: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """``cu_seqlens`` validated for a packed ``x [1, total, d]`` (int32 on x's device), or a
    ValueError naming ``name`` and the fix."""
    from hybridzoo.kernels.varlen import check_cu_seqlens

    if x.shape[0] != 1:
        raise ValueError(f"{name}: with cu_seqlens the documents are packed into one row, x must be "
                         f"[1, total, d_model], got batch {x.shape[0]}; flatten the batch (HybridLM does "
                         f"this for position_ids)")
    try:
        return check_cu_seqlens(cu_seqlens, x.shape[1], x.device)
    except ValueError as error:
        raise ValueError(f"{name}: {error}") from None


def document_positions(cu_seqlens: torch.Tensor, total: int, offset: int = 0) -> torch.Tensor:
    """The position of each token within its document, int64 ``[total]``: ``0, 1, ...`` from each
    boundary of ``cu_seqlens`` (int32 ``[N + 1]``, validated), the first document's counted from
    ``offset`` (it may continue a document begun in an earlier call: a carried state's offset)."""
    from hybridzoo.kernels.varlen import seq_idx_from_cu_seqlens

    seq_idx = seq_idx_from_cu_seqlens(cu_seqlens, total).long()
    positions = torch.arange(total, device=cu_seqlens.device) - cu_seqlens.long()[seq_idx]
    if offset:
        positions = positions + offset * (seq_idx == 0)
    return positions


def next_offset(cu_seqlens: torch.Tensor | None, length: int, offset: int) -> int:
    """The ``offset`` of a returned state: the position of the next token of the last document
    (``offset + length`` without documents, or when the call holds one document)."""
    if cu_seqlens is None or cu_seqlens.shape[0] == 2:
        return offset + length
    return length - int(cu_seqlens[-2])
