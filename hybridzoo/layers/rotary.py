"""Rotary position embeddings (rotate-half convention of Llama / Qwen), with position offsets."""

from __future__ import annotations

import torch
from torch import nn

from hybridzoo.kernels import fused


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


# cos / sin tables of the last few (positions, device, dtype) asked for: see Rotary._tables
_TABLES: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
_TABLES_KEPT = 16
_TABLE_MAX = 1 << 22  # positions x rotary_dim of the longest kept (16 MiB of float32 tables)


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

    def _tables(self, offset: int, length: int, x: torch.Tensor, fused_pass: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of positions ``offset .. offset + length - 1``: ``[T, rotary_dim / 2]`` for the
        fused pass, ``[T, rotary_dim]`` for the plain body (float32, float64 kept). Computed once
        per (positions, device, dtype) and shared by every Rotary of the same ``rotary_dim`` and
        base: q and k, and all layers of a model, rotate by the same angles in one step (before:
        five ops and two tensors per call, twice per layer). A table made under inference mode
        is kept apart (autograd cannot save it for a backward), and tables over ``_TABLE_MAX``
        are not kept (a million-token sequence's would hold 256 MiB between steps)."""
        key = (self.rotary_dim, self.base, str(x.device), offset, length, torch.promote_types(x.dtype, torch.float32),
               fused_pass, torch.is_inference_mode_enabled())
        tables = _TABLES.pop(key, None)
        if tables is None:
            positions = torch.arange(offset, offset + length, device=x.device)
            if fused_pass:
                freqs = self.angles(positions, x.dtype)
                tables = freqs.cos(), freqs.sin()
            else:
                tables = self.cos_sin(positions, x.dtype)
            if length * self.rotary_dim > _TABLE_MAX:  # a long sequence's tables are not kept
                return tables
            while len(_TABLES) >= _TABLES_KEPT:
                _TABLES.pop(next(iter(_TABLES)))
        _TABLES[key] = tables  # most recently used last
        return tables

    def forward(self, x: torch.Tensor, offset: int = 0) -> torch.Tensor:
        if fused.applies(x) and x.dim() == 4:  # one Triton pass each way (float32 on chip)
            return _RotaryFunction.apply(x, *self._tables(offset, x.shape[1], x, True))
        cos, sin = self._tables(offset, x.shape[1], x, False)
        cos, sin = cos[None, :, None, :], sin[None, :, None, :]
        rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim:]
        rot_f = rot.to(cos.dtype)
        rot = (rot_f * cos + rotate_half(rot_f) * sin).to(x.dtype)
        return torch.cat((rot, rest), dim=-1) if rest.shape[-1] else rot
