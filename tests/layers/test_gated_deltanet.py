"""Gated DeltaNet mixer: the state contract, bad inputs, init, and parity with Hugging Face's
pure-PyTorch ``Qwen3NextGatedDeltaNet`` and ``Qwen3_5GatedDeltaNet``."""

from __future__ import annotations

import importlib
import math

import pytest
import torch
import torch.nn.functional as F

from hybridzoo.layers import RecurrentState
from hybridzoo.layers.gated_deltanet import GatedDeltaNet, GatedDeltaNetConfig, convert_hf_weights
from hybridzoo.utils import rel_err
from tests.hf_pure import force_pure_path, needs_parity_transformers
from tests.layers.contract import check_bad_inputs, check_pieces_and_decoding

D_MODEL = 8


def tiny(num_k_heads=2, num_v_heads=2, head_k_dim=4, head_v_dim=3, **kw) -> GatedDeltaNetConfig:
    return GatedDeltaNetConfig(num_k_heads=num_k_heads, num_v_heads=num_v_heads,
                               head_k_dim=head_k_dim, head_v_dim=head_v_dim, **kw)


@pytest.mark.parametrize("config", [
    tiny(chunk_size=4),                                                  # H == Hk
    tiny(num_k_heads=1, num_v_heads=2, head_k_dim=5, chunk_size=5),      # H == 2 Hk
    tiny(num_k_heads=2, num_v_heads=4, head_v_dim=2, conv_size=2, chunk_size=64),
], ids=["heads_equal", "v_heads_2x", "v_heads_2x_conv2_one_chunk"])
def test_pieces_and_decoding(config):
    torch.manual_seed(0)
    mixer = GatedDeltaNet(D_MODEL, config).double()
    x = torch.randn(2, 23, D_MODEL, dtype=torch.float64)
    check_pieces_and_decoding(mixer, x)


def test_state_shapes_and_offset():
    torch.manual_seed(0)
    config = tiny(num_k_heads=1, num_v_heads=2, chunk_size=4)
    mixer = GatedDeltaNet(D_MODEL, config)
    _, state = mixer(torch.randn(3, 7, D_MODEL))
    assert state.kind == "gdn" and state.offset == 7
    assert state.recurrent.shape == (3, 2, 4, 3) and state.recurrent.dtype == torch.float32
    assert state.conv.shape == (3, 3, mixer.conv_dim) and mixer.conv_dim == 2 * 4 + 2 * 3
    _, state = mixer(torch.randn(3, 1, D_MODEL), state)
    assert state.offset == 8


def test_bad_inputs():
    torch.manual_seed(0)
    mixer = GatedDeltaNet(D_MODEL, tiny(chunk_size=4)).double()
    x = torch.randn(2, 5, D_MODEL, dtype=torch.float64)
    foreign = RecurrentState(kind="mamba2", recurrent=torch.zeros(2, 2, 4, 3, dtype=torch.float64),
                             conv=torch.zeros(2, 3, mixer.conv_dim, dtype=torch.float64))
    check_bad_inputs(mixer, x, foreign)


def test_bad_config():
    with pytest.raises(ValueError, match="num_v_heads 3 is not a multiple of num_k_heads 2"):
        GatedDeltaNet(D_MODEL, tiny(num_k_heads=2, num_v_heads=3))
    with pytest.raises(ValueError, match="head_k_dim must be >= 1"):
        GatedDeltaNet(D_MODEL, tiny(head_k_dim=0))


@pytest.mark.parametrize("heads", [1, 2, 5])
def test_multiscale_decay_init_spans_the_memory_range(heads):
    """``decay_init="multiscale"``: the initial decays ``exp(-A softplus(dt_bias))`` are
    ``1 - 1/L`` with ``L`` log-spaced over ``memory_range`` (one head: the geometric mean), the
    step sizes stay fla's draws, and every other weight is the one fla's init gives."""
    memory_range = (4.0, 4096.0)
    torch.manual_seed(3)
    fla_init = GatedDeltaNet(D_MODEL, tiny(num_k_heads=1, num_v_heads=heads))
    torch.manual_seed(3)
    mixer = GatedDeltaNet(D_MODEL, tiny(num_k_heads=1, num_v_heads=heads, decay_init="multiscale",
                                        memory_range=memory_range))
    decay = torch.exp(-mixer.A_log.detach().double().exp() * F.softplus(mixer.dt_bias.detach().double()))
    memory = 1.0 / (1.0 - decay)
    expected = ([math.sqrt(memory_range[0] * memory_range[1])] if heads == 1 else
                [memory_range[0] * (memory_range[1] / memory_range[0]) ** (h / (heads - 1)) for h in range(heads)])
    assert torch.allclose(memory, torch.tensor(expected, dtype=torch.float64), rtol=1e-4)
    for (name, a), (_, b) in zip(fla_init.named_parameters(), mixer.named_parameters()):
        if name != "A_log":
            assert torch.equal(a, b), name


def test_bad_decay_init():
    with pytest.raises(ValueError, match="decay_init must be 'fla' or 'multiscale'"):
        GatedDeltaNet(D_MODEL, tiny(decay_init="retnet"))
    with pytest.raises(ValueError, match="memory_range must be"):
        GatedDeltaNet(D_MODEL, tiny(decay_init="multiscale", memory_range=(1.0, 10.0)))


def test_init_and_no_weight_decay():
    torch.manual_seed(0)
    config = GatedDeltaNetConfig(num_k_heads=2, num_v_heads=512, head_k_dim=2, head_v_dim=2)
    mixer = GatedDeltaNet(4, config)
    dt = F.softplus(mixer.dt_bias.detach())
    assert dt.min() >= config.dt_min * (1 - 1e-5) and dt.max() <= config.dt_max * (1 + 1e-5)
    log_dt = dt.log()  # log-uniform: the log of dt is spread over the whole range
    assert log_dt.min() < math.log(0.002) and log_dt.max() > math.log(0.05)
    A = mixer.A_log.detach().exp()
    assert A.min() >= 0.01 and A.max() <= 16.0 and A.max() > 12.0 and torch.isfinite(mixer.A_log).all()
    assert (mixer.norm.weight == 1).all()
    no_decay = {name for name, p in mixer.named_parameters() if getattr(p, "_no_weight_decay", False)}
    assert no_decay == {"dt_bias", "A_log", "norm.weight"}
    assert all(m.bias is None for m in (mixer.in_proj_qkv, mixer.in_proj_z, mixer.in_proj_b,
                                        mixer.in_proj_a, mixer.out_proj, mixer.conv1d))
    assert GatedDeltaNet(1024).conv_dim == 2 * 6 * 256 + 6 * 512      # fla GDN-340M layout


# --------------------------------------------------------------------------- Hugging Face parity

HF_MODULES = {
    "qwen3_next": ("transformers.models.qwen3_next.modeling_qwen3_next", "Qwen3NextConfig",
                   "Qwen3NextGatedDeltaNet"),
    "qwen3_5": ("transformers.models.qwen3_5.modeling_qwen3_5", "Qwen3_5TextConfig",
                "Qwen3_5GatedDeltaNet"),
}
def hf_pair(variant: str, num_k_heads: int, num_v_heads: int, monkeypatch):
    """A tiny HF GDN layer with random weights (pure path forced), and ours with its weights."""
    pytest.importorskip("transformers", reason="parity with transformers' GDN needs transformers")
    module_name, config_name, layer_name = HF_MODULES[variant]
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        pytest.skip(f"this transformers has no {module_name}")
    config_cls = getattr(importlib.import_module("transformers"), config_name)
    K, V = 4, 3
    hf_config = config_cls(
        hidden_size=D_MODEL, linear_num_key_heads=num_k_heads, linear_num_value_heads=num_v_heads,
        linear_key_head_dim=K, linear_value_head_dim=V, linear_conv_kernel_dim=4,
        num_hidden_layers=1, layer_types=["linear_attention"], num_attention_heads=2,
        num_key_value_heads=1, head_dim=4, vocab_size=11, intermediate_size=8, rms_norm_eps=1e-6,
        hidden_act="silu")
    calls = force_pure_path(monkeypatch, variant)
    torch.manual_seed(0)
    hf = getattr(module, layer_name)(hf_config, layer_idx=0)
    with torch.no_grad():                                     # move the constant inits off 1
        hf.dt_bias.copy_(torch.randn(num_v_heads))
        hf.A_log.copy_(torch.empty(num_v_heads).uniform_(0.1, 4.0).log())
        hf.norm.weight.add_(0.3 * torch.randn(V))
    # ours with a different chunk size than HF's 64, so that several chunks are crossed
    ours = GatedDeltaNet(D_MODEL, tiny(num_k_heads, num_v_heads, K, V, chunk_size=4, norm_eps=1e-6))
    ours.load_state_dict(convert_hf_weights(hf.state_dict(), ours.config))
    return module, hf, hf_config, ours, calls


@pytest.mark.parametrize("variant", ["qwen3_next", "qwen3_5"])
@pytest.mark.parametrize("num_k_heads,num_v_heads", [(2, 2), (2, 4)])
def test_parity_with_hf(variant, num_k_heads, num_v_heads, monkeypatch):
    """Outputs, input gradients and weight gradients (mapped back) within 1e-5 in float32."""
    module, hf, _, ours, calls = hf_pair(variant, num_k_heads, num_v_heads, monkeypatch)
    x = torch.randn(2, 23, D_MODEL, requires_grad=True)
    weight = torch.randn(2, 23, D_MODEL)
    y_hf = hf(x)
    assert calls["torch_chunk_gated_delta_rule"] == 1 and calls["causal_conv1d_fn"] == 1, calls
    (gx_hf, *gw_hf) = torch.autograd.grad((y_hf * weight).sum(), [x, *hf.parameters()])
    y, _ = ours(x)
    (gx, *gw) = torch.autograd.grad((y * weight).sum(), [x, *ours.parameters()])
    assert rel_err(y, y_hf) <= 1e-5, rel_err(y, y_hf)
    assert rel_err(gx, gx_hf) <= 1e-5, rel_err(gx, gx_hf)
    names = [name for name, _ in hf.named_parameters()]
    gw_ref = convert_hf_weights(dict(zip(names, gw_hf)), ours.config)
    for (name, _), g in zip(ours.named_parameters(), gw):
        assert rel_err(g, gw_ref[name]) <= 1e-5, f"{name}: {rel_err(g, gw_ref[name])}"


@needs_parity_transformers
@pytest.mark.parametrize("variant", ["qwen3_next", "qwen3_5"])
def test_cache_parity_with_hf(variant, monkeypatch):
    """Prefill then single-token decoding against HF's cache: outputs and both states."""
    module, hf, hf_config, ours, calls = hf_pair(variant, 2, 4, monkeypatch)
    from transformers.cache_utils import DynamicCache

    x = torch.randn(2, 12, D_MODEL)
    cache, state, sizes = DynamicCache(config=hf_config), None, [9, 1, 1, 1]
    with torch.no_grad():
        for piece in x.split(sizes, dim=1):
            y_hf = hf(piece, cache=cache)
            y, state = ours(piece, state)
            assert rel_err(y, y_hf) <= 1e-5, rel_err(y, y_hf)
            assert rel_err(state.recurrent, cache.get_recurrent_state(0)) <= 1e-5
            hf_conv = cache.get_conv_state(0)                   # [B, conv_dim, W]: last W inputs
            assert torch.equal(state.conv, hf_conv[:, :, 1:].transpose(1, 2))
    assert calls["torch_recurrent_gated_delta_rule"] == 3 and calls["causal_conv1d_update"] == 3, calls
    assert calls["torch_chunk_gated_delta_rule"] == 1, calls


def test_convert_rejects_foreign_weights():
    config = tiny()
    with pytest.raises(ValueError, match="expected the keys"):
        convert_hf_weights({"in_proj.weight": torch.zeros(1)}, config)
    ours = GatedDeltaNet(D_MODEL, tiny(num_k_heads=2, num_v_heads=4))
    hf_like = {k: v for k, v in ours.state_dict().items() if not k.startswith("in_proj")}
    hf_like["in_proj_qkvz.weight"] = torch.zeros(5, D_MODEL)
    hf_like["in_proj_ba.weight"] = torch.zeros(8, D_MODEL)
    with pytest.raises(ValueError, match="do not fit"):
        convert_hf_weights(hf_like, ours.config)
