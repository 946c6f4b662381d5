"""The fused SwiGLU passes (:mod:`hybridzoo.kernels.triton.swiglu`) against float64 formulas
written here, and SwiGLU routed through them (``hybridzoo.kernels.fused.FORCE``) against the
float64 module. CPU: ``TRITON_INTERPRET=1``; GPU: a model-size shape in bf16."""

from __future__ import annotations

import pytest
import torch

from hybridzoo.kernels.triton import launch, swiglu
from hybridzoo.layers import SwiGLU
from hybridzoo.utils import rel_err
from tests.kernels.triton.fused_calls import force_and_count

F64 = torch.float64


def _formula(g, u, dh):
    sig = 1 / (1 + torch.exp(-g))
    hidden = g * sig * u
    return hidden, dh * u * sig * (1 + g * (1 - sig)), dh * g * sig


@pytest.fixture
def poisoned(monkeypatch):
    monkeypatch.setattr(launch, "POISON_OUTPUTS", True)  # an unwritten element shows as NaN


@pytest.mark.parametrize("shape", [(3, 50), (2, 5, 67)])  # not multiples of the block
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 8e-3)])
def test_fused_passes_equal_the_float64_formula(shape, dtype, tol, poisoned, device="cpu"):
    torch.manual_seed(0)
    g, u, dh = (torch.randn(shape, device=device).mul(3).to(dtype) for _ in range(3))
    hidden_ref, dg_ref, du_ref = _formula(g.to(F64), u.to(F64), dh.to(F64))
    hidden = swiglu.swiglu_fwd(g, u)
    assert hidden.dtype == dtype and hidden.shape == g.shape
    assert rel_err(hidden, hidden_ref) <= tol
    dg, du, hidden_again = swiglu.swiglu_bwd(dh, g, u, torch.float32)
    assert dg.dtype == du.dtype == dtype and hidden_again.dtype == torch.float32
    assert rel_err(dg, dg_ref) <= tol and rel_err(du, du_ref) <= tol
    assert rel_err(hidden_again, hidden_ref) <= 1e-6  # float32 from the same inputs


def test_fused_passes_refuse_float64_and_mismatched_shapes():
    g = torch.randn(4, 8)
    with pytest.raises(ValueError, match="float64"):
        swiglu.swiglu_fwd(g.double(), g.double())
    with pytest.raises(ValueError, match="one shape"):
        swiglu.swiglu_bwd(g, g, g[:, :4], torch.float32)


def test_swiglu_module_takes_the_fused_path_and_matches_float64(monkeypatch):
    calls = force_and_count(monkeypatch, swiglu)
    torch.manual_seed(0)
    mlp = SwiGLU(24, 40)
    x = torch.randn(2, 7, 24, requires_grad=True)
    mlp64 = SwiGLU(24, 40).double()
    mlp64.load_state_dict(mlp.state_dict())
    x64 = x.detach().double().requires_grad_()
    y, y64 = mlp(x), mlp64(x64)
    assert calls == {"swiglu_fwd": 1}
    grad = torch.randn_like(y64)
    y.backward(grad.float())
    y64.backward(grad)
    assert calls == {"swiglu_fwd": 1, "swiglu_bwd": 1}
    assert rel_err(y, y64) <= 1e-5 and rel_err(x.grad, x64.grad) <= 1e-5
    for p, p64 in zip(mlp.parameters(), mlp64.parameters()):
        assert rel_err(p.grad, p64.grad) <= 1e-5


@pytest.mark.gpu
def test_fused_passes_on_gpu_model_shape(poisoned):
    test_fused_passes_equal_the_float64_formula((16384, 2816), torch.bfloat16, 8e-3, None, device="cuda")
