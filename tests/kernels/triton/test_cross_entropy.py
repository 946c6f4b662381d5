"""The two Triton passes of the token cross-entropy against float64 ``F.cross_entropy``, and
``lm_loss`` routed through them (``hybridzoo.kernels.fused.FORCE``). CPU: ``TRITON_INTERPRET=1``;
GPU: a model-size vocabulary in bf16."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybridzoo.kernels.triton import cross_entropy as ce
from hybridzoo.kernels.triton import launch
from hybridzoo.utils import rel_err
from hybridzoo.zoo import cross_entropy as zoo_ce
from hybridzoo.zoo.model import lm_loss
from tests.kernels.triton.fused_calls import force_and_count

F64 = torch.float64


def _case(rows, vocab, dtype, device="cpu", scale=8.0, seed=0):
    torch.manual_seed(seed)
    logits = (torch.randn(rows, vocab, device=device) * scale).to(dtype)
    targets = torch.randint(0, vocab, (rows,), device=device)
    targets[::3] = -100  # ignored rows
    return logits, targets


@pytest.fixture
def poisoned(monkeypatch):
    monkeypatch.setattr(launch, "POISON_OUTPUTS", True)  # an unwritten element shows as NaN


@pytest.mark.parametrize("rows,vocab", [(7, 75), (5, 32), (4, 3)])  # vocab: blocks, one block, under one
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-6)])
def test_passes_equal_float64_cross_entropy(rows, vocab, dtype, tol, poisoned, device="cpu"):
    logits, targets = _case(rows, vocab, dtype, device)
    z = logits.to(F64).requires_grad_()
    want = F.cross_entropy(z, targets, ignore_index=-100, reduction="none")
    grad = torch.randn(rows, dtype=F64, device=device)
    (want_grad,) = torch.autograd.grad(want, z, grad)
    losses, lse = ce.cross_entropy_fwd(logits, targets)
    assert losses.dtype == lse.dtype == torch.float32
    assert rel_err(losses, want) <= tol  # float32 on chip from the same (rounded) inputs
    assert rel_err(lse, torch.logsumexp(logits.to(F64), -1)) <= tol
    assert (losses[targets == -100] == 0).all()
    got_grad = ce.cross_entropy_bwd(grad.float(), logits, targets, lse)
    assert got_grad.dtype == dtype
    assert rel_err(got_grad, want_grad) <= (1e-5 if dtype == torch.float32 else 8e-3)
    assert (got_grad[targets == -100] == 0).all()


def test_passes_refuse_bad_input():
    logits, targets = _case(3, 10, torch.float32)
    with pytest.raises(ValueError, match="float64"):
        ce.cross_entropy_fwd(logits.double(), targets)
    with pytest.raises(ValueError, match=r"\[N, V\]"):
        ce.cross_entropy_fwd(logits, targets[:2])
    assert ce.IGNORE_INDEX == zoo_ce.IGNORE_INDEX


def test_lm_loss_takes_the_fused_path_and_matches_float64(monkeypatch):
    calls = force_and_count(monkeypatch, ce)
    logits, targets = _case(2 * 9, 40, torch.float32)
    logits = logits.view(2, 9, 40).requires_grad_()
    targets = targets.view(2, 9)
    z64 = logits.detach().double().requires_grad_()
    loss, loss64 = lm_loss(logits, targets), lm_loss(z64, targets)  # float64: the plain body
    assert calls == {"cross_entropy_fwd": 1}
    loss.backward()
    loss64.backward()
    assert calls == {"cross_entropy_fwd": 1, "cross_entropy_bwd": 1}
    assert rel_err(loss, loss64) <= 1e-6 and rel_err(logits.grad, z64.grad) <= 1e-5


@pytest.mark.gpu
def test_passes_on_gpu_model_vocabulary(poisoned):
    test_passes_equal_float64_cross_entropy(64, 32000, torch.bfloat16, 1e-6, None, device="cuda")
