"""RMSNorm, SwiGLU and GLA's decay keep only what their backward needs: values and gradients
equal the plain formulas (float64, written out here), bf16 autocast stays close to the plain
path, and the bytes saved per token stay within budgets computed here from the shapes."""

from __future__ import annotations

import pytest
import torch

from hybridzoo.layers import GLA, GLAConfig, MIXERS, RMSNorm, SwiGLU
from hybridzoo.utils import rel_err
from hybridzoo.memory import saved_bytes_per_token
from tests.layers.saved_bytes import saved_tensors

D, HIDDEN, EPS = 24, 40, 1e-6


def _grads(out, leaves, seed=1):
    torch.manual_seed(seed)
    weight = torch.randn_like(out)
    return torch.autograd.grad((out * weight).sum(), leaves)


def _plain_rms_norm(x, weight, zero_centered):
    w = 1 + weight if zero_centered else weight
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + EPS) * w


def _silu(g):
    return g / (1 + torch.exp(-g))


@pytest.mark.parametrize("zero_centered", [False, True])
def test_rms_norm_float64_values_and_gradients_are_the_formula(zero_centered):
    torch.manual_seed(0)
    norm = RMSNorm(D, EPS, zero_centered).double()
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(2, 7, D, dtype=torch.float64, requires_grad=True)
    y = norm(x)
    ref = _plain_rms_norm(x, norm.weight, zero_centered)
    assert y.dtype == torch.float64 and (y - ref).abs().max() < 1e-12
    for got, want in zip(_grads(y, (x, norm.weight)), _grads(ref, (x, norm.weight))):
        assert (got - want).abs().max() < 1e-12


def test_swiglu_float64_values_and_gradients_are_the_formula():
    torch.manual_seed(0)
    mlp = SwiGLU(D, HIDDEN).double()
    x = torch.randn(2, 7, D, dtype=torch.float64, requires_grad=True)
    y = mlp(x)
    weights = (mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight)
    ref = (_silu(x @ weights[0].T) * (x @ weights[1].T)) @ weights[2].T
    assert (y - ref).abs().max() < 1e-12
    for got, want in zip(_grads(y, (x, *weights)), _grads(ref, (x, *weights))):
        assert (got - want).abs().max() < 1e-12


@pytest.mark.parametrize("clamp_min", [None, -0.02])
def test_gla_decay_float64_values_and_gradients_are_the_formula(clamp_min):
    torch.manual_seed(0)
    cfg = GLAConfig(num_heads=2, gate_logit_normalizer=4.0, clamp_min=clamp_min)
    mixer = GLA(D, cfg).double()
    with torch.no_grad():
        for p in mixer.gk_proj.parameters():
            p.normal_()
    x = torch.randn(2, 7, D, dtype=torch.float64, requires_grad=True)
    log_a = mixer.decays(x)
    gk = mixer.gk_proj(x)
    ref = -torch.log(1 + torch.exp(-gk)) / 4.0
    if clamp_min is not None:
        ref = torch.maximum(ref, torch.tensor(clamp_min, dtype=ref.dtype))
        assert (ref == clamp_min).any() and (ref > clamp_min).any()  # both branches are exercised
    ref = ref.unflatten(-1, (2, -1))
    assert log_a.dtype == torch.float64 and (log_a - ref).abs().max() < 1e-12
    leaves = (x, *mixer.gk_proj.parameters())
    for got, want in zip(_grads(log_a, leaves), _grads(ref, leaves)):
        assert (got - want).abs().max() < 1e-12


def _plain_block_mlp_half(norm, mlp, x):
    """The block's MLP half written with plain torch ops (autocast applies to its linears)."""
    h = _plain_rms_norm(x.float(), norm.weight, norm.zero_centered).to(x.dtype)
    return x + mlp.down_proj(torch.nn.functional.silu(mlp.gate_proj(h)) * mlp.up_proj(h))


def test_bf16_autocast_is_close_to_the_plain_path():
    torch.manual_seed(0)
    norm, mlp = RMSNorm(D, EPS), SwiGLU(D, HIDDEN)
    x = torch.randn(2, 16, D, requires_grad=True)
    params = (x, norm.weight, *mlp.parameters())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = x + mlp(norm(x))
        plain = _plain_block_mlp_half(norm, mlp, x)
    assert ours.dtype == plain.dtype == torch.float32
    assert rel_err(ours, plain) < 1e-2
    for got, want, p in zip(_grads(ours, params), _grads(plain, params), params):
        assert got.dtype == want.dtype == p.dtype  # fp32 master weights get fp32 gradients
        assert rel_err(got, want) < 2e-2


def test_bf16_gla_decay_is_close_to_the_plain_path():
    torch.manual_seed(0)
    mixer = GLA(D, GLAConfig(num_heads=2, clamp_min=-0.05))
    x = torch.randn(2, 16, D, requires_grad=True)
    leaves = (x, *mixer.gk_proj.parameters())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = mixer.decays(x)
        gk = mixer.gk_proj(x).float()
        plain = (torch.nn.functional.logsigmoid(gk) / 16.0).clamp_min(-0.05).unflatten(-1, (2, -1))
    assert ours.dtype == torch.float32 and rel_err(ours, plain) < 1e-6
    for got, want in zip(_grads(ours, leaves), _grads(plain, leaves)):
        assert got.dtype == want.dtype and rel_err(got, want) < 1e-2


# ---- what is kept for the backward ----------------------------------------------------------
B, T = 2, 16


def test_block_mlp_half_saves_x_rstd_and_the_two_projections_only():
    """x + mlp(mlp_norm(x)) under bf16 autocast keeps, per token: x (float32, 4 D bytes), its
    rstd (4), one bf16 copy of the normalised x shared by gate_proj and up_proj (2 D), and their
    bf16 outputs (2 x 2 HIDDEN): nothing else grows with the tokens."""
    torch.manual_seed(0)
    norm, mlp = RMSNorm(D, EPS), SwiGLU(D, HIDDEN)

    def run(length):
        x = torch.randn(B, length, D, requires_grad=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return x + mlp(norm(x))

    budget = 4 * D + 4 + 2 * D + 2 * 2 * HIDDEN
    per_token = saved_bytes_per_token(run, T, B, parameters=(norm.weight, *mlp.parameters()))
    assert per_token <= budget, (per_token, budget)


def test_gla_decay_saves_no_float32_copy():
    """decays(x) under bf16 autocast keeps per token: the bf16 x for gk_proj[0] (2 D), the
    bf16 low-rank activation (2 rank) and the bf16 gate logits (2 key_dim): no float32 copies."""
    torch.manual_seed(0)
    cfg = GLAConfig(num_heads=2, gate_low_rank_dim=8)
    mixer = GLA(D, cfg)

    def run(length):
        x = torch.randn(B, length, D, requires_grad=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return mixer.decays(x)

    budget = 2 * D + 2 * cfg.gate_low_rank_dim + 2 * mixer.key_dim
    per_token = saved_bytes_per_token(run, T, B, parameters=tuple(mixer.parameters()))
    assert per_token <= budget, (per_token, budget)


@pytest.mark.parametrize("kind", ["gla", "retnet", "gdn", "attn"])
def test_projections_share_one_autocast_copy_of_the_input(kind):
    """Under bf16 autocast the mixer's projections of x keep one bf16 copy of it between them
    (each projection casting for itself kept one each)."""
    torch.manual_seed(0)
    mixer_cls, config_cls = MIXERS[kind]
    mixer = mixer_cls(32, config_cls(), backend="reference")
    x = torch.randn(B, T, 32, requires_grad=True)

    def run():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return mixer(x * 1.0)[0]  # not a leaf, as in a model (autocast caches a leaf's casts)

    cast = x.detach().to(torch.bfloat16)
    copies = {t.untyped_storage().data_ptr() for t in saved_tensors(run)
              if t.dtype == torch.bfloat16 and t.numel() == cast.numel() and torch.equal(t.reshape(cast.shape), cast)}
    assert len(copies) == 1
