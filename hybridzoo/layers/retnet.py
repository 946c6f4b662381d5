"""RetNet: multi-scale retention (Sun et al. 2023, "Retentive Network: A Successor to Transformer
for Large Language Models").

Matches flash-linear-attention's ``fla.layers.multiscale_retention.MultiScaleRetention``
(fla 0.6.0), parameter names and shapes included, except that the short convs' weights are
``[channels, conv_size]`` here (fla: ``[channels, 1, conv_size]``). With ``H`` query heads,
``Hkv = num_kv_heads`` key/value heads (``G = H / Hkv``; query head ``h`` uses key/value head
``h // G``), ``K = key_dim / H`` and ``V = value_dim / H``::

    q, k, v  = q_proj(x), k_proj(x), v_proj(x)   # then silu(short conv) each, if use_short_conv
    q, k     = rotary(q), rotary(k)              # rotate-half RoPE over all K channels, base 10000,
                                                 # positions continue from the state's offset
    gamma_h  = 1 - 2**(-5 - h),  h = 0 .. H-1    # fixed decay per head (no xpos, as in fla)
    S_t      = gamma_h S_{t-1} + k_t v_tᵀ        # per head, S: [K, V]
    o_t      = K**-0.5 · S_tᵀ q_t
    y        = o_proj(rmsnorm(o) * w * silu(g_proj(x)))   # RMSNorm per head over V channels

The recurrence is :func:`hybridzoo.kernels.chunk_linear_attn` with ``log_a = log(gamma_h)`` for
every token (``[B, T, H]``); a single token with a state takes
:func:`hybridzoo.kernels.linear_attn_step`. The body shared with GLA is
:class:`hybridzoo.layers.gated_linear.LinearAttentionMixer`; this module adds the fixed decays and
the rotary positions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridzoo.layers.gated_linear import LinearAttentionConfig, LinearAttentionMixer
from hybridzoo.layers.rotary import Rotary
from hybridzoo.layers.state import state_dtype


@dataclass
class RetNetConfig(LinearAttentionConfig):
    """Settings of a :class:`RetNet` mixer (defaults of fla's ``MultiScaleRetention`` layer).

    Attributes (besides those of :class:`LinearAttentionConfig`: expand_k, expand_v, num_heads,
    num_kv_heads, use_short_conv, conv_size, conv_bias, use_output_gate, norm_eps, chunk_size,
    initializer_range; here each of the num_heads query heads has its own decay):
        rotary_base: base of the rotary frequencies.
    """

    expand_k: float = 1.0
    expand_v: float = 2.0
    num_heads: int = 8
    rotary_base: float = 10000.0


def retention_log_decays(num_heads: int, dtype: torch.dtype = torch.float32,
                         device: torch.device | None = None) -> torch.Tensor:
    """``log(gamma_h) = log(1 - 2**(-5 - h))`` for ``h = 0 .. num_heads - 1``: ``[num_heads]``."""
    return torch.log1p(-torch.exp2(-5.0 - torch.arange(num_heads, dtype=dtype, device=device)))


class RetNet(LinearAttentionMixer):
    """Multi-scale retention mixer: ``y, state = mixer(x, state=None)``, ``x, y: [B, T, d_model]``.

    Parameters (names and shapes as fla's ``MultiScaleRetention``): ``q_proj`` (d_model ->
    key_dim), ``k_proj`` (d_model -> key_dim / G), ``v_proj`` (d_model -> value_dim / G),
    ``g_proj`` (d_model -> value_dim, if use_output_gate), ``q_conv1d`` / ``k_conv1d`` /
    ``v_conv1d`` (:class:`ShortConv`, if use_short_conv), ``g_norm_swish_gate``
    (:class:`GatedRMSNorm` over V, if use_output_gate; else ``g_norm``, :class:`RMSNorm`),
    ``o_proj`` (value_dim -> d_model); ``rotary`` holds no parameters.

    State: ``RecurrentState(kind="retnet", recurrent=[B, H, K, V] float32 (float64 for float64
    inputs; keys are rows), conv=[B, conv_size - 1, key_dim + key_dim / G + value_dim / G] in
    x.dtype (the q, k and v conv tails concatenated in that order) or None without short convs,
    offset=tokens seen, the rotary position of the next token)``.
    """

    kind = "retnet"
    context_parallel = True
    config: RetNetConfig

    def __init__(self, d_model: int, config: RetNetConfig | None = None, backend: str = "auto"):
        super().__init__(d_model, config or RetNetConfig(), backend)
        if self.head_k_dim % 2:
            raise ValueError(f"RetNet: the key head size {self.head_k_dim} must be even (rotary)")
        self.rotary = Rotary(self.head_k_dim, base=self.config.rotary_base)

    def decays(self, x: torch.Tensor) -> torch.Tensor:
        """``x [B, T, d_model]`` -> ``log_a [B, T, H]``: ``log(gamma_h)`` at every token (float32,
        float64 kept)."""
        batch, length, _ = x.shape
        H = self.num_heads
        return retention_log_decays(H, state_dtype(x.dtype), x.device).expand(batch, length, H)

    def positions(self, q: torch.Tensor, k: torch.Tensor, offset: int,
                  positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotary over all K channels, positions ``offset, offset + 1, ...`` (or ``positions [T]``:
        packed documents, restarting at each)."""
        return self.rotary.pair(q, k, offset=offset, positions=positions)  # one cos / sin table for both
