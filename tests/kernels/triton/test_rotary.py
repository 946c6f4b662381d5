"""The fused rotary pass (:mod:`hybridzoo.kernels.triton.rotary`) against a float64 rotate-half
formula written here, and :class:`Rotary` routed through it (``hybridzoo.kernels.fused.FORCE``).
CPU: ``TRITON_INTERPRET=1``; GPU: a model shape in bf16."""

from __future__ import annotations

import pytest
import torch

from hybridzoo.kernels.triton import launch, rotary
from hybridzoo.layers.rotary import Rotary
from hybridzoo.utils import rel_err
from tests.kernels.triton.fused_calls import force_and_count

F64 = torch.float64


def _formula(x, rotary_dim, offset, base=10000.0):
    """Rotate-half RoPE in float64: pairs (i, i + R/2) turned by (offset + t) * base^(-2i/R)."""
    T, half = x.shape[1], rotary_dim // 2
    inv = torch.tensor([base ** (-2 * i / rotary_dim) for i in range(half)], dtype=F64)
    ang = torch.arange(offset, offset + T, dtype=F64)[:, None] * inv[None, :]
    cos, sin = ang.cos()[None, :, None, :], ang.sin()[None, :, None, :]
    x = x.to(F64)
    x1, x2, rest = x[..., :half], x[..., half:rotary_dim], x[..., rotary_dim:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest), dim=-1)


@pytest.fixture
def poisoned(monkeypatch):
    monkeypatch.setattr(launch, "POISON_OUTPUTS", True)  # an unwritten element shows as NaN


@pytest.mark.parametrize("heads,dim,rotary_dim", [(3, 12, 12), (5, 20, 8), (2, 6, 4)])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 8e-3)])
def test_pass_and_its_inverse_equal_the_float64_formula(heads, dim, rotary_dim, dtype, tol, poisoned, device="cpu"):
    torch.manual_seed(0)
    x = torch.randn(2, 7, heads, dim, device=device).to(dtype)
    offset = 1000
    half = rotary_dim // 2
    inv = torch.tensor([10000.0 ** (-2 * i / rotary_dim) for i in range(half)], dtype=F64)
    ang = torch.arange(offset, offset + 7, dtype=F64)[:, None] * inv[None, :]
    cos, sin = ang.cos().float().to(device), ang.sin().float().to(device)
    y = rotary.rotary_fwd(x, cos, sin)
    assert y.dtype == dtype and y.shape == x.shape
    assert rel_err(y.cpu(), _formula(x.cpu(), rotary_dim, offset)) <= tol
    back = rotary.rotary_fwd(y.float(), cos, sin, inverse=True)  # the opposite rotation undoes it
    assert rel_err(back, x.float()) <= tol


def test_pass_refuses_bad_input():
    x = torch.randn(1, 4, 2, 8)
    cos = sin = torch.ones(4, 4)
    with pytest.raises(ValueError, match="float64"):
        rotary.rotary_fwd(x.double(), cos, sin)
    with pytest.raises(ValueError, match=r"\[T, R/2\]"):
        rotary.rotary_fwd(x, cos[:3], sin[:3])
    with pytest.raises(ValueError, match="exceed"):
        rotary.rotary_fwd(x, torch.ones(4, 5), torch.ones(4, 5))


@pytest.mark.parametrize("rotary_dim", [16, 8])
def test_rotary_module_takes_the_fused_path_and_matches_float64(monkeypatch, rotary_dim):
    calls = force_and_count(monkeypatch, rotary)
    module = Rotary(16, rotary_dim)
    torch.manual_seed(0)
    x = torch.randn(2, 9, 3, 16, requires_grad=True)
    x64 = x.detach().double().requires_grad_()
    y, y64 = module(x, offset=37), module(x64, offset=37)  # float64: the plain body
    assert calls == {"rotary_fwd": 1}
    assert rel_err(y, _formula(x64.detach(), rotary_dim, 37)) <= 1e-6 and rel_err(y, y64) <= 1e-6
    grad = torch.randn_like(y64)
    y.backward(grad.float())
    y64.backward(grad)
    assert calls == {"rotary_fwd": 2}
    assert rel_err(x.grad, x64.grad) <= 1e-6


@pytest.mark.gpu
def test_pass_on_gpu_model_shapes(poisoned):
    for heads, dim, rotary_dim in ((16, 64, 64), (4, 256, 256), (8, 256, 64)):
        test_pass_and_its_inverse_equal_the_float64_formula(heads, dim, rotary_dim, torch.bfloat16, 8e-3, None,
                                                            device="cuda")


@pytest.mark.parametrize("fused_path", [True, False], ids=["fused", "plain"])
def test_pair_rotates_q_and_k_of_different_head_counts_as_the_formula(monkeypatch, fused_path):
    """``Rotary.pair(q, k)`` (attention and RetNet: one cos / sin table for both) rotates each as
    the float64 formula does, on the fused pass (both tensors through it) and the plain body."""
    calls = force_and_count(monkeypatch, rotary) if fused_path else {}
    module = Rotary(16, 8)
    torch.manual_seed(1)
    q, k = torch.randn(2, 9, 4, 16), torch.randn(2, 9, 1, 16)
    qr, kr = module.pair(q, k, offset=5)
    assert calls == ({"rotary_fwd": 2} if fused_path else {})
    assert rel_err(qr, _formula(q.double(), 8, 5)) <= 1e-6 and rel_err(kr, _formula(k.double(), 8, 5)) <= 1e-6
    with pytest.raises(ValueError, match="share T, dtype and device"):
        module.pair(q, k[:, :8], offset=5)
