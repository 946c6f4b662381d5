"""RMSNorm, GatedRMSNorm and gated_rms_norm take the fused Triton kernels where
``hybridzoo.kernels.fused.applies`` (forced here on CPU tensors, under the interpreter): each
launcher runs once per direction, nothing is recomputed in plain PyTorch, only the inputs and the
float32 rstd are kept, and values and gradients are the float64 formulas. float64 tensors keep the
plain path (the spec)."""

from __future__ import annotations

import pytest
import torch

from hybridzoo.kernels import fused
from hybridzoo.layers import GatedRMSNorm, RMSNorm
from hybridzoo.layers import norms, recompute
from hybridzoo.utils import rel_err
from tests.kernels.triton.fused_calls import force_and_count
from tests.kernels.triton.test_norm import formula
from tests.layers.saved_bytes import saved_tensors

F64 = torch.float64
EPS = 0.05  # comparable to mean(x²) below: a dropped eps shows


@pytest.fixture
def calls(monkeypatch):
    """Force the fused path and count the calls of each Triton launcher."""
    from hybridzoo.kernels.triton import norm as kernels

    return force_and_count(monkeypatch, kernels)


def _grads(out, leaves, seed=1):
    torch.manual_seed(seed)
    probe = torch.randn(out.shape, dtype=F64)
    return torch.autograd.grad((out.to(F64) * probe).sum(), leaves)


def _leaves(*tensors, dtype=torch.float32):
    return [t.to(dtype).requires_grad_() for t in tensors]


@pytest.mark.parametrize("zero_centered", [False, True])
def test_rms_norm_runs_the_fused_kernels_and_is_the_formula(calls, zero_centered):
    torch.manual_seed(0)
    norm = RMSNorm(40, EPS, zero_centered)
    with torch.no_grad():
        norm.weight.normal_()
    x = 0.3 * torch.randn(2, 7, 40, dtype=F64)
    (xl,), (xr, wr) = _leaves(x), _leaves(x, norm.weight.detach(), dtype=F64)
    y, ref = norm(xl), formula(xr, None, wr, EPS, 40, zero_centered=zero_centered)
    assert y.dtype == torch.float32 and rel_err(y, ref) <= 2e-6
    for got, want in zip(_grads(y, (xl, norm.weight)), _grads(ref, (xr, wr))):
        assert rel_err(got, want) <= 2e-6
    assert calls == {"rms_norm_fwd": 1, "rms_norm_bwd": 1}


def test_rms_norm_bf16_input_with_float32_weight(calls):
    torch.manual_seed(0)
    norm = RMSNorm(24, EPS, zero_centered=True)
    with torch.no_grad():
        norm.weight.normal_()
    x = (0.3 * torch.randn(3, 5, 24)).bfloat16().requires_grad_()
    xr, wr = _leaves(x.detach(), norm.weight.detach(), dtype=F64)
    y, ref = norm(x), formula(xr, None, wr, EPS, 24, zero_centered=True)
    assert y.dtype == torch.bfloat16 and rel_err(y, ref) <= 4e-3
    (gx, gw), (rx, rw) = _grads(y, (x, norm.weight)), _grads(ref, (xr, wr))
    assert gx.dtype == torch.bfloat16 and gw.dtype == torch.float32
    assert rel_err(gx, rx) <= 4e-3 and rel_err(gw, rw) <= 4e-3  # dy reaches them rounded to bf16
    assert calls == {"rms_norm_fwd": 1, "rms_norm_bwd": 1}


def test_rms_norm_keeps_x_and_one_rstd_per_row(calls):
    norm, x = RMSNorm(24, EPS), torch.randn(3, 5, 24, requires_grad=True)
    kept = saved_tensors(lambda: norm(x))
    assert calls == {"rms_norm_fwd": 1}
    assert sorted(tuple(t.shape) for t in kept) == [(3, 5, 1), (3, 5, 24), (24,)]
    assert sum(t.nbytes for t in kept if t.shape == (3, 5, 1) and t.dtype == torch.float32) == 3 * 5 * 4


@pytest.mark.parametrize("force", [True, False])
def test_double_backward_is_refused_not_wrong(monkeypatch, force):
    """The backward treats rstd as a constant, so a gradient of a gradient would miss its terms
    (31% off the formula's, measured): both paths refuse it, fused and plain alike."""
    monkeypatch.setattr(fused, "FORCE", force)
    x = torch.randn(4, 24, requires_grad=True)
    for out in (RMSNorm(24, EPS)(x), GatedRMSNorm(24, EPS)(x, torch.randn(4, 24))):
        gx, = torch.autograd.grad(out.pow(2).sum(), x, create_graph=True)
        with pytest.raises(RuntimeError, match="once_differentiable|does not require grad"):
            gx.sum().backward()


@pytest.mark.parametrize("norm_before_gate", [True, False])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-6), (torch.bfloat16, 4e-3)])
def test_gated_rms_norm_runs_the_fused_kernels_and_is_the_formula(calls, monkeypatch, norm_before_gate, dtype,
                                                                    tol):
    monkeypatch.setattr(recompute, "recomputed", None)  # the fused path recomputes nothing in PyTorch
    torch.manual_seed(0)
    norm = GatedRMSNorm(48, EPS, group_size=24, norm_before_gate=norm_before_gate)
    with torch.no_grad():
        norm.weight.normal_()
    x, z = 0.3 * torch.randn(2, 5, 48, dtype=F64), 1.5 * torch.randn(2, 5, 48, dtype=F64)
    xl, zl = _leaves(x, z, dtype=dtype)
    xr, zr, wr = _leaves(xl.detach(), zl.detach(), norm.weight.detach(), dtype=F64)
    kept = saved_tensors(lambda: norm(xl, zl))
    assert sorted(tuple(t.shape) for t in kept) == [(2, 5, 48), (2, 5, 48), (10, 2), (48,)]  # x, z, rstd, w
    y, ref = norm(xl, zl), formula(xr, zr, wr, EPS, 24, norm_before_gate)
    assert y.dtype == dtype and rel_err(y, ref) <= tol
    for got, want in zip(_grads(y, (xl, zl, norm.weight)), _grads(ref, (xr, zr, wr))):
        assert rel_err(got, want) <= tol  # in bf16, dy reaches every gradient rounded to bf16
    assert calls == {"gated_rms_norm_fwd": 2, "gated_rms_norm_bwd": 1}


def test_gated_rms_norm_function_is_fused_too(calls):
    """The function Mamba-2's recomputed body calls (float32 x, bf16 z: its scan output and gate)."""
    torch.manual_seed(0)
    x, z, w = 0.3 * torch.randn(2, 3, 36), torch.randn(2, 3, 36).bfloat16(), torch.randn(36)
    leaves = _leaves(x, z, w, dtype=F64)
    y = norms.gated_rms_norm(x, z, w, EPS, 12, False)
    assert y.dtype == torch.float32 and rel_err(y, formula(*leaves, EPS, 12, False)) <= 2e-6
    assert calls == {"gated_rms_norm_fwd": 1}


def test_float64_keeps_the_plain_path(calls):
    torch.manual_seed(0)
    norm, gated = RMSNorm(24, EPS).double(), GatedRMSNorm(24, EPS).double()
    x, z = torch.randn(2, 3, 24, dtype=F64, requires_grad=True), torch.randn(2, 3, 24, dtype=F64)
    assert (norm(x) - formula(x, None, norm.weight, EPS, 24)).abs().max() < 1e-12
    assert (gated(x, z) - formula(x, z, gated.weight, EPS, 24)).abs().max() < 1e-12
    assert calls == {}


def test_mamba2_mixer_takes_the_fused_gated_norm_inside_its_recomputed_body(calls, monkeypatch):
    """Mamba-2's recomputed body calls gated_rms_norm on its float32 scan output and a strided
    slice z of the in-projection's output: the fused kernels run there (forward, recomputation,
    backward) and the mixer's output and gradients are those of the plain norm."""
    from hybridzoo.layers.mamba2 import Mamba2, Mamba2Config

    torch.manual_seed(0)
    _assert_mixer_fused_equals_plain(Mamba2(8, Mamba2Config(d_state=4, head_dim=4, n_groups=2, chunk_size=4)),
                                     monkeypatch, 8)
    assert calls == {"gated_rms_norm_fwd": 2, "gated_rms_norm_bwd": 1}


def _assert_mixer_fused_equals_plain(mixer, monkeypatch, d_model: int):
    """The mixer's output and every gradient with the fused path forced equal the plain path's."""
    x = torch.randn(2, 9, d_model)
    results = {}
    for force in (False, True):
        monkeypatch.setattr(fused, "FORCE", force)
        mixer.zero_grad()
        xl = x.clone().requires_grad_()
        y = mixer(xl)[0]
        results[force] = (y, *_grads(y, [xl, *mixer.parameters()]))
    for plain, fused_ in zip(results[False], results[True]):
        assert rel_err(fused_, plain) <= 1e-5


def test_l2_normalize_fused_is_the_float64_formula_and_keeps_x_and_rstd(calls, monkeypatch):
    """Per-head l2 normalisation (Gated DeltaNet's q and k) through the grouped-norm kernels, from
    a strided slice as the mixer hands it over; values and gradients against float64."""
    monkeypatch.setattr(recompute, "recomputed", None)  # the fused path recomputes nothing in PyTorch
    torch.manual_seed(0)
    qkv = torch.randn(2, 5, 3 * 12, requires_grad=True)
    q = qkv[..., :12]  # two heads of 6 channels, rows 36 apart
    y = norms.l2_normalize(q, 6, 1e-6)
    q64 = q.detach().double().unflatten(-1, (2, 6)).requires_grad_()
    want = q64 / torch.sqrt((q64 * q64).sum(-1, keepdim=True) + 1e-6)
    assert calls == {"grouped_rms_norm_fwd": 1}
    assert y.shape == q.shape and rel_err(y, want.flatten(-2)) <= 1e-6
    grad = torch.randn(2, 5, 12, dtype=F64)
    y.backward(grad.float())
    want.flatten(-2).backward(grad)
    assert calls == {"grouped_rms_norm_fwd": 1, "grouped_rms_norm_bwd": 1}
    assert rel_err(qkv.grad[..., :12], q64.grad.flatten(-2)) <= 1e-6 and (qkv.grad[..., 12:] == 0).all()
    kept = saved_tensors(lambda: norms.l2_normalize(q, 6, 1e-6))
    assert sorted(tuple(t.shape) for t in kept) == [(2, 5, 12), (10, 2), (12,)]  # x, rstd, the weight


def test_gated_deltanet_takes_the_fused_l2_norm_and_matches_the_plain_path(calls, monkeypatch):
    from hybridzoo.layers.gated_deltanet import GatedDeltaNet, GatedDeltaNetConfig

    torch.manual_seed(0)
    _assert_mixer_fused_equals_plain(GatedDeltaNet(16, GatedDeltaNetConfig(
        num_k_heads=2, num_v_heads=2, head_k_dim=8, head_v_dim=8, chunk_size=4)), monkeypatch, 16)
    assert calls["grouped_rms_norm_fwd"] == 2 and calls["grouped_rms_norm_bwd"] == 2  # q and k


@pytest.mark.gpu
@pytest.mark.parametrize("gated", [False, True])
def test_gpu_layers_take_the_fused_kernels_and_match_the_plain_path(calls, monkeypatch, gated):
    """At a model's shapes on a GPU (not forced): RMSNorm on the float32 residual stream
    (d_model 1024) and the gated norm on bf16 value heads (8 x 128), fused against plain."""
    monkeypatch.setattr(fused, "FORCE", False)
    torch.manual_seed(0)
    shape = (8, 2048, 8, 128) if gated else (8, 2048, 1024)
    layer = (GatedRMSNorm(128) if gated else RMSNorm(1024)).cuda()
    with torch.no_grad():
        layer.weight.normal_()
    dtype = torch.bfloat16 if gated else torch.float32
    inputs = [torch.randn(shape, device="cuda").to(dtype) for _ in range(2 if gated else 1)]
    results = {}
    for on in (False, True):
        monkeypatch.setattr(fused, "FUSED", on)
        layer.zero_grad()
        leaves = [t.clone().requires_grad_() for t in inputs]
        y = layer(*leaves)
        y.backward(torch.ones_like(y))
        results[on] = (y, *(t.grad for t in leaves), layer.weight.grad.clone())
    for plain, fast in zip(results[False], results[True]):
        assert rel_err(fast, plain) <= (1e-5 if fast.dtype == torch.float32 else 8e-3)
    name = "gated_rms_norm" if gated else "rms_norm"
    assert calls == {f"{name}_fwd": 1, f"{name}_bwd": 1}
