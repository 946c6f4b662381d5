"""Training, not only one forward: each mixer learns exactly as an independent implementation.

For every mixer kind, the same weights go into a 2-block ``HybridLM`` (reference kernels, float64)
and into :class:`tests.training.step_loops.LoopLM` (plain loops over time written from the papers'
equations, no hybridzoo code). Both take 20 AdamW steps (weight decay, gradient clipping) on the
same tiny MQAR batches; hybridzoo's optimizer groups come from
:func:`hybridzoo.training.module.param_groups`, the loop's from its own rule. The loss curves
and the final weights must agree to 1e-8. A wrong gradient anywhere in a mixer (or a parameter
put in the wrong weight-decay group) changes the weights after the first step and fails here;
an initialisation is not tested (both start from the same weights).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybridzoo import HybridConfig, HybridLM
from hybridzoo.training.module import param_groups
from tests.training.step_loops import LoopLM

pytestmark = pytest.mark.usefixtures("one_thread")

STEPS, LR, WEIGHT_DECAY, CLIP = 20, 1e-2, 0.1, 1.0
VOCAB, SEQ_LEN, PAIRS, BATCH = 16, 14, 2, 3  # T = 14: not a multiple of the chunk size 8

SETTINGS = {
    "mamba1": dict(d_state=4),
    "mamba2": dict(d_state=4, head_dim=8, chunk_size=8),
    "gla": dict(num_heads=2, expand_k=0.5, expand_v=1.0, use_short_conv=True, gate_low_rank_dim=4, chunk_size=8),
    "retnet": dict(num_heads=2, expand_k=0.5, expand_v=1.0, use_short_conv=True, chunk_size=8),
    "gdn": dict(num_k_heads=1, num_v_heads=2, head_k_dim=8, head_v_dim=8, chunk_size=8),
    "attn": dict(n_heads=2, n_kv_heads=1),
}


def mqar_batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``steps`` batches of Zoology-style MQAR: pairs k v, then each key queried once later;
    labels -100 except after a query (the value). Built here, independently of hybridzoo's data."""
    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(steps):
        ids = torch.randint(VOCAB, (BATCH, SEQ_LEN), generator=g)
        labels = torch.full((BATCH, SEQ_LEN), -100)
        for b in range(BATCH):
            keys = torch.randperm(VOCAB // 2 - 1, generator=g)[:PAIRS] + 1
            values = torch.randperm(VOCAB // 2, generator=g)[:PAIRS] + VOCAB // 2
            slots = torch.randperm((SEQ_LEN - 2 * PAIRS) // 2, generator=g)[:PAIRS]
            ids[b, 0:2 * PAIRS:2], ids[b, 1:2 * PAIRS:2] = keys, values
            queries = 2 * PAIRS + 2 * slots
            ids[b, queries], labels[b, queries + 1] = keys, values
        batches.append((ids, labels))
    return batches


def loop_loss(model: LoopLM, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = model(ids)
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)


def train(model, groups, loss_fn, batches) -> list[float]:
    optimizer = torch.optim.AdamW(groups, lr=LR, betas=(0.9, 0.95))
    losses = []
    for ids, labels in batches:
        loss = loss_fn(ids, labels)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(model.parameters()), CLIP)
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses


@pytest.mark.parametrize("kind", list(SETTINGS))
def test_adamw_steps_match_an_independent_step_loop(kind):
    torch.manual_seed(0)
    config = HybridConfig(vocab_size=VOCAB, d_model=16, n_layers=2, layers=kind, d_mlp=32,
                          backend="reference", **{kind: SETTINGS[kind]})
    model = HybridLM(config).double()
    with torch.no_grad():  # move the norms off 1 (and Mamba's D off 1), so their gradients count
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    start = {n: p.detach().clone() for n, p in model.named_parameters()}  # the tied head once
    loop = LoopLM(config, {n: p.shape for n, p in start.items()}).double()
    loop.copy_from(start)
    batches = mqar_batches(STEPS)

    hz_losses = train(model, param_groups(model, WEIGHT_DECAY),
                      lambda ids, labels: model(ids, labels=labels)[2], batches)
    loop_losses = train(loop, loop.param_groups(WEIGHT_DECAY),
                        lambda ids, labels: loop_loss(loop, ids, labels), batches)

    assert torch.isfinite(torch.tensor(hz_losses)).all(), hz_losses
    curve_gap = max(abs(a - b) for a, b in zip(hz_losses, loop_losses))
    assert curve_gap < 1e-8, f"{kind}: loss curves differ by {curve_gap:.3g}\n{hz_losses}\n{loop_losses}"
    for name, p in model.named_parameters():
        gap = (p.detach() - loop.p(name)).abs().max().item()
        moved = (p.detach() - start[name]).abs().max().item()
        assert gap < 1e-8, f"{kind}: final {name} differs by {gap:.3g} (moved {moved:.3g})"
        assert moved > 1e-3, f"{kind}: {name} did not train (moved {moved:.3g}): the test would not see it"


@pytest.mark.parametrize("num_v_heads", [2, 4])
def test_gdn_starts_from_fla_layers_weights_under_the_same_seed(num_v_heads):
    """hybridzoo's GatedDeltaNet draws its weights in the order and from the distributions of fla's
    GatedDeltaNet layer: under one seed the two layers' initial weights are equal, decays included
    (so a benchmark seed gives both implementations the same draw)."""
    fla_layers = pytest.importorskip("fla.layers")
    from hybridzoo.layers import GatedDeltaNet, GatedDeltaNetConfig

    for seed in range(3):
        torch.manual_seed(seed)
        ref = fla_layers.GatedDeltaNet(hidden_size=32, head_dim=16, num_heads=2, num_v_heads=num_v_heads, expand_v=1.5)
        torch.manual_seed(seed)
        ours = GatedDeltaNet(32, GatedDeltaNetConfig(num_k_heads=2, num_v_heads=num_v_heads, head_k_dim=16,
                                                     head_v_dim=24))
        expected = {
            "in_proj_qkv.weight": torch.cat([ref.q_proj.weight, ref.k_proj.weight, ref.v_proj.weight]),
            "conv1d.weight": torch.cat([ref.q_conv1d.weight, ref.k_conv1d.weight, ref.v_conv1d.weight]).squeeze(1),
            "in_proj_z.weight": ref.g_proj.weight, "in_proj_a.weight": ref.a_proj.weight,
            "in_proj_b.weight": ref.b_proj.weight, "A_log": ref.A_log, "dt_bias": ref.dt_bias,
            "norm.weight": ref.o_norm.weight, "out_proj.weight": ref.o_proj.weight,
        }
        state = ours.state_dict()
        assert set(state) == set(expected)
        for name, value in expected.items():
            assert torch.equal(state[name], value.detach()), (seed, name)


@pytest.mark.parametrize("kind", ["mamba1", "mamba2"])
def test_mamba_starts_from_mamba_ssm_weights_under_the_same_seed(kind):
    """As above for mamba_ssm's ``Mamba`` and ``Mamba2`` (skipped where mamba_ssm is not built)."""
    mamba_ssm = pytest.importorskip("mamba_ssm")
    from hybridzoo.layers import Mamba1, Mamba1Config, Mamba2, Mamba2Config

    torch.manual_seed(0)
    if kind == "mamba1":
        ref = mamba_ssm.Mamba(d_model=32, d_state=8, d_conv=4, expand=2)
        torch.manual_seed(0)
        ours = Mamba1(32, Mamba1Config(d_state=8))
    else:
        ref = mamba_ssm.Mamba2(d_model=32, d_state=8, d_conv=4, expand=2, headdim=16, ngroups=1, chunk_size=16)
        torch.manual_seed(0)
        ours = Mamba2(32, Mamba2Config(d_state=8, head_dim=16, chunk_size=16))
    theirs = {name: value.squeeze(1) if name == "conv1d.weight" else value for name, value in ref.state_dict().items()}
    for name, value in ours.state_dict().items():
        assert torch.equal(value, theirs[name]), name
