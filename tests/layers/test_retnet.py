"""RetNet mixer: state contract, the layer written out token by token, and parity with fla."""

from __future__ import annotations

import math

import pytest
import torch

from hybridzoo.kernels import chunk_linear_attn
from hybridzoo.kernels.reference import linear_attn_loop
from hybridzoo.layers.retnet import RetNet, RetNetConfig, retention_log_decays
from hybridzoo.layers.state import RecurrentState
from hybridzoo.utils import rel_err
from tests.layers.contract import check_bad_inputs, check_pieces_and_decoding
from tests.layers.fla_parity import (D_MODEL, check_matches_fla_layer, inputs, output_by_hand,
                                     patch_fla_norm_and_conv, qkv_by_hand, randomize, skip_without_fla)

CONFIGS = {
    "one_head": RetNetConfig(num_heads=1),
    "heads": RetNetConfig(num_heads=4, chunk_size=8),
    "kv_heads_conv": RetNetConfig(num_heads=4, num_kv_heads=2, use_short_conv=True, conv_bias=True, chunk_size=8),
    "no_output_gate": RetNetConfig(num_heads=2, use_output_gate=False),
}


def make(name: str, dtype=torch.float64) -> RetNet:
    torch.manual_seed(0)
    return randomize(RetNet(D_MODEL, CONFIGS[name])).to(dtype)


@pytest.mark.parametrize("name", CONFIGS)
def test_pieces_and_decoding(name):
    check_pieces_and_decoding(make(name), inputs())


def test_bad_inputs():
    foreign = RecurrentState(kind="mamba2", recurrent=torch.zeros(2, 4, 4, 8, dtype=torch.float64))
    check_bad_inputs(make("kv_heads_conv"), inputs(), foreign)


def test_state_fields_and_dtypes():
    mixer = make("kv_heads_conv", torch.float32)
    x = inputs(dtype=torch.float32)
    y, state = mixer(x)
    assert y.dtype == torch.float32 and y.shape == x.shape
    assert state.kind == "retnet" and state.offset == x.shape[1]
    assert state.recurrent.shape == (2, 4, 4, 8) and state.recurrent.dtype == torch.float32
    assert state.conv.shape == (2, 3, 16 + 8 + 16)
    y16, state16 = mixer.to(torch.bfloat16)(x.to(torch.bfloat16))
    assert y16.dtype == torch.bfloat16 and state16.recurrent.dtype == torch.float32


def test_decays_are_the_papers():
    """gamma_h = 1 - 2^(-5-h), computed here in float64 from the formula."""
    gammas = torch.tensor([1 - 2.0 ** (-5 - h) for h in range(6)], dtype=torch.float64)
    assert rel_err(retention_log_decays(6, torch.float64), gammas.log()) <= 1e-14


def test_bad_config():
    with pytest.raises(ValueError, match="num_kv_heads"):
        RetNet(D_MODEL, RetNetConfig(num_heads=4, num_kv_heads=3))
    with pytest.raises(ValueError, match="num_heads"):
        RetNet(D_MODEL, RetNetConfig(num_heads=3))


def retnet_by_hand(mixer: RetNet, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer written out with plain tensor ops and the token-by-token kernel loop."""
    cfg, (B, T, _) = mixer.config, x.shape
    H, G, K = mixer.num_heads, mixer.num_kv_groups, mixer.head_k_dim

    # rotate-half RoPE: channel pairs (i, i + K/2) turn by angle t * inv_freq[i]
    inv_freq = cfg.rotary_base ** (-torch.arange(0, K, 2, dtype=torch.float64) / K)
    assert rel_err(mixer.rotary.inv_freq(), inv_freq) <= 1e-7                 # the table is kept in float32
    angle = torch.arange(T, dtype=x.dtype)[:, None] * mixer.rotary.inv_freq().to(x.dtype)
    cos, sin = angle.cos()[None, :, None], angle.sin()[None, :, None]

    def rotate(u):
        u1, u2 = u[..., : K // 2], u[..., K // 2:]
        return torch.cat([u1 * cos - u2 * sin, u2 * cos + u1 * sin], dim=-1)

    q, k, v = qkv_by_hand(mixer, x)
    q, k = rotate(q), rotate(k)
    kv_head = torch.arange(H) // G                                       # query head h reads kv head h // G
    k, v = k[:, :, kv_head], v[:, :, kv_head]
    log_a = torch.tensor([math.log(1 - 2.0 ** (-5 - h)) for h in range(H)], dtype=x.dtype).expand(B, T, H)
    o, final = linear_attn_loop(q, k, v, log_a, scale=K ** -0.5, output_final_state=True)
    return output_by_hand(mixer, x, o), final


@pytest.mark.parametrize("name", CONFIGS)
def test_matches_layer_written_by_hand(name):
    mixer, x = make(name), inputs()
    y, state = mixer(x)
    y_ref, final_ref = retnet_by_hand(mixer, x)
    assert rel_err(y, y_ref) <= 1e-10
    assert rel_err(state.recurrent, final_ref) <= 1e-10


# --- parity with flash-linear-attention (pure-PyTorch paths forced) -------------------------------

def fla_pure_torch(monkeypatch) -> dict[str, int]:
    """Route fla's MultiScaleRetention layer through pure PyTorch and count the calls.

    fla's retention kernels become fla's own ``naive_retention``; its fused gated RMSNorm becomes
    fla's own ``rms_norm_ref``; its rotary op becomes fla's own ``rotary_embedding_ref``; its
    short-conv op becomes ``F.conv1d`` on the module's weight. Returns the call counters.
    """
    skip_without_fla()
    import fla.layers.multiscale_retention as fla_retnet
    import fla.modules.rotary.ops as fla_rotary
    from fla.ops.retention.naive import naive_retention

    calls = {"naive_retention": 0, "rms_norm_ref": 0, "rotary_embedding_ref": 0, "conv1d": 0}

    def retention(q, k, v, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None, **_):
        assert scale is None and initial_state is None and cu_seqlens is None
        calls["naive_retention"] += 1
        o = naive_retention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))   # head-first
        return o.transpose(1, 2), None

    def rotary(x, cos, sin, interleaved=False, inplace=False, seqlen_offsets=0, cu_seqlens=None, **_):
        assert isinstance(seqlen_offsets, int) and cu_seqlens is None and not inplace
        calls["rotary_embedding_ref"] += 1
        positions = slice(seqlen_offsets, seqlen_offsets + x.shape[1])
        return fla_rotary.rotary_embedding_ref(x, cos[positions], sin[positions], interleaved)

    for kernel in ("chunk_retention", "fused_chunk_retention", "fused_recurrent_retention", "parallel_retention"):
        monkeypatch.setattr(fla_retnet, kernel, retention)
    monkeypatch.setattr(fla_rotary, "rotary_embedding", rotary)
    patch_fla_norm_and_conv(monkeypatch, calls)
    return calls


@pytest.mark.parametrize("name", ["one_head", "heads", "kv_heads_conv"])
def test_fla_layer_parity(monkeypatch, name):
    calls = fla_pure_torch(monkeypatch)
    from fla.layers.multiscale_retention import MultiScaleRetention

    cfg = CONFIGS[name]
    torch.manual_seed(0)
    theirs = randomize(MultiScaleRetention(
        mode="chunk", hidden_size=D_MODEL, expand_k=cfg.expand_k, expand_v=cfg.expand_v,
        num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, use_short_conv=cfg.use_short_conv,
        conv_size=cfg.conv_size, conv_bias=cfg.conv_bias, norm_eps=cfg.norm_eps), seed=3)
    check_matches_fla_layer(RetNet(D_MODEL, cfg), theirs)
    assert calls["naive_retention"] == 1 and calls["rms_norm_ref"] == 1
    assert calls["rotary_embedding_ref"] == 2
    assert calls["conv1d"] == (3 if cfg.use_short_conv else 0)


def test_fla_naive_kernel_parity():
    """Our kernel call (fixed per-head decays, K**-0.5) == fla's ``naive_retention``."""
    skip_without_fla()
    from fla.ops.retention.naive import naive_retention

    g = torch.Generator().manual_seed(7)
    B, T, H, K, V = 2, 19, 4, 4, 6
    q, k = (torch.randn(B, T, H, K, generator=g) for _ in range(2))
    v = torch.randn(B, T, H, V, generator=g)
    log_a = retention_log_decays(H).expand(B, T, H)
    o, _ = chunk_linear_attn(q, k, v, log_a, chunk_size=8, backend="reference")
    o_ref = naive_retention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)
    assert rel_err(o, o_ref) <= 1e-5
