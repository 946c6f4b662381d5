"""GLA: gated linear attention (Yang et al. 2023, "Gated Linear Attention Transformers with
Hardware-Efficient Training").

Matches flash-linear-attention's ``fla.layers.gla.GatedLinearAttention`` (fla 0.6.0), parameter
names and shapes included, except that the short convs' weights are ``[channels, conv_size]``
here (fla: ``[channels, 1, conv_size]``; a converter squeezes dim 1). With ``H`` query heads,
``Hkv = num_kv_heads`` key/value heads (``G = H / Hkv``; query head ``h`` uses key/value head
``h // G``), ``K = key_dim / H`` and ``V = value_dim / H``::

    q, k, v = q_proj(x), k_proj(x), v_proj(x)            # then silu(short conv) each, if use_short_conv
    log_a   = logsigmoid(gk_proj(x)) / gate_logit_normalizer  # [B, T, Hkv, K], one decay per key
    S_t     = diag(exp(log_a_t)) S_{t-1} + k_t v_tᵀ       # per head, S: [K, V]
    o_t     = K**-0.5 · S_tᵀ q_t
    y       = o_proj(rmsnorm(o) * w * silu(g_proj(x)))   # RMSNorm per head over V channels

``gk_proj`` is low rank: ``d_model -> gate_low_rank_dim -> key_dim / G`` (bias on the second).
The recurrence is :func:`hybridzoo.kernels.chunk_linear_attn` with per-key decays; a single token
with a state takes :func:`hybridzoo.kernels.linear_attn_step`. The body shared with RetNet is
:class:`hybridzoo.layers.gated_linear.LinearAttentionMixer`; this module adds the decay.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from hybridzoo.layers.gated_linear import LinearAttentionConfig, LinearAttentionMixer
from hybridzoo.layers.state import state_dtype


class _LogSigmoidDecay(torch.autograd.Function):
    """``log_a = max(logsigmoid(gk) / normalizer, clamp_min)`` computed in ``dtype`` (the state
    dtype, float32), keeping for the backward only ``gk`` as given (e.g. bf16 under autocast)
    instead of float32 copies; ``clamp_min=None``: no clamp. Shapes: any -> same."""

    @staticmethod
    def forward(ctx, gk, normalizer, clamp_min, dtype):
        log_a = F.logsigmoid(gk.to(dtype)) / normalizer
        if clamp_min is not None:
            log_a = log_a.clamp_min(clamp_min)
        ctx.save_for_backward(gk)
        ctx.normalizer, ctx.clamp_min, ctx.dtype = normalizer, clamp_min, dtype
        return log_a

    @staticmethod
    def backward(ctx, grad):
        (gk,) = ctx.saved_tensors
        g = gk.to(ctx.dtype)
        grad = grad * torch.sigmoid(-g) / ctx.normalizer  # d logsigmoid(g) / dg = sigmoid(-g)
        if ctx.clamp_min is not None:  # clamp_min passes the gradient where log_a >= clamp_min
            grad = grad * (F.logsigmoid(g) / ctx.normalizer >= ctx.clamp_min)
        return grad.to(gk.dtype), None, None, None


@dataclass
class GLAConfig(LinearAttentionConfig):
    """Settings of a :class:`GLA` mixer (defaults of fla's ``GatedLinearAttention`` layer).

    Attributes (besides those of :class:`LinearAttentionConfig`: expand_k, expand_v, num_heads,
    num_kv_heads, use_short_conv, conv_size, conv_bias, use_output_gate, norm_eps, chunk_size,
    initializer_range; here the key/value heads are also the decay heads):
        gate_logit_normalizer: ``log_a = logsigmoid(gk) / gate_logit_normalizer``.
        gate_low_rank_dim: inner size of the low-rank decay projection ``gk_proj``.
        clamp_min: lower clamp of ``log_a`` (None: no clamp).
    """

    expand_k: float = 0.5
    expand_v: float = 1.0
    num_heads: int = 4
    gate_logit_normalizer: float = 16.0
    gate_low_rank_dim: int = 16
    clamp_min: float | None = None


class GLA(LinearAttentionMixer):
    """Gated linear attention mixer: ``y, state = mixer(x, state=None)``, ``x, y: [B, T, d_model]``.

    Parameters (names and shapes as fla's ``GatedLinearAttention``): ``q_proj`` (d_model ->
    key_dim), ``k_proj`` (d_model -> key_dim / G), ``v_proj`` (d_model -> value_dim / G),
    ``g_proj`` (d_model -> value_dim, if use_output_gate), ``gk_proj`` (``nn.Sequential`` of
    d_model -> gate_low_rank_dim -> key_dim / G, bias on the second), ``q_conv1d`` /
    ``k_conv1d`` / ``v_conv1d`` (:class:`ShortConv`, if use_short_conv), ``g_norm_swish_gate``
    (:class:`GatedRMSNorm` over V, if use_output_gate; else ``g_norm``, :class:`RMSNorm`),
    ``o_proj`` (value_dim -> d_model).

    State: ``RecurrentState(kind="gla", recurrent=[B, H, K, V] float32 (float64 for float64
    inputs; keys are rows, fla's ``state_v_first=False`` layout), conv=[B, conv_size - 1,
    key_dim + key_dim / G + value_dim / G] in x.dtype (the tails of the q, k and v convs
    concatenated in that order) or None without short convs, offset=tokens seen)``.
    """

    kind = "gla"
    context_parallel = True
    config: GLAConfig

    def __init__(self, d_model: int, config: GLAConfig | None = None, backend: str = "auto"):
        super().__init__(d_model, config or GLAConfig(), backend)

    def build_decay(self) -> None:
        rank = self.config.gate_low_rank_dim
        self.gk_proj = nn.Sequential(nn.Linear(self.d_model, rank, bias=False),
                                     nn.Linear(rank, self.key_dim_per_group, bias=True))

    def decays(self, x: torch.Tensor) -> torch.Tensor:
        """``x [B, T, d_model]`` -> ``log_a [B, T, H, K]`` (one decay per key; float32, float64 kept)."""
        cfg = self.config
        log_a = _LogSigmoidDecay.apply(self.gk_proj(x), cfg.gate_logit_normalizer, cfg.clamp_min,
                                       state_dtype(x.dtype))
        # decay head j serves query heads j*G .. j*G + G - 1, as the key/value heads do
        G = self.num_kv_groups
        return log_a.unflatten(-1, (self.num_heads // G, self.head_k_dim)).repeat_interleave(G, dim=2)
