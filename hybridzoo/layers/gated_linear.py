"""The body that GLA and RetNet share: fla-style linear attention with a decay.

Both follow flash-linear-attention's layer layout (fla 0.6.0). With ``H`` query heads,
``Hkv = num_kv_heads`` key/value heads (``G = H / Hkv``; query head ``h`` uses key/value head
``h // G``), ``K = key_dim / H`` and ``V = value_dim / H``::

    q, k, v = q_proj(x), k_proj(x), v_proj(x)        # then silu(short conv) each, if use_short_conv
    q, k    = positions(q, k, offset)                # hook: RetNet's rotary; GLA leaves them as they are
    log_a   = decays(x)                              # hook: [B, T, H] (RetNet) or [B, T, H, K] (GLA)
    S_t     = diag(exp(log_a_t)) S_{t-1} + k_t v_tᵀ  # per head, S: [K, V]
    o_t     = K**-0.5 · S_tᵀ q_t
    y       = o_proj(rmsnorm(o) * w * silu(g_proj(x)))   # RMSNorm per head over V channels

A subclass sets ``kind``, implements :meth:`LinearAttentionMixer.decays` and, if needed,
:meth:`~LinearAttentionMixer.positions` and :meth:`~LinearAttentionMixer.build_decay`. The
recurrence is :func:`hybridzoo.kernels.chunk_linear_attn`; a single token with a state takes
:func:`hybridzoo.kernels.linear_attn_step`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from hybridzoo.kernels import chunk_linear_attn, linear_attn_step
from hybridzoo.layers.base import Mixer, document_positions, next_offset, projection_input
from hybridzoo.layers.conv import ShortConv
from hybridzoo.layers.norms import GatedRMSNorm, RMSNorm
from hybridzoo.layers.state import RecurrentState, state_dtype
from hybridzoo.parallel.context import sequence_start, sharded


@dataclass
class LinearAttentionConfig:
    """Settings shared by :class:`~hybridzoo.layers.gla.GLAConfig` and
    :class:`~hybridzoo.layers.retnet.RetNetConfig`, which add their own fields and set
    ``expand_k``, ``expand_v`` and ``num_heads`` to the defaults of fla's layers.

    Attributes:
        expand_k: ``key_dim = expand_k * d_model`` (all query heads together).
        expand_v: ``value_dim = expand_v * d_model``.
        num_heads: H, query heads; ``K = key_dim / H``, ``V = value_dim / H``.
        num_kv_heads: key/value heads, a divisor of H; None = H.
        use_short_conv: a depthwise causal conv + SiLU on each of q, k, v.
        conv_size: kernel width of the short convs.
        conv_bias: bias in the short convs.
        use_output_gate: ``y = rmsnorm(o) * silu(g_proj(x))``; False: ``y = rmsnorm(o)``.
        norm_eps: epsilon of the per-head RMSNorm (fla's layer default 1e-5).
        chunk_size: tokens per chunk of the chunkwise kernel.
        initializer_range: std of the normal init of projection and conv weights (fla's model
            init; biases start at 0).
    """

    expand_k: float
    expand_v: float
    num_heads: int
    num_kv_heads: int | None = None
    use_short_conv: bool = False
    conv_size: int = 4
    conv_bias: bool = False
    use_output_gate: bool = True
    norm_eps: float = 1e-5
    chunk_size: int = 64
    initializer_range: float = 0.02


class LinearAttentionMixer(Mixer):
    """Linear attention with a decay: ``y, state = mixer(x, state=None)``, ``x, y: [B, T, d_model]``.

    Parameters (names and shapes as fla's layers): ``q_proj`` (d_model -> key_dim), ``k_proj``
    (d_model -> key_dim / G), ``v_proj`` (d_model -> value_dim / G), ``g_proj`` (d_model ->
    value_dim, if use_output_gate), ``q_conv1d`` / ``k_conv1d`` / ``v_conv1d``
    (:class:`ShortConv`, if use_short_conv), then those of the decay (:meth:`build_decay`),
    ``o_proj`` (value_dim -> d_model), ``g_norm_swish_gate`` (:class:`GatedRMSNorm` over V, if
    use_output_gate; else ``g_norm``, :class:`RMSNorm`).

    State: ``RecurrentState(kind=self.kind, recurrent=[B, H, K, V] float32 (float64 for float64
    inputs; keys are rows, fla's ``state_v_first=False`` layout), conv=[B, conv_size - 1,
    key_dim + key_dim / G + value_dim / G] in x.dtype (the tails of the q, k and v convs
    concatenated in that order) or None without short convs, offset=tokens seen)``.
    """

    def __init__(self, d_model: int, config: LinearAttentionConfig, backend: str = "auto"):
        super().__init__(d_model)
        self.config, self.backend = config, backend
        name = type(self).__name__
        self.num_heads = H = config.num_heads
        self.num_kv_heads = Hkv = config.num_kv_heads or H
        if H % Hkv:
            raise ValueError(f"{name}: num_heads {H} is not a multiple of num_kv_heads {Hkv}")
        self.num_kv_groups = H // Hkv
        self.key_dim = self._dim(config.expand_k, "expand_k")
        self.value_dim = self._dim(config.expand_v, "expand_v")
        if self.key_dim % H or self.value_dim % H:
            raise ValueError(f"{name}: key_dim {self.key_dim} and value_dim {self.value_dim} must be "
                             f"multiples of num_heads {H}")
        self.head_k_dim, self.head_v_dim = self.key_dim // H, self.value_dim // H
        self.key_dim_per_group = self.key_dim // self.num_kv_groups
        self.value_dim_per_group = self.value_dim // self.num_kv_groups
        self.scale = self.head_k_dim ** -0.5

        self.q_proj = nn.Linear(d_model, self.key_dim, bias=False)
        self.k_proj = nn.Linear(d_model, self.key_dim_per_group, bias=False)
        self.v_proj = nn.Linear(d_model, self.value_dim_per_group, bias=False)
        if config.use_output_gate:
            self.g_proj = nn.Linear(d_model, self.value_dim, bias=False)
        self.conv_channels = [self.key_dim, self.key_dim_per_group, self.value_dim_per_group]
        if config.use_short_conv:
            self.q_conv1d, self.k_conv1d, self.v_conv1d = (
                ShortConv(c, config.conv_size, bias=config.conv_bias, activation="silu", backend=backend)
                for c in self.conv_channels)
        self.build_decay()
        self.o_proj = nn.Linear(self.value_dim, d_model, bias=False)
        if config.use_output_gate:
            self.g_norm_swish_gate = GatedRMSNorm(self.head_v_dim, eps=config.norm_eps, norm_before_gate=True)
        else:
            self.g_norm = RMSNorm(self.head_v_dim, eps=config.norm_eps)
        self.reset_parameters()

    def _dim(self, expand: float, what: str) -> int:
        size = self.d_model * expand
        if not math.isclose(size, round(size)):
            raise ValueError(f"{type(self).__name__}: d_model * {what} must be an integer, "
                             f"got {self.d_model} * {expand} = {size}")
        return round(size)

    # ---- hooks ------------------------------------------------------------------------------
    def build_decay(self) -> None:
        """Create the modules of :meth:`decays`, if any (GLA: ``gk_proj``). Called between the
        short convs and ``o_proj``, so that parameters are registered (and initialised from the
        RNG) in fla's order."""

    def decays(self, x: torch.Tensor) -> torch.Tensor:
        """``x [B, T, d_model]`` -> ``log_a <= 0`` per query head: ``[B, T, H]`` (one decay per
        head) or ``[B, T, H, K]`` (one per key), in the state dtype (float32; float64 kept)."""
        raise NotImplementedError

    def positions(self, q: torch.Tensor, k: torch.Tensor, offset: int,
                  positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Position encoding of ``q [B, T, H, K]`` and ``k [B, T, Hkv, K]`` whose first token is
        at position ``offset`` (or at ``positions [T]``, packed documents); same shapes and
        dtypes. Default: none."""
        return q, k

    # ---- shared body --------------------------------------------------------------------------
    @torch.no_grad()
    def reset_parameters(self) -> None:
        """fla's model init: linear and conv weights ~ N(0, initializer_range²), biases 0, norm
        weights 1. Biases and norm weights are marked ``_no_weight_decay``."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, ShortConv)):
                nn.init.normal_(module.weight, mean=0.0, std=self.config.initializer_range)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
                    module.bias._no_weight_decay = True
            elif isinstance(module, (RMSNorm, GatedRMSNorm)):
                nn.init.ones_(module.weight)
                module.weight._no_weight_decay = True

    def expected_state(self, batch_size: int, dtype: torch.dtype
                       ) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        fields = {"recurrent": ((batch_size, self.num_heads, self.head_k_dim, self.head_v_dim),
                                state_dtype(dtype))}
        if self.config.use_short_conv:
            fields["conv"] = ((batch_size, self.config.conv_size - 1, sum(self.conv_channels)), dtype)
        return fields

    def _qkv(self, x: torch.Tensor, conv: torch.Tensor | None, cu_seqlens: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Projections (and short convs): q ``[B, T, key_dim]``, k, v, and the new conv tail."""
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if not self.config.use_short_conv:
            return q, k, v, None
        tails = [None] * 3 if conv is None else conv.split(self.conv_channels, dim=-1)
        (q, tail_q), (k, tail_k), (v, tail_v) = (
            conv1d(u, tail, cu_seqlens=cu_seqlens) for conv1d, u, tail in
            zip((self.q_conv1d, self.k_conv1d, self.v_conv1d), (q, k, v), tails))
        return q, k, v, torch.cat([tail_q, tail_k, tail_v], dim=-1)

    def mix(self, x: torch.Tensor, state: RecurrentState | None, cu_seqlens: torch.Tensor | None = None
            ) -> tuple[torch.Tensor, RecurrentState]:
        """``x [B, T, d_model]`` -> ``(y [B, T, d_model] in x.dtype, state)``; ``cu_seqlens``:
        packed documents (``B = 1``, per-document states ``[N, ...]``; see :meth:`Mixer.forward`)."""
        cfg, G = self.config, self.num_kv_groups
        H, K, V = self.num_heads, self.head_k_dim, self.head_v_dim
        offset = sequence_start(x.shape[1]) if state is None else state.offset
        positions = None if cu_seqlens is None else document_positions(cu_seqlens, x.shape[1], offset)
        x = projection_input(x)  # one autocast copy shared by every projection (and its backward)
        q, k, v, conv = self._qkv(x, None if state is None else state.conv, cu_seqlens)
        q, k = self.positions(q.unflatten(-1, (H, K)), k.unflatten(-1, (H // G, K)), offset, positions)
        # key/value head j serves query heads j*G .. j*G + G - 1 (fla's repeat '(h g)')
        v = v.unflatten(-1, (H // G, V))
        if G > 1:  # (repeat_interleave copies even for G = 1)
            k, v = k.repeat_interleave(G, dim=2), v.repeat_interleave(G, dim=2)   # [B, T, H, K / V]
        log_a = self.decays(x)

        if x.shape[1] == 1 and state is not None and cu_seqlens is None:
            o, recurrent = linear_attn_step(q[:, 0], k[:, 0], v[:, 0], log_a[:, 0], state.recurrent,
                                            scale=self.scale)
            o = o[:, None]
        else:
            o, recurrent = sharded(chunk_linear_attn)(
                q, k, v, log_a, scale=self.scale,
                initial_state=None if state is None else state.recurrent,
                output_final_state=True, chunk_size=cfg.chunk_size, backend=self.backend,
                **({} if cu_seqlens is None else {"cu_seqlens": cu_seqlens}))

        if cfg.use_output_gate:
            o = self.g_norm_swish_gate(o, self.g_proj(x).unflatten(-1, (H, V)))
        else:
            o = self.g_norm(o)
        y = self.o_proj(o.flatten(-2))
        return y, RecurrentState(kind=self.kind, recurrent=recurrent, conv=conv,
                                 offset=next_offset(cu_seqlens, x.shape[1], offset))
