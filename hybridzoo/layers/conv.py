"""Depthwise short causal convolution with a carried tail (Mamba, Mamba-2, GLA, Gated DeltaNet)."""

from __future__ import annotations

import math

import torch
from torch import nn

from hybridzoo.kernels import causal_conv1d, causal_conv1d_step
from hybridzoo.parallel.context import sharded


class ShortConv(nn.Module):
    """Depthwise causal conv over time, optional bias, optional SiLU.

    ``weight [channels, kernel_size]`` (mamba_ssm's ``conv1d.weight[:, 0, :]``).
    Shapes: ``x [B, T, channels]``, tail state ``[B, kernel_size - 1, channels]`` in x.dtype.
    T=1 with a state takes the single-step form.
    """

    def __init__(self, channels: int, kernel_size: int = 4, bias: bool = True,
                 activation: str | None = "silu", backend: str = "auto"):
        super().__init__()
        if kernel_size < 1:
            raise ValueError(f"ShortConv: kernel_size must be >= 1, got {kernel_size}")
        self.channels, self.kernel_size, self.activation, self.backend = (
            channels, kernel_size, activation, backend)
        self.weight = nn.Parameter(torch.empty(channels, kernel_size))
        self.bias = nn.Parameter(torch.empty(channels)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # nn.Conv1d's default initialisation (fan_in = kernel_size for a depthwise conv)
        bound = 1.0 / math.sqrt(self.kernel_size)
        nn.init.uniform_(self.weight, -bound, bound)
        if self.bias is not None:
            nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, x: torch.Tensor, tail: torch.Tensor | None = None, *,
                cu_seqlens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns ``(y [B, T, channels], new_tail [B, kernel_size - 1, channels])``; with
        ``cu_seqlens`` (packed ``x [1, total, channels]``) the tails are per document ``[N, ...]``."""
        return short_conv(x, self.weight, self.bias, tail, self.activation, self.backend, cu_seqlens=cu_seqlens)


def short_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               tail: torch.Tensor | None, activation: str | None, backend: str = "auto", *,
               cu_seqlens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:class:`ShortConv` as a function: ``x [B, T, channels]``, ``weight [channels, kernel_size]``,
    ``bias [channels]`` or None, ``tail [B, kernel_size - 1, channels]`` or None ->
    ``(y [B, T, channels], new_tail)``; T=1 with a tail takes the single-step form.
    ``cu_seqlens`` (int32 ``[N + 1]``): packed documents in ``x [1, total, channels]``, no tail
    crosses a boundary; ``tail`` and ``new_tail`` are then per document, ``[N, kernel_size - 1, channels]``."""
    if cu_seqlens is not None:
        return sharded(causal_conv1d)(x, weight, bias, initial_state=tail, output_final_state=True,
                                      activation=activation, backend=backend, cu_seqlens=cu_seqlens)
    if x.shape[1] == 1 and tail is not None:
        y, new_tail = causal_conv1d_step(x[:, 0], weight, bias, tail, activation=activation)
        return y[:, None], new_tail
    return sharded(causal_conv1d)(x, weight, bias, initial_state=tail, output_final_state=True,
                                  activation=activation, backend=backend)
