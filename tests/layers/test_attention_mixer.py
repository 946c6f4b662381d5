"""The attention mixer (kind "attn"): state contract, the K/V store, parity with transformers."""

from __future__ import annotations

import pytest
import torch

from hybridzoo.layers.attention import Attention, AttentionConfig, KVState
from hybridzoo.layers.state import RecurrentState, StateError
from hybridzoo.utils import rel_err
from tests.hf_pure import needs_parity_transformers
from tests.layers.contract import check_bad_inputs, check_pieces_and_decoding

D_MODEL = 16
QWEN3_NEXT_STYLE = dict(n_heads=4, n_kv_heads=2, head_dim=8, qk_norm=True, norm_zero_centered=True,
                        output_gate=True, partial_rotary_factor=0.25)
CONFIGS = {
    "mha": dict(n_heads=4, bias=True),
    "gqa": dict(n_heads=4, n_kv_heads=2),
    "window1": dict(n_heads=4, n_kv_heads=2, window=1),
    "window3": dict(n_heads=4, n_kv_heads=2, window=3),
    "window8": dict(n_heads=4, n_kv_heads=2, window=8, qk_norm=True),
    "qwen3_next": QWEN3_NEXT_STYLE,
    "qwen3_next_window": dict(QWEN3_NEXT_STYLE, window=5),
}


def make(seed: int = 0, d_model: int = D_MODEL, **settings) -> Attention:
    """A float64 mixer with every parameter random (norm weights and biases included)."""
    torch.manual_seed(seed)
    mixer = Attention(d_model, AttentionConfig(**settings)).double()
    with torch.no_grad():
        for p in mixer.parameters():
            p.normal_(0.0, 0.3)
    return mixer


def randn(*shape, seed: int = 1, dtype=torch.float64) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


@pytest.mark.parametrize("name", CONFIGS)
def test_pieces_tokens_and_gradients(name):
    mixer = make(**CONFIGS[name])
    if CONFIGS[name].get("window") == 1:
        # each query sees only itself: softmax of one score is 1, so the output does not depend
        # on q or k and their gradients are rounding noise (~1e-18); compare the others only
        mixer.q_proj.requires_grad_(False)
        mixer.k_proj.requires_grad_(False)
    check_pieces_and_decoding(mixer, randn(2, 23, D_MODEL))


def test_bad_inputs():
    mixer = make(**CONFIGS["gqa"])
    foreign = RecurrentState(kind="gdn", recurrent=torch.zeros(2, 4, 4, 4, dtype=torch.float64))
    check_bad_inputs(mixer, randn(2, 5, D_MODEL), foreign)
    _, state = mixer(randn(2, 5, D_MODEL))
    other = make(**dict(CONFIGS["gqa"], n_kv_heads=4))
    with pytest.raises(StateError, match="k_buf"):  # K/V heads differ
        other(randn(2, 3, D_MODEL), state)


@pytest.mark.parametrize("settings, match", [
    (dict(n_heads=4, n_kv_heads=3), "n_kv_heads"),
    (dict(n_heads=3), "head_dim"),
    (dict(n_heads=4, window=0), "window"),
])
def test_bad_config(settings, match):
    with pytest.raises(ValueError, match=match):
        Attention(D_MODEL, AttentionConfig(**settings))


def decode(mixer, x, state, sizes):
    """Feed x in pieces of the given sizes; return the outputs and every state."""
    outs, states = [], []
    for piece in x.split(sizes, dim=1):
        y, state = mixer(piece, state)
        outs.append(y)
        states.append(state)
    return torch.cat(outs, dim=1), states


@torch.no_grad()
def test_preallocated_decoding_writes_in_place():
    mixer = make(**CONFIGS["gqa"])
    x = randn(2, 20, D_MODEL)
    y_ref, _ = mixer(x)
    state = mixer.init_state(2, 20, dtype=torch.float64)
    assert state.capacity == 20 and state.length == 0 and state.offset == 0
    k_ptr, v_ptr = state.k_buf.data_ptr(), state.v_buf.data_ptr()
    y, states = decode(mixer, x, state, [7] + [1] * 13)  # a prompt, then one token at a time
    assert rel_err(y, y_ref) <= 1e-12
    for s in states:
        assert s.k_buf.data_ptr() == k_ptr and s.v_buf.data_ptr() == v_ptr  # never reallocated
        assert s.k.untyped_storage().data_ptr() == k_ptr == s.k.data_ptr()  # the prefix is a view
        assert s.v.untyped_storage().data_ptr() == v_ptr == s.v.data_ptr()
        assert s.k.shape == (2, s.length, 2, 4)
    assert [s.length for s in states] == [7 + i for i in range(14)]
    assert states[-1].offset == 20
    # the buffer holds the rotated keys: the same as a one-shot call's state
    _, one_shot = mixer(x)
    assert rel_err(states[-1].k, one_shot.k) <= 1e-14 and rel_err(states[-1].v, one_shot.v) <= 1e-14


@torch.no_grad()
def test_buffer_grows_geometrically():
    mixer = make(**CONFIGS["gqa"])
    x = randn(1, 21, D_MODEL)
    y_ref, _ = mixer(x)
    y, states = decode(mixer, x, mixer.init_state(1, 3, dtype=torch.float64), [1] * 21)
    assert rel_err(y, y_ref) <= 1e-12
    assert [s.capacity for s in states] == [3] * 3 + [6] * 3 + [12] * 6 + [24] * 9
    ptrs = [s.k_buf.data_ptr() for s in states]
    assert len(set(ptrs)) == 4  # one copy per doubling, never one per token


@torch.no_grad()
@pytest.mark.parametrize("prealloc", [False, True])
def test_branching_never_overwrites(prealloc):
    """Two continuations of one prompt state: both stay exact (the second copies)."""
    mixer = make(**CONFIGS["gqa"])
    prompt, a, b, c = (randn(2, n, D_MODEL, seed=s) for s, n in ((1, 6), (2, 3), (3, 4), (4, 2)))
    state = mixer.init_state(2, 32, dtype=torch.float64) if prealloc else None
    _, state = mixer(prompt, state)
    _, state = mixer(randn(2, 1, D_MODEL, seed=5), state)  # leaves room in the buffer
    base = torch.cat([prompt, randn(2, 1, D_MODEL, seed=5)], dim=1)
    _, state_a = mixer(a, state)
    _, state_b = mixer(b, state)  # a branch: must not overwrite a's tokens
    assert state_b.k_buf.data_ptr() != state_a.k_buf.data_ptr()
    y_a, _ = mixer(c, state_a)
    y_b, _ = mixer(c, state_b)
    ref_a, _ = mixer(torch.cat([base, a, c], dim=1))
    ref_b, _ = mixer(torch.cat([base, b, c], dim=1))
    assert rel_err(y_a, ref_a[:, -2:]) <= 1e-12
    assert rel_err(y_b, ref_b[:, -2:]) <= 1e-12


@pytest.mark.parametrize("window", [1, 4])
@pytest.mark.parametrize("grad", [False, True])
def test_sliding_window_state_is_bounded(window, grad):
    mixer = make(**dict(CONFIGS["gqa"], window=window))
    x = randn(2, 40, D_MODEL).requires_grad_(grad)
    with torch.set_grad_enabled(grad):
        y_ref, _ = mixer(x)
        y, states = decode(mixer, x, None, [5, 1, 1, 9] + [1] * 24)
    assert rel_err(y, y_ref) <= 1e-12
    for s in states:
        assert s.length == min(window - 1, s.offset)
        assert s.capacity <= (window - 1 if grad else 2 * (window - 1))
    if window > 1:
        # the kept keys are the last window - 1 of a one-shot call's full attention keys
        _, full = make(**CONFIGS["gqa"])(x)
        assert rel_err(states[-1].k, full.k[:, -(window - 1):]) <= 1e-14


def test_gradients_never_write_in_place():
    """With autograd recording through the state, a preallocated buffer is left untouched."""
    mixer = make(**CONFIGS["gqa"])
    x = randn(2, 9, D_MODEL).requires_grad_(True)
    state = mixer.init_state(2, 16, dtype=torch.float64)
    y, states = decode(mixer, x, state, [4, 1, 4])
    assert not state.k_buf.any() and not state.v_buf.any()
    assert all(s.k_buf.requires_grad and s.capacity == s.length for s in states)
    y_ref, _ = mixer(x)
    (g,) = torch.autograd.grad((y * y_ref.detach()).sum(), [x])
    (g_ref,) = torch.autograd.grad((y_ref * y_ref.detach()).sum(), [x])
    assert rel_err(g, g_ref) <= 1e-12


def test_state_fields():
    mixer = make(**CONFIGS["qwen3_next"])
    _, state = mixer(randn(3, 5, D_MODEL))
    assert isinstance(state, KVState) and state.kind == "attn" and state.batch_size == 3
    assert state.k.shape == state.v.shape == (3, 5, 2, 8) and state.offset == 5
    assert mixer.expected_state(3, torch.float64) == {
        "k_buf": ((3, -1, 2, 8), torch.float64), "v_buf": ((3, -1, 2, 8), torch.float64)}
    assert mixer.rotary.rotary_dim == 2
    assert mixer.q_proj.out_features == 2 * 4 * 8


# ---------------------------------------------------------------------------------------------
# parity with transformers (float32, eager attention forced and confirmed)

def count_calls(monkeypatch, module, name):
    calls = []
    original = getattr(module, name)

    def wrapper(*args, **kwargs):
        calls.append(name)
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, wrapper)
    return calls


def run_parity(monkeypatch, ours, hf_module, hf_attn, rotary, mask_fn, T=12):
    """Copy our weights into hf_attn, compare outputs and gradients (input and weights)."""
    assert hf_attn.config._attn_implementation == "eager"
    hf_attn.load_state_dict(ours.state_dict())  # strict: the parameter names match HF's
    calls = count_calls(monkeypatch, hf_module, "eager_attention_forward")
    x = randn(2, T, ours.d_model, seed=7, dtype=torch.float32).requires_grad_(True)
    position_ids = torch.arange(T)[None]
    cos_sin = rotary(x, position_ids)
    mask = mask_fn(config=hf_attn.config, inputs_embeds=x, attention_mask=None, cache=None,
                   position_ids=position_ids)
    assert mask is not None and mask.shape == (2, 1, T, T)
    y_hf, _ = hf_attn(x, position_embeddings=cos_sin, attention_mask=mask)
    assert calls == ["eager_attention_forward"]
    y, _ = ours(x)
    assert rel_err(y, y_hf) <= 1e-5, rel_err(y, y_hf)

    weight = randn(*y.shape, seed=8, dtype=torch.float32)
    names = [n for n, _ in ours.named_parameters()]
    g = torch.autograd.grad((y * weight).sum(), [x, *ours.parameters()])
    hf_params = dict(hf_attn.named_parameters())
    g_hf = torch.autograd.grad((y_hf * weight).sum(), [x, *(hf_params[n] for n in names)])
    for name, a, b in zip(["x", *names], g, g_hf):
        assert rel_err(a, b) <= 1e-5, f"gradient of {name}: {rel_err(a, b)}"
    return y


@needs_parity_transformers
def test_parity_llama_gqa(monkeypatch):
    from transformers import LlamaConfig
    from transformers.masking_utils import create_causal_mask
    from transformers.models.llama import modeling_llama

    config = LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                         attention_bias=True, num_hidden_layers=1, rope_theta=500.0)
    config._attn_implementation = "eager"
    hf = modeling_llama.LlamaAttention(config, layer_idx=0)
    ours = make(d_model=32, n_heads=4, n_kv_heads=2, head_dim=8, bias=True, rope_base=500.0).float()
    run_parity(monkeypatch, ours, modeling_llama, hf, modeling_llama.LlamaRotaryEmbedding(config),
               create_causal_mask)


@needs_parity_transformers
def test_parity_qwen3_next_gated(monkeypatch):
    from transformers import Qwen3NextConfig
    from transformers.masking_utils import create_causal_mask
    from transformers.models.qwen3_next import modeling_qwen3_next

    config = Qwen3NextConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                             num_hidden_layers=1, rms_norm_eps=1e-6)
    config._attn_implementation = "eager"
    assert config.rope_parameters["partial_rotary_factor"] == 0.25
    hf = modeling_qwen3_next.Qwen3NextAttention(config, layer_idx=0)
    ours = make(d_model=32, n_heads=4, n_kv_heads=2, head_dim=16, qk_norm=True, norm_zero_centered=True,
                output_gate=True, partial_rotary_factor=0.25, norm_eps=1e-6).float()
    assert ours.rotary.rotary_dim == 4
    run_parity(monkeypatch, ours, modeling_qwen3_next, hf,
               modeling_qwen3_next.Qwen3NextRotaryEmbedding(config), create_causal_mask)


@needs_parity_transformers
def test_parity_qwen3_sliding_window(monkeypatch):
    from transformers import Qwen3Config
    from transformers.masking_utils import create_sliding_window_causal_mask
    from transformers.models.qwen3 import modeling_qwen3

    window = 4
    config = Qwen3Config(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                         num_hidden_layers=1, use_sliding_window=True, sliding_window=window,
                         max_window_layers=0, layer_types=["sliding_attention"], rms_norm_eps=1e-6)
    config._attn_implementation = "eager"
    hf = modeling_qwen3.Qwen3Attention(config, layer_idx=0)
    assert hf.sliding_window == window
    settings = dict(d_model=32, n_heads=4, n_kv_heads=2, head_dim=8, qk_norm=True, norm_eps=1e-6)
    ours = make(window=window, **settings).float()
    y = run_parity(monkeypatch, ours, modeling_qwen3, hf, modeling_qwen3.Qwen3RotaryEmbedding(config),
                   create_sliding_window_causal_mask)
    # the window matters here: full attention with the same weights gives another output
    y_full, _ = make(**settings).float()(randn(2, 12, 32, seed=7, dtype=torch.float32))
    assert rel_err(y_full, y) > 1e-2


def test_rotary_frequencies_are_kept_per_device_in_float32(monkeypatch):
    """The inverse frequencies are made once per device (a CPU -> GPU copy per call would be a
    stream synchronisation per attention call) and stay float32 when the model is cast."""
    from hybridzoo.layers.rotary import Rotary

    rotary = Rotary(16, rotary_dim=8, base=500.0)
    made = []
    real_arange = torch.arange
    monkeypatch.setattr(torch, "arange", lambda *a, **k: made.append(a) or real_arange(*a, **k))
    first = rotary.inv_freq("cpu")
    assert rotary.inv_freq() is first and rotary.inv_freq(torch.device("cpu")) is first
    assert len(made) == 1
    monkeypatch.undo()
    exact = 500.0 ** -(torch.arange(0, 8, 2, dtype=torch.float64) / 8)
    assert first.dtype == torch.float32 and torch.equal(first, exact.float())
    mixer = Attention(32, AttentionConfig(n_heads=2, n_kv_heads=1, head_dim=16)).to(torch.bfloat16)
    assert mixer.rotary.inv_freq().dtype == torch.float32
