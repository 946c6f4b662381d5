"""GLA mixer: state contract, the layer written out token by token, and parity with fla."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybridzoo.kernels import chunk_linear_attn
from hybridzoo.kernels.reference import linear_attn_loop
from hybridzoo.layers.gla import GLA, GLAConfig
from hybridzoo.layers.state import RecurrentState
from hybridzoo.utils import rel_err
from tests.layers.contract import check_bad_inputs, check_pieces_and_decoding
from tests.layers.fla_parity import (D_MODEL, check_matches_fla_layer, inputs, output_by_hand,
                                     patch_fla_norm_and_conv, qkv_by_hand, randomize, skip_without_fla)

CONFIGS = {
    "plain": GLAConfig(num_heads=2),
    "short_conv": GLAConfig(num_heads=2, use_short_conv=True, conv_bias=True, chunk_size=8),
    "kv_heads": GLAConfig(num_heads=4, num_kv_heads=2, use_short_conv=True, clamp_min=-0.05, chunk_size=8),
    "no_output_gate": GLAConfig(num_heads=2, use_output_gate=False, gate_logit_normalizer=1.0),
}


def make(name: str, dtype=torch.float64) -> GLA:
    torch.manual_seed(0)
    return randomize(GLA(D_MODEL, CONFIGS[name])).to(dtype)


@pytest.mark.parametrize("name", CONFIGS)
def test_pieces_and_decoding(name):
    check_pieces_and_decoding(make(name), inputs())


def test_bad_inputs():
    foreign = RecurrentState(kind="mamba2", recurrent=torch.zeros(2, 2, 4, 8, dtype=torch.float64))
    check_bad_inputs(make("short_conv"), inputs(), foreign)


def test_state_fields_and_dtypes():
    mixer = make("kv_heads", torch.float32)
    x = inputs(dtype=torch.float32)
    y, state = mixer(x)
    assert y.dtype == torch.float32 and y.shape == x.shape
    assert state.kind == "gla" and state.offset == x.shape[1]
    assert state.recurrent.shape == (2, 4, 2, 4) and state.recurrent.dtype == torch.float32
    assert state.conv.shape == (2, 3, 8 + 4 + 8)
    y16, state16 = mixer.to(torch.bfloat16)(x.to(torch.bfloat16))
    assert y16.dtype == torch.bfloat16 and state16.recurrent.dtype == torch.float32
    _, state = mixer(x[:, :5].to(torch.bfloat16), state16)
    assert state.offset == x.shape[1] + 5


def test_bad_config():
    with pytest.raises(ValueError, match="num_kv_heads"):
        GLA(D_MODEL, GLAConfig(num_heads=4, num_kv_heads=3))
    with pytest.raises(ValueError, match="num_heads"):
        GLA(D_MODEL, GLAConfig(num_heads=3))


def gla_by_hand(mixer: GLA, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer written out with plain tensor ops and the token-by-token kernel loop."""
    cfg, (B, T, _) = mixer.config, x.shape
    H, G, K = mixer.num_heads, mixer.num_kv_groups, mixer.head_k_dim
    q, k, v = qkv_by_hand(mixer, x)
    gk = (x @ mixer.gk_proj[0].weight.T) @ mixer.gk_proj[1].weight.T + mixer.gk_proj[1].bias
    log_a = F.logsigmoid(gk) / cfg.gate_logit_normalizer
    if cfg.clamp_min is not None:
        log_a = torch.maximum(log_a, torch.tensor(cfg.clamp_min, dtype=log_a.dtype))
    log_a = log_a.reshape(B, T, H // G, K)
    kv_head = torch.arange(H) // G                                       # query head h reads kv head h // G
    k, v, log_a = k[:, :, kv_head], v[:, :, kv_head], log_a[:, :, kv_head]
    o, final = linear_attn_loop(q, k, v, log_a, scale=K ** -0.5, output_final_state=True)
    return output_by_hand(mixer, x, o), final


@pytest.mark.parametrize("name", CONFIGS)
def test_matches_layer_written_by_hand(name):
    mixer, x = make(name), inputs()
    y, state = mixer(x)
    y_ref, final_ref = gla_by_hand(mixer, x)
    assert rel_err(y, y_ref) <= 1e-10
    assert rel_err(state.recurrent, final_ref) <= 1e-10


# --- parity with flash-linear-attention (pure-PyTorch paths forced) -------------------------------

def fla_pure_torch(monkeypatch) -> dict[str, int]:
    """Route fla's GLA layer through pure PyTorch and count the calls.

    fla's GLA kernels (chunk / fused_recurrent / fused_chunk) become fla's own
    ``naive_recurrent_gla``; its fused gated RMSNorm becomes fla's own ``rms_norm_ref``; its
    short-conv op becomes ``F.conv1d`` on the module's weight. Returns the call counters.
    """
    skip_without_fla()
    import fla.layers.gla as fla_gla
    from fla.ops.gla.naive import naive_recurrent_gla

    calls = {"naive_recurrent_gla": 0, "rms_norm_ref": 0, "conv1d": 0}

    def gla_kernel(q, k, v, gk=None, g=None, scale=None, initial_state=None, output_final_state=False,
                   cu_seqlens=None, **_):
        assert scale is None and initial_state is None and cu_seqlens is None
        calls["naive_recurrent_gla"] += 1
        return naive_recurrent_gla(q, k, v, gk if gk is not None else g, None, output_final_state)

    for kernel in ("chunk_gla", "fused_recurrent_gla", "fused_chunk_gla"):
        monkeypatch.setattr(fla_gla, kernel, gla_kernel)
    patch_fla_norm_and_conv(monkeypatch, calls)
    return calls


@pytest.mark.parametrize("name", ["plain", "short_conv", "kv_heads"])
def test_fla_layer_parity(monkeypatch, name):
    calls = fla_pure_torch(monkeypatch)
    from fla.layers.gla import GatedLinearAttention

    cfg = CONFIGS[name]
    torch.manual_seed(0)
    theirs = randomize(GatedLinearAttention(
        mode="chunk", hidden_size=D_MODEL, expand_k=cfg.expand_k, expand_v=cfg.expand_v,
        num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, use_short_conv=cfg.use_short_conv,
        conv_size=cfg.conv_size, conv_bias=cfg.conv_bias, norm_eps=cfg.norm_eps,
        gate_logit_normalizer=cfg.gate_logit_normalizer, gate_low_rank_dim=cfg.gate_low_rank_dim,
        clamp_min=cfg.clamp_min), seed=3)
    check_matches_fla_layer(GLA(D_MODEL, cfg), theirs)
    assert calls["naive_recurrent_gla"] == 1 and calls["rms_norm_ref"] == 1
    assert calls["conv1d"] == (3 if cfg.use_short_conv else 0)


def test_fla_naive_kernel_parity():
    """Our kernel call (per-key decays, K**-0.5, [B, H, K, V] states) == fla's ``naive_recurrent_gla``."""
    skip_without_fla()
    from fla.ops.gla.naive import naive_recurrent_gla

    g = torch.Generator().manual_seed(7)
    B, T, H, K, V = 2, 19, 2, 4, 6
    q, k = (torch.randn(B, T, H, K, generator=g) for _ in range(2))
    v = torch.randn(B, T, H, V, generator=g)
    log_a = F.logsigmoid(torch.randn(B, T, H, K, generator=g))
    h0 = torch.randn(B, H, K, V, generator=g)
    o, final = chunk_linear_attn(q, k, v, log_a, initial_state=h0, output_final_state=True,
                                 chunk_size=8, backend="reference")
    o_ref, final_ref = naive_recurrent_gla(q, k, v, log_a, h0, output_final_state=True)
    assert rel_err(o, o_ref) <= 1e-5
    assert rel_err(final, final_ref) <= 1e-5
