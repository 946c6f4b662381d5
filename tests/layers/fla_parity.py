"""Helpers shared by the GLA and RetNet tests (both layers follow fla's layout, see
:mod:`hybridzoo.layers.gated_linear`): random parameters and inputs, the parts of the layer
written out by hand, and fla's layers routed through pure PyTorch and compared with ours.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybridzoo.layers.gated_linear import LinearAttentionMixer
from hybridzoo.utils import rel_err

D_MODEL = 16


@torch.no_grad()
def randomize(module: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Give every parameter a random value of order 1 (norm weights around 1), so that each one matters."""
    generator = torch.Generator().manual_seed(seed)
    for name, p in module.named_parameters():
        noise = torch.randn(p.shape, generator=generator, dtype=torch.float64).to(p.dtype)
        p.copy_(1 + 0.2 * noise if "norm" in name else 0.4 * noise)
    return module


def inputs(B=2, T=23, dtype=torch.float64, seed=1) -> torch.Tensor:
    return torch.randn(B, T, D_MODEL, generator=torch.Generator().manual_seed(seed), dtype=dtype)


# --- the layer written out with plain tensor ops ------------------------------------------------

def qkv_by_hand(mixer: LinearAttentionMixer, x: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q ``[B, T, H, K]``, k ``[B, T, Hkv, K]``, v ``[B, T, Hkv, V]``: projections, then
    silu(causal depthwise conv) if the mixer has short convs."""
    cfg, (B, T, _) = mixer.config, x.shape
    H, G, K, V = mixer.num_heads, mixer.num_kv_groups, mixer.head_k_dim, mixer.head_v_dim

    def project(linear, conv):
        u = x @ linear.weight.T
        if not cfg.use_short_conv:
            return u
        padded = F.pad(u.transpose(1, 2), (cfg.conv_size - 1, 0))        # causal: zeros before t=0
        return F.silu(F.conv1d(padded, conv.weight[:, None], conv.bias, groups=u.shape[-1]).transpose(1, 2))

    q = project(mixer.q_proj, getattr(mixer, "q_conv1d", None)).reshape(B, T, H, K)
    k = project(mixer.k_proj, getattr(mixer, "k_conv1d", None)).reshape(B, T, H // G, K)
    v = project(mixer.v_proj, getattr(mixer, "v_conv1d", None)).reshape(B, T, H // G, V)
    return q, k, v


def output_by_hand(mixer: LinearAttentionMixer, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
    """``o [B, T, H, V]`` -> ``y [B, T, d_model]``: RMSNorm per head, times silu(g_proj(x)) if
    the mixer has an output gate, then o_proj."""
    cfg, (B, T, _) = mixer.config, x.shape
    H, V = mixer.num_heads, mixer.head_v_dim
    o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + cfg.norm_eps)
    if cfg.use_output_gate:
        g = (x @ mixer.g_proj.weight.T).reshape(B, T, H, V)
        o = o * mixer.g_norm_swish_gate.weight * F.silu(g)
    else:
        o = o * mixer.g_norm.weight
    return o.reshape(B, T, H * V) @ mixer.o_proj.weight.T


# --- parity with flash-linear-attention (pure-PyTorch paths forced) -------------------------------

def patch_fla_norm_and_conv(monkeypatch, calls: dict[str, int]) -> None:
    """Route fla's fused gated RMSNorm to fla's own ``rms_norm_ref`` and its short-conv op to
    ``F.conv1d`` on the module's weight, counting the calls in ``calls["rms_norm_ref"]`` and
    ``calls["conv1d"]``."""
    import fla.modules.causal_conv1d.ops as fla_conv
    import fla.modules.norm.fused_norm_gate as fla_norm
    from fla.modules.norm.layernorm_gated import rms_norm_ref

    def norm(x, g, weight, bias, activation="swish", residual=None, prenorm=False,
             residual_in_fp32=False, eps=1e-6):
        assert activation in ("swish", "silu") and residual is None and not prenorm
        calls["rms_norm_ref"] += 1
        return rms_norm_ref(x, weight, bias, z=g, eps=eps, norm_before_gate=True)

    def conv(x, weight, bias=None, residual=None, initial_state=None, output_final_state=False,
             activation=None, cu_seqlens=None, **_):
        assert residual is None and initial_state is None and cu_seqlens is None
        calls["conv1d"] += 1
        W = weight.shape[-1]
        y = F.conv1d(x.transpose(1, 2), weight[:, None], bias, padding=W - 1, groups=x.shape[-1])
        y = y[..., : x.shape[1]].transpose(1, 2)
        return (F.silu(y) if activation in ("silu", "swish") else y), None

    monkeypatch.setattr(fla_norm, "rms_norm_gated", norm)
    monkeypatch.setattr(fla_conv, "causal_conv1d", conv)


def check_matches_fla_layer(ours: LinearAttentionMixer, theirs: torch.nn.Module) -> None:
    """Load fla's layer's weights into ours by name, then compare the outputs and the input
    gradients on a float32 input (rel err <= 1e-5)."""
    # same names and shapes, except fla's conv weights [C, 1, W] -> ours [C, W]
    ours.load_state_dict({n: t.squeeze(1) if "conv1d.weight" in n else t
                          for n, t in theirs.state_dict().items()}, strict=True)
    x = inputs(T=21, dtype=torch.float32).requires_grad_(True)
    y_theirs = theirs(x)[0]
    y_ours, _ = ours(x)
    assert rel_err(y_ours, y_theirs) <= 1e-5
    weight = torch.randn(y_ours.shape, generator=torch.Generator().manual_seed(5))
    (g_theirs,) = torch.autograd.grad((y_theirs * weight).sum(), x)
    (g_ours,) = torch.autograd.grad((y_ours * weight).sum(), x)
    assert rel_err(g_ours, g_theirs) <= 1e-5


def skip_without_fla() -> None:
    pytest.importorskip("fla", reason="flash-linear-attention (fla) is not installed")
