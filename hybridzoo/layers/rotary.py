"""Rotary position embeddings (rotate-half convention of Llama / Qwen), with position offsets."""

from __future__ import annotations

import torch
from torch import nn

from hybridzoo.kernels import fused


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class _RotaryFunction(torch.autograd.Function):
    """The rotation of :meth:`Rotary.forward` as one fused Triton pass
    (:mod:`hybridzoo.kernels.triton.rotary`); its backward is the rotation by the opposite angles.
    ``x [B, T, H, D]``, ``cos, sin [T, rotary_dim / 2]`` float32 -> ``[B, T, H, D]`` in x.dtype."""

    @staticmethod
    def forward(ctx, x, cos, sin):
        from hybridzoo.kernels.triton.rotary import rotary_fwd

        ctx.save_for_backward(cos, sin)
        return rotary_fwd(x, cos, sin)

    @staticmethod
    def backward(ctx, grad):
        from hybridzoo.kernels.triton.rotary import rotary_fwd

        cos, sin = ctx.saved_tensors
        return rotary_fwd(grad, cos, sin, inverse=True), None, None


class Rotary(nn.Module):
    """Rotary embedding on the first ``rotary_dim`` channels of each head (partial rotary).

    ``inv_freq[i] = base ** (-2i / rotary_dim)``. Positions start at ``offset`` (the number of
    tokens already in the state), so a sequence fed in pieces gets the same angles as in one call.

    Shapes: ``x [B, T, H, head_dim]`` -> same shape and dtype. On a GPU the rotation is one
    Triton pass each way (:mod:`hybridzoo.kernels.triton.rotary`; see
    :mod:`hybridzoo.kernels.fused`); the plain body is the spec.
    """

    def __init__(self, head_dim: int, rotary_dim: int | None = None, base: float = 10000.0):
        super().__init__()
        rotary_dim = head_dim if rotary_dim is None else rotary_dim
        if rotary_dim % 2 or rotary_dim > head_dim:
            raise ValueError(f"Rotary: rotary_dim must be even and <= head_dim, got {rotary_dim}")
        self.head_dim, self.rotary_dim, self.base = head_dim, rotary_dim, base
        self._inv_freq: dict[str, torch.Tensor] = {}  # per device; see inv_freq

    def inv_freq(self, device: torch.device | str | None = None) -> torch.Tensor:
        """``base ** (-2i / rotary_dim)`` ``[rotary_dim / 2]`` float32 on ``device`` (default CPU).

        Computed in float64 on the CPU and kept per device in a plain dict, never a buffer, so
        ``model.to(bfloat16)`` cannot round the frequencies (their error would grow with the
        position). Kept, not recomputed: a CPU -> GPU copy per call is a stream synchronisation
        in PyTorch, and SeCO calls every attention layer twice per chunk."""
        key = str(torch.device("cpu" if device is None else device))
        freq = self._inv_freq.get(key)
        if freq is None:
            exponent = torch.arange(0, self.rotary_dim, 2, dtype=torch.float64) / self.rotary_dim
            freq = self._inv_freq[key] = (self.base ** -exponent).float().to(key)
        return freq

    def angles(self, positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``positions [T]`` (int) -> ``positions * inv_freq`` ``[T, rotary_dim / 2]`` in float32
        (float64 kept)."""
        compute = torch.promote_types(dtype, torch.float32)
        return positions.to(compute)[:, None] * self.inv_freq(positions.device).to(compute)[None, :]

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions [T]`` (int) -> cos, sin ``[T, rotary_dim]`` in float32 (float64 kept)."""
        freqs = self.angles(positions, dtype)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()

    def forward(self, x: torch.Tensor, offset: int = 0, positions: torch.Tensor | None = None) -> torch.Tensor:
        return self.pair(x, offset=offset, positions=positions)[0]

    def pair(self, *xs: torch.Tensor, offset: int = 0, positions: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, ...]:
        """Rotate each of ``xs`` (e.g. q and k, ``[B, T, H_i, head_dim]``, one T and dtype) at
        positions ``offset ..``, or at ``positions`` (int ``[T]``, e.g. restarting at 0 at each
        packed document: :func:`hybridzoo.layers.base.document_positions`), with the cos / sin
        tables computed once for all of them."""
        x = xs[0]
        if any(t.shape[1] != x.shape[1] or t.dtype != x.dtype or t.device != x.device for t in xs):
            raise ValueError("Rotary.pair: the tensors must share T, dtype and device, got "
                             f"{[(tuple(t.shape), t.dtype, str(t.device)) for t in xs]}")
        if positions is None:
            positions = torch.arange(offset, offset + x.shape[1], device=x.device)
        elif positions.shape != (x.shape[1],):
            raise ValueError(f"Rotary.pair: positions must be [T = {x.shape[1]}], got {tuple(positions.shape)}")
        if fused.applies(*xs) and all(t.dim() == 4 for t in xs):  # one Triton pass each way (float32 on chip)
            freqs = self.angles(positions, x.dtype)
            cos, sin = freqs.cos(), freqs.sin()
            return tuple(_RotaryFunction.apply(t, cos, sin) for t in xs)
        cos, sin = self.cos_sin(positions, x.dtype)
        cos, sin = cos[None, :, None, :], sin[None, :, None, :]
        return tuple(self._rotate(t, cos, sin) for t in xs)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The plain body: ``x [..., T, H, head_dim]`` with ``cos, sin [1, T, 1, rotary_dim]``."""
        rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim:]
        rot_f = rot.to(cos.dtype)
        rot = (rot_f * cos + rotate_half(rot_f) * sin).to(x.dtype)
        return torch.cat((rot, rest), dim=-1) if rest.shape[-1] else rot
