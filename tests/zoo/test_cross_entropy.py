"""lm_loss / token_cross_entropy: the formula's values and gradients in float64 (ignored
positions, mean and sum, several row chunks), bf16 logits close to F.cross_entropy on their
float32 upcast, and only the logits as given plus a float32 log-sum-exp kept for the backward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybridzoo.utils import rel_err
from hybridzoo.zoo import cross_entropy
from hybridzoo.zoo.model import lm_loss
from hybridzoo.memory import saved_bytes_per_token

B, T, V = 3, 7, 13


def _data(dtype, seed=0):
    torch.manual_seed(seed)
    logits = (3 * torch.randn(B, T, V, dtype=dtype)).requires_grad_()
    targets = torch.randint(0, V, (B, T))
    targets[0, :3] = -100
    targets[2, -1] = -100
    return logits, targets


def _plain_loss(logits, targets, reduction):
    """log(sum(exp(z))) - z[target] per labelled position; mean or sum over them."""
    z = logits.flatten(0, 1)
    t = targets.flatten()
    keep = t != -100
    rows = torch.log(torch.exp(z[keep]).sum(-1)) - z[keep].gather(1, t[keep, None])[:, 0]
    return rows.sum() if reduction == "sum" else rows.sum() / keep.sum()


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("chunk_elements", [1 << 24, 2 * V])  # one chunk of rows; 2 rows a chunk
def test_float64_values_and_gradients_are_the_formula(reduction, chunk_elements, monkeypatch):
    monkeypatch.setattr(cross_entropy, "_CHUNK_ELEMENTS", chunk_elements)
    logits, targets = _data(torch.float64)
    loss = lm_loss(logits, targets, reduction=reduction)
    ref = _plain_loss(logits, targets, reduction)
    assert loss.dtype == torch.float64 and abs(loss.item() - ref.item()) < 1e-12
    (grad,) = torch.autograd.grad(loss * 1.7, logits)
    (want,) = torch.autograd.grad(ref * 1.7, logits)
    assert (grad - want).abs().max() < 1e-12
    assert grad[0, :3].abs().max() == 0  # ignored positions get no gradient


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_bf16_logits_are_close_to_cross_entropy_of_their_float32_upcast(reduction):
    logits, targets = _data(torch.bfloat16)
    loss = lm_loss(logits, targets, reduction=reduction)
    ref = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=-100, reduction=reduction)
    assert loss.dtype == torch.float32 and rel_err(loss, ref) < 1e-6
    (grad,) = torch.autograd.grad(loss, logits)
    (want,) = torch.autograd.grad(ref, logits)
    assert grad.dtype == torch.bfloat16 and rel_err(grad.float(), want.float()) < 1e-2


def test_no_labelled_position_gives_nan_mean_and_zero_gradient():
    logits, _ = _data(torch.float64)
    targets = torch.full((B, T), -100)
    loss = lm_loss(logits, targets)
    assert torch.isnan(loss) and torch.isnan(F.cross_entropy(logits.flatten(0, 1), targets.flatten()))
    (grad,) = torch.autograd.grad(loss, logits)
    assert (grad == 0).all()


def test_bad_inputs_give_clear_errors():
    logits, targets = _data(torch.float32)
    with pytest.raises(ValueError, match="reduction"):
        lm_loss(logits, targets, reduction="max")
    with pytest.raises(ValueError, match=r"logits \[N, V\] and targets \[N\]"):
        cross_entropy.token_cross_entropy(logits.flatten(0, 1), targets)


def test_keeps_only_the_logits_and_a_float32_lse():
    """Per token: the bf16 logits (2 V bytes), the int64 target (8) and one float32 lse (4);
    no float32 [tokens, V] copy."""
    def run(length):
        logits = torch.randn(B, length, V, dtype=torch.bfloat16, requires_grad=True)
        return lm_loss(logits, torch.randint(0, V, (B, length)))

    budget = 2 * V + 8 + 4
    per_token = saved_bytes_per_token(run, T, B)
    assert per_token <= budget, (per_token, budget)
