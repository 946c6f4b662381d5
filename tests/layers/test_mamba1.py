"""Mamba-1 mixer: the state contract, input checks, initialisation, and parity with Hugging Face
transformers' ``MambaMixer`` on its pure-PyTorch path (forced and confirmed)."""

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

CONFIGS = {
    "default-tiny": (8, Mamba1Config(d_state=4)),
    "no-conv-bias-bias-rank3": (6, Mamba1Config(d_state=3, d_conv=2, expand=1, dt_rank=3,
                                                conv_bias=False, bias=True)),
    "conv-width-1": (4, Mamba1Config(d_state=5, d_conv=1, dt_rank=2)),
}


@pytest.mark.parametrize("name", CONFIGS)
def test_contract(name):
    torch.manual_seed(0)
    d_model, config = CONFIGS[name]
    mixer = Mamba1(d_model, config).double()
    x = torch.randn(2, 23, d_model, dtype=torch.float64)
    check_pieces_and_decoding(mixer, x)


def test_state_layout():
    torch.manual_seed(0)
    mixer = Mamba1(8, Mamba1Config(d_state=4, d_conv=3))
    _, state = mixer(torch.randn(2, 5, 8))
    assert state.kind == "mamba1" and state.offset == 5
    assert state.recurrent.shape == (2, 16, 4) and state.recurrent.dtype == torch.float32
    assert state.conv.shape == (2, 2, 16) and state.conv.dtype == torch.float32
    _, state = mixer(torch.randn(2, 1, 8), state)
    assert state.offset == 6


def test_bad_inputs():
    torch.manual_seed(0)
    mixer = Mamba1(8, Mamba1Config(d_state=4))
    x = torch.randn(2, 5, 8)
    gla = RecurrentState(kind="gla", recurrent=torch.zeros(2, 16, 4), conv=torch.zeros(2, 3, 16))
    check_bad_inputs(mixer, x, gla)
    _, mamba2_state = Mamba2(8, Mamba2Config(d_state=4, head_dim=4, chunk_size=4))(x)
    check_bad_inputs(mixer, x, mamba2_state)


def test_bad_config():
    with pytest.raises(ValueError, match="dt_rank"):
        Mamba1(8, Mamba1Config(dt_rank="big"))
    with pytest.raises(ValueError, match="dt_init"):
        Mamba1(8, Mamba1Config(dt_init="zeros"))


def test_init():
    torch.manual_seed(0)
    config = Mamba1Config(d_state=6, dt_min=0.01, dt_max=0.05, dt_scale=2.0)
    mixer = Mamba1(40, config)  # d_inner 80, dt_rank ceil(40 / 16) = 3
    assert mixer.dt_rank == 3 and mixer.x_proj.weight.shape == (3 + 12, 80)
    assert torch.equal(mixer.A_log, torch.log(torch.arange(1.0, 7.0)).expand(80, 6))
    assert torch.equal(mixer.D, torch.ones(80))
    dt = F.softplus(mixer.dt_proj.bias)
    assert dt.min() >= 0.01 * (1 - 1e-5) and dt.max() <= 0.05 * (1 + 1e-5)
    std = 3 ** -0.5 * 2.0
    assert mixer.dt_proj.weight.abs().max() <= std and mixer.dt_proj.weight.std() > std / 4
    assert mixer.conv1d.weight.shape == (80, 4)
    flagged = {n for n, p in mixer.named_parameters() if getattr(p, "_no_weight_decay", False)}
    assert flagged == {"A_log", "D", "dt_proj.bias", "conv1d.bias"}


# --- parity with transformers' MambaMixer, pure-PyTorch path --------------------------------

def hf_mamba(monkeypatch, d_model, config: Mamba1Config):
    modeling = pytest.importorskip("transformers.models.mamba.modeling_mamba",
                                   reason="transformers is needed for the parity test")
    from transformers import MambaConfig

    hf_config = MambaConfig(hidden_size=d_model, state_size=config.d_state, expand=config.expand,
                            conv_kernel=config.d_conv, time_step_rank=config.dt_rank,
                            use_bias=config.bias, use_conv_bias=config.conv_bias,
                            num_hidden_layers=1, use_mambapy=False, use_associative_scan=False)
    calls = force_module_pure_path(monkeypatch, modeling, [
        "mamba_inner_fn", "mamba_selective_scan", "mamba_selective_state_update",
        "causal_conv1d_fn", "causal_conv1d_update"])
    hf = modeling.MambaMixer(hf_config, layer_idx=0)
    with torch.no_grad():  # move every parameter off its init so that each one matters
        for p in hf.parameters():
            p.add_(0.2 * torch.randn_like(p))
    ours = Mamba1(d_model, config)
    copy_from_hf(ours, hf)
    return hf, ours, calls, hf_config


def test_parity_with_transformers(monkeypatch):
    torch.manual_seed(0)
    d_model, config = 16, Mamba1Config(d_state=4, dt_rank=3, bias=True)
    hf, ours, calls, _ = hf_mamba(monkeypatch, d_model, config)
    x = torch.randn(2, 19, d_model)
    weight = torch.randn(2, 19, d_model)
    from_hf = output_and_grads(hf, x, weight)
    assert calls["mamba_selective_scan"] == 1 and calls["causal_conv1d_fn"] == 1
    assert calls["mamba_inner_fn"] == 1  # training mode: the fused call was tried, returned None
    assert_same_output_and_grads(output_and_grads(ours, x, weight), from_hf)


@needs_parity_transformers
def test_decoding_parity_with_transformers_cache(monkeypatch):
    """Prefill then token steps with HF's cache == our carried state (outputs and states)."""
    DynamicCache = pytest.importorskip("transformers").DynamicCache
    torch.manual_seed(1)
    d_model, config = 8, Mamba1Config(d_state=4, d_conv=3)
    hf, ours, calls, hf_config = hf_mamba(monkeypatch, d_model, config)
    hf.eval()
    x = torch.randn(2, 9, d_model)
    cache = DynamicCache(config=hf_config)
    state = None
    with torch.no_grad():
        for piece in x.split([5, 1, 1, 1, 1], dim=1):
            y_hf = hf(piece, cache=cache)
            y, state = ours(piece, state)
            assert rel_err(y, y_hf) <= 1e-5, rel_err(y, y_hf)
    assert calls["mamba_selective_state_update"] == 4 and calls["causal_conv1d_update"] == 4
    assert rel_err(state.recurrent, cache.get_recurrent_state(0)) <= 1e-5
    # HF keeps the last W inputs channel-first [B, C, W]; we keep the last W - 1, time-first
    hf_conv = cache.get_conv_state(0)
    assert rel_err(state.conv, hf_conv[..., 1:].transpose(1, 2)) <= 1e-6
    assert state.offset == 9
