"""Mamba-2 mixer: the state contract, input checks, initialisation, and parity with Hugging Face
transformers' ``Mamba2Mixer`` on its pure-PyTorch path (forced and confirmed)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybridzoo.layers.mamba1 import Mamba1, Mamba1Config
from hybridzoo.layers.mamba2 import Mamba2, Mamba2Config
from hybridzoo.layers.state import RecurrentState
from hybridzoo.utils import rel_err
from tests.layers.contract import check_bad_inputs, check_pieces_and_decoding
from tests.hf_pure import force_module_pure_path, needs_parity_transformers
from tests.layers.hf_parity import (
    assert_same_output_and_grads,
    copy_from_hf,
    output_and_grads,
)

CONFIGS = {  # T = 23 below: ragged for every chunk size
    "one-group": (8, Mamba2Config(d_state=4, head_dim=4, chunk_size=8)),
    "2-groups-4-heads": (8, Mamba2Config(d_state=3, head_dim=4, n_groups=2, chunk_size=5, d_conv=3,
                                         bias=True, conv_bias=False)),
    "group-per-head-dt-limit": (6, Mamba2Config(d_state=5, head_dim=3, expand=1, n_groups=2,
                                                chunk_size=8, time_step_limit=(0.02, 0.06))),
}


@pytest.mark.parametrize("name", CONFIGS)
def test_contract(name):
    torch.manual_seed(0)
    d_model, config = CONFIGS[name]
    mixer = Mamba2(d_model, config).double()
    x = torch.randn(2, 23, d_model, dtype=torch.float64)
    check_pieces_and_decoding(mixer, x)


def test_state_layout():
    torch.manual_seed(0)
    mixer = Mamba2(8, Mamba2Config(d_state=3, head_dim=4, n_groups=2, chunk_size=4))
    _, state = mixer(torch.randn(2, 7, 8))
    assert state.kind == "mamba2" and state.offset == 7
    assert state.recurrent.shape == (2, 4, 3, 4) and state.recurrent.dtype == torch.float32
    assert state.conv.shape == (2, 3, 16 + 2 * 2 * 3) and state.conv.dtype == torch.float32
    _, state = mixer(torch.randn(2, 1, 8), state)
    assert state.offset == 8


def test_time_step_limit_clamps():
    """A limit that binds changes the output; the default one does not exist."""
    torch.manual_seed(0)
    free = Mamba2(8, Mamba2Config(d_state=4, head_dim=4, chunk_size=4)).double()
    clamped = Mamba2(8, Mamba2Config(d_state=4, head_dim=4, chunk_size=4,
                                     time_step_limit=(0.5, 0.6))).double()
    clamped.load_state_dict(free.state_dict())
    x = torch.randn(1, 6, 8, dtype=torch.float64)
    assert rel_err(clamped(x)[0], free(x)[0]) > 1e-3


def test_bad_inputs():
    torch.manual_seed(0)
    mixer = Mamba2(8, Mamba2Config(d_state=4, head_dim=4, chunk_size=4))
    x = torch.randn(2, 5, 8)
    gla = RecurrentState(kind="gla", recurrent=torch.zeros(2, 4, 4, 4), conv=torch.zeros(2, 3, 24))
    check_bad_inputs(mixer, x, gla)
    _, mamba1_state = Mamba1(8, Mamba1Config(d_state=4))(x)
    check_bad_inputs(mixer, x, mamba1_state)


def test_bad_config():
    with pytest.raises(ValueError, match="head_dim"):
        Mamba2(8, Mamba2Config(head_dim=5))
    with pytest.raises(ValueError, match="n_groups"):
        Mamba2(8, Mamba2Config(head_dim=4, n_groups=3))


def test_init():
    torch.manual_seed(0)
    config = Mamba2Config(d_state=4, head_dim=2, dt_min=0.01, dt_max=0.05, A_init_range=(2.0, 8.0))
    mixer = Mamba2(32, config)  # d_inner 64, 32 heads
    A = torch.exp(mixer.A_log)
    assert A.shape == (32,) and A.min() >= 2.0 * (1 - 1e-6) and A.max() <= 8.0 * (1 + 1e-6)
    assert A.std() > 1.0  # uniform, not 1..H
    dt = F.softplus(mixer.dt_bias)
    assert dt.min() >= 0.01 * (1 - 1e-5) and dt.max() <= 0.05 * (1 + 1e-5)
    assert torch.equal(mixer.D, torch.ones(32))
    assert mixer.in_proj.weight.shape == (2 * 64 + 2 * 4 + 32, 32)
    assert mixer.conv1d.weight.shape == (64 + 2 * 4, 4)
    assert mixer.norm.group_size == 64 and not mixer.norm.norm_before_gate
    flagged = {n for n, p in mixer.named_parameters() if getattr(p, "_no_weight_decay", False)}
    assert flagged == {"dt_bias", "A_log", "D", "norm.weight", "conv1d.bias"}


# --- parity with transformers' Mamba2Mixer, pure-PyTorch path -------------------------------

def hf_mamba2(monkeypatch, d_model, config: Mamba2Config, hf_chunk_size: int):
    modeling = pytest.importorskip("transformers.models.mamba2.modeling_mamba2",
                                   reason="transformers is needed for the parity test")
    from transformers import Mamba2Config as HFMamba2Config

    d_inner = config.expand * d_model
    hf_config = HFMamba2Config(
        hidden_size=d_model, state_size=config.d_state, expand=config.expand,
        head_dim=config.head_dim, num_heads=d_inner // config.head_dim, n_groups=config.n_groups,
        conv_kernel=config.d_conv, chunk_size=hf_chunk_size, use_bias=config.bias,
        use_conv_bias=config.conv_bias, time_step_limit=config.time_step_limit,
        layer_norm_epsilon=config.norm_eps, num_hidden_layers=1)
    calls = force_module_pure_path(monkeypatch, modeling, [
        "mamba2_split_conv1d_scan_combined", "mamba2_chunk_scan", "mamba2_selective_state_update",
        "causal_conv1d_fn", "causal_conv1d_update"])
    hf = modeling.Mamba2Mixer(hf_config, layer_idx=0)
    with torch.no_grad():  # move every parameter off its init so that each one matters
        for p in hf.parameters():
            p.add_(0.2 * torch.randn_like(p))
    ours = Mamba2(d_model, config)
    copy_from_hf(ours, hf)
    return hf, ours, calls, hf_config


@needs_parity_transformers
@pytest.mark.parametrize("limit", [(0.0, float("inf")), (0.3, 0.9)])
def test_parity_with_transformers(monkeypatch, limit):
    torch.manual_seed(0)
    d_model = 16
    # 2 groups, 8 heads; our chunk size differs from HF's and T = 21 is ragged for both
    config = Mamba2Config(d_state=4, head_dim=4, n_groups=2, chunk_size=6, bias=True,
                          time_step_limit=limit)
    hf, ours, calls, _ = hf_mamba2(monkeypatch, d_model, config, hf_chunk_size=8)
    x = torch.randn(2, 21, d_model)
    weight = torch.randn(2, 21, d_model)
    from_hf = output_and_grads(hf, x, weight)
    assert calls["mamba2_chunk_scan"] == 1 and calls["causal_conv1d_fn"] == 1
    assert calls["mamba2_split_conv1d_scan_combined"] == 1  # training mode: tried, returned None
    assert_same_output_and_grads(output_and_grads(ours, x, weight), from_hf)


@needs_parity_transformers
def test_decoding_parity_with_transformers_cache(monkeypatch):
    """Prefill then token steps with HF's cache == our carried state (outputs and states)."""
    DynamicCache = pytest.importorskip("transformers").DynamicCache
    torch.manual_seed(1)
    d_model, config = 8, Mamba2Config(d_state=3, head_dim=2, n_groups=2, chunk_size=4, d_conv=3)
    hf, ours, calls, hf_config = hf_mamba2(monkeypatch, d_model, config, hf_chunk_size=4)
    hf.eval()
    x = torch.randn(2, 10, d_model)
    cache = DynamicCache(config=hf_config)
    state = None
    with torch.no_grad():
        for piece in x.split([6, 1, 1, 1, 1], dim=1):
            y_hf = hf(piece, cache=cache)
            y, state = ours(piece, state)
            assert rel_err(y, y_hf) <= 1e-5, rel_err(y, y_hf)
    assert calls["mamba2_selective_state_update"] == 4 and calls["causal_conv1d_update"] == 4
    # HF's recurrent state is [B, H, P, N]; ours is [B, H, N, P] (keys = B/C index are rows)
    assert rel_err(state.recurrent, cache.get_recurrent_state(0).transpose(-1, -2)) <= 1e-5
    # HF keeps the last W inputs channel-first [B, C, W]; we keep the last W - 1, time-first
    assert rel_err(state.conv, cache.get_conv_state(0)[..., 1:].transpose(1, 2)) <= 1e-6
    assert state.offset == 10
