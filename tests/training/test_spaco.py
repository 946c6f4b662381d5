"""SpaCO tested as an estimator: over many seeded draws, the mean SpaCO gradient converges to the
exact gradient (autograd of one full forward) within a bound set by the draws' own measured spread,
and each chunk is drawn independently with probability p (binomial bounds).

A biased draw (chunks kept with probability 3.5 p but scaled by 1 / p) fails both.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from hybridzoo import HybridLM
from hybridzoo.layers.attention import Attention
from hybridzoo.training.seco_engine import seco_step
from tests.zoo.tiny import tiny_config

T, CHUNK, VOCAB = 8, 2, 37  # k = 4 chunks
Z = 4.5  # a normal tail beyond 4.5 sigma: 7e-6 per check, so a correct estimator fails ~never

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def small_model(seed: int) -> HybridLM:
    """float64 Gated DeltaNet (a relayed Markov state) + full attention (relayed K/V gradients)."""
    torch.manual_seed(seed)
    model = HybridLM(tiny_config("gdn attn", d_model=16, d_mlp=16))
    model.blocks[1].mixer = Attention(16, dataclasses.replace(model.config.attn, window=None))
    model = model.double()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.2 * torch.randn_like(param))
    return model


def flat_grad(model: HybridLM) -> torch.Tensor:
    grad = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten()
                      for p in model.parameters()])
    model.zero_grad(set_to_none=True)
    return grad


def draws(model, batch, budget: int, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(gradients [n, P], selections [n, k] bool)`` of ``n`` seeded SpaCO steps."""
    generator = torch.Generator().manual_seed(seed)
    grads, selections = [], []
    for _ in range(n):
        result = seco_step(model, batch, CHUNK, spaco_budget=budget, generator=generator)
        grads.append(flat_grad(model))
        selections.append(result.selected)
    return torch.stack(grads), torch.tensor(selections)


@pytest.mark.parametrize("budget", [1, 2], ids=lambda b: f"p={b}/4")
def test_spaco_mean_gradient_converges_to_the_exact_gradient(budget):
    n = 150
    model = small_model(0)
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (2, T), generator=generator)
    batch = {"input_ids": ids, "labels": ids}
    _, _, loss = model(input_ids=ids, labels=ids)
    loss.backward()
    exact = flat_grad(model)
    grads, selections = draws(model, batch, budget, n, seed=budget)
    k, p = T // CHUNK, budget / (T // CHUNK)

    # each chunk drawn with probability p (binomial), independently of the others (pairs: p^2)
    counts = selections.sum(0).double()
    assert (counts - n * p).abs().max() <= Z * math.sqrt(n * p * (1 - p)), (counts, n * p)
    pairs = (selections[:, :, None] & selections[:, None, :]).sum(0).double()
    off_diagonal = pairs[~torch.eye(k, dtype=torch.bool)]
    assert (off_diagonal - n * p * p).abs().max() <= Z * math.sqrt(n * p * p * (1 - p * p)), pairs

    # the mean gradient: along the exact gradient and along fixed random directions, the error of
    # the mean stays within Z standard errors measured from the draws themselves
    directions = torch.randn(4, exact.numel(), generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    directions[0] = exact
    directions = directions / directions.norm(dim=1, keepdim=True)
    projected, target = grads @ directions.T, directions @ exact  # [n, 4], [4]
    spread = projected.std(dim=0)
    assert (spread > 1e-3 * target.abs().max()).all()  # a real random estimate, not a constant
    error = (projected.mean(0) - target).abs()
    assert (error <= Z * spread / math.sqrt(n)).all(), (error, Z * spread / math.sqrt(n))
    # the whole vector: E|mean - exact|^2 = E|draw - exact|^2 / n for an unbiased estimate
    mean_error = (grads.mean(0) - exact).norm()
    rms_draw_error = (grads - exact).norm(dim=1).square().mean().sqrt()
    assert mean_error <= 3 * rms_draw_error / math.sqrt(n), (mean_error, rms_draw_error)


def test_draws_follow_the_seed_and_a_budget_of_at_least_k_chunks_is_exact_seco():
    """The generator decides the draws (same seed, same chunks; another seed, others); with
    ``spaco_budget >= k`` every chunk is recomputed with weight exactly 1 (p = min(1, t / k))."""
    from hybridzoo.training.seco_engine import SeCOError, _select

    def pattern(seed):
        generator = torch.Generator().manual_seed(seed)
        return [_select(16, 4, None, generator) for _ in range(4)]

    assert pattern(5) == pattern(5) and pattern(5) != pattern(6)
    assert {w for draw in pattern(5) for w in draw} == {0.0, 4.0}  # kept chunks weigh 1 / p = 16 / 4
    for budget in (3, 4, 10):
        assert _select(3, budget, None, torch.Generator().manual_seed(0)) == [1.0, 1.0, 1.0]
    assert _select(3, None, None, None) == [1.0, 1.0, 1.0]
    assert _select(4, 2, [True, False, False, True], None) == [2.0, 0.0, 0.0, 2.0]
    with pytest.raises(SeCOError, match=r"^SeCO: selection must have one entry per chunk \(4\), got 2$"):
        _select(4, 2, [True, False], None)
    with pytest.raises(SeCOError, match="^SeCO: selection is a SpaCO option; give spaco_budget too$"):
        _select(4, None, [True] * 4, None)
