"""Triton selective_scan and causal_conv1d on packed documents (``cu_seqlens``) against the spec.

The spec of a packed call: the float64 reference with ``cu_seqlens`` (each document run alone, B = 1,
from its own initial state; outputs concatenated, final states stacked). CPU (``TRITON_INTERPRET=1``): tiny
shapes, float32 kernels, outputs, final states and every gradient (initial states included), on
documents of length 1, shorter than the conv width, exactly a time block (8 under the
interpreter), a block + 1 and several blocks, starting anywhere in a block; every address the
kernels touch is checked to lie in their tensors (:mod:`.bounds`).
GPU (``@pytest.mark.gpu``): Mamba-130m's shapes (Dm 1536, N 16, conv width 4), T 8192 packed with
log-normal document lengths (median about 600, some longer than the row), bf16 and float32,
outputs poisoned with NaN first, against the float32 reference per document.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch

from hybridzoo.kernels.reference import causal_conv1d as reference_conv
from hybridzoo.kernels.reference import selective_scan as reference_scan
from hybridzoo.kernels.triton import launch
from hybridzoo.kernels.triton.conv import causal_conv1d, doc_final_states, silu_conv, silu_conv_grads
from hybridzoo.kernels.triton.selective_scan import selective_scan, selective_scan_grads, selective_scan_saved
from hybridzoo.utils import rel_err
from tests.kernels.triton.bounds import bounds_checked

F64 = torch.float64
SCAN_NAMES = ("u", "delta", "A", "B", "C", "D", "z", "delta_bias", "initial_state")
CONV_NAMES = ("x", "weight", "bias", "initial_state")
# 1, exactly a block (8), a block + 1, 3, several blocks; then starts in mid-block, length-1 runs
LENGTHS = (1, 8, 9, 3, 17)
RAGGED = (5, 1, 1, 2, 16, 7)


def _cu(lengths, device="cpu"):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)


# ---------------------------------------------------------------- selective scan


def _scan_inputs(lengths, dm=8, n=3, groups=2, seed=0, dtype=F64, device="cpu", mamba_init=False):
    torch.manual_seed(seed)
    total, docs = sum(lengths), len(lengths)
    bc = (1, total, n) if groups is None else (1, total, groups, n)
    x = dict(u=torch.randn(1, total, dm), delta=torch.randn(1, total, dm), A=-torch.rand(dm, n) - 0.1,
             B=torch.randn(bc), C=torch.randn(bc), D=torch.randn(dm), z=torch.randn(1, total, dm),
             delta_bias=torch.randn(dm), initial_state=torch.randn(docs, dm, n))
    if mamba_init:  # Mamba's ranges: A = -(1..N), small step sizes after softplus
        x["A"] = -torch.arange(1, n + 1, dtype=torch.float32).repeat(dm, 1)
        x["delta"] = 0.5 * x["delta"] - 4.0
        x["delta_bias"] = 0.5 * x["delta_bias"]
    return {k: v.to(device=device, dtype=dtype) for k, v in x.items()}


def _scan_spec(x, cu, softplus=True, chunk_size=8):
    return reference_scan(x["u"], x["delta"], x["A"], x["B"], x["C"], x["D"], x["z"], x["delta_bias"], softplus,
                          x["initial_state"], True, chunk_size=chunk_size, cu_seqlens=cu)


def _scan_packed(x, cu, softplus=True):
    return selective_scan(x["u"], x["delta"], x["A"], x["B"], x["C"], x["D"], x["z"], x["delta_bias"], softplus,
                          x["initial_state"], True, cu_seqlens=cu)


def _leaves(x, dtype=None):
    return {k: (None if v is None else v.detach().to(dtype or v.dtype).requires_grad_()) for k, v in x.items()}


def _check_grads(names, tri_in, ref_in, tol):
    for name in names:
        if ref_in[name] is None:
            continue
        ref = ref_in[name].grad
        ref = torch.zeros_like(ref_in[name]) if ref is None else ref
        assert tri_in[name].grad is not None, name
        assert rel_err(tri_in[name].grad, ref) <= tol, name


def _check_scan(lengths, softplus=True, tol=1e-5, weights=(1.0, 1.0), without=(), bounds=False, **kwargs):
    """Triton float32 on the packed row vs the float64 reference per document: outputs, final
    states, every gradient (``without``: inputs left None; ``bounds``: every address checked)."""
    x = _scan_inputs(lengths, **kwargs)
    if not softplus:
        x["delta"] = x["delta"].abs()
    for key in without:
        x[key] = None
    cu = _cu(lengths)
    ref_in, tri_in = _leaves(x), _leaves(x, torch.float32)
    y_ref, h_ref = _scan_spec(ref_in, cu, softplus)
    torch.manual_seed(1)
    gy, gh = torch.randn_like(y_ref) * weights[0], torch.randn_like(h_ref) * weights[1]
    with bounds_checked() if bounds else contextlib.nullcontext() as report:
        y, h = _scan_packed(tri_in, cu, softplus)
        ((y * gy.float()).sum() + (h * gh.float()).sum()).backward()
    assert not bounds or (report.launches > 0 and report.violations == []), report.violations[:3]
    assert y.dtype == torch.float32 and h.shape == (len(lengths), *h_ref.shape[1:])
    assert rel_err(y, y_ref) <= tol and rel_err(h, h_ref) <= tol
    ((y_ref * gy).sum() + (h_ref * gh).sum()).backward()
    _check_grads(SCAN_NAMES, tri_in, ref_in, tol)


@pytest.mark.parametrize("lengths,groups", [(LENGTHS, 2), (RAGGED, None)])
def test_scan_matches_documents_alone(lengths, groups):
    _check_scan(lengths, groups=groups, seed=len(lengths), bounds=groups is None)


def test_scan_without_optional_inputs_and_through_final_states_only():
    """D, z, delta_bias and the initial states None, no softplus; and a loss on the final states
    alone (no output gradient: D and z then get zero gradients)."""
    _check_scan((3, 9, 1, 4), softplus=False, seed=3, without=("D", "z", "delta_bias", "initial_state"))
    _check_scan((8, 2, 1, 5), seed=4, weights=(0.0, 1.0))


def test_scan_saved_and_grads_entry_points():
    """``selective_scan_saved`` / ``selective_scan_grads`` (the Mamba-1 layer's one-node step) with
    cu_seqlens: the same outputs, final states and gradients as the spec."""
    lengths = (9, 1, 8, 6)
    x, cu = _scan_inputs(lengths, seed=5), _cu(lengths)
    ref_in = _leaves(x)
    y_ref, h_ref = _scan_spec(ref_in, cu)
    x32 = {k: v.float() for k, v in x.items()}
    args = [x32[k] for k in SCAN_NAMES[:8]]
    y, h, saved = selective_scan_saved(*args, True, x32["initial_state"], cu_seqlens=cu)
    assert rel_err(y, y_ref) <= 1e-5 and rel_err(h, h_ref) <= 1e-5
    torch.manual_seed(2)
    gy, gh = torch.randn_like(y_ref), torch.randn_like(h_ref)
    ((y_ref * gy).sum() + (h_ref * gh).sum()).backward()
    grads = selective_scan_grads(*args, x32["initial_state"], saved, gy.float(), gh.float(), True, cu_seqlens=cu)
    for name, grad in zip(SCAN_NAMES, grads):
        assert rel_err(grad, ref_in[name].grad) <= 1e-5, name


def test_public_ops_route_packed_calls_to_the_kernels():
    """``hybridzoo.kernels.selective_scan`` / ``causal_conv1d`` with ``backend="triton"`` and
    cu_seqlens run these kernels (declared in VARLEN_OPS), equal to the reference."""
    from hybridzoo.kernels import causal_conv1d as conv_op
    from hybridzoo.kernels import selective_scan as scan_op

    lengths = (3, 9, 2)
    cu = _cu(lengths)
    x = {k: v.float() for k, v in _scan_inputs(lengths, seed=11).items()}
    y, h = scan_op(*[x[k] for k in SCAN_NAMES[:8]], True, x["initial_state"], True, cu_seqlens=cu, backend="triton")
    y_ref, h_ref = _scan_spec({k: v.double() for k, v in x.items()}, cu)
    assert rel_err(y, y_ref) <= 1e-5 and rel_err(h, h_ref) <= 1e-5
    c = {k: v.float() for k, v in _conv_inputs(lengths, seed=12).items()}
    y, s = conv_op(c["x"], c["weight"], c["bias"], initial_state=c["initial_state"], output_final_state=True,
                   activation="silu", cu_seqlens=cu, backend="triton")
    y_ref, s_ref = _conv_spec({k: v.double() for k, v in c.items()}, cu, "silu")
    assert rel_err(y, y_ref) <= 1e-5 and rel_err(s, s_ref) <= 1e-5


def test_scan_packed_errors():
    x = _scan_inputs((3, 4), seed=6, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"initial_state is per document, \[N_docs, Dm, N\]"):
        selective_scan(x["u"], x["delta"], x["A"], x["B"], x["C"], initial_state=x["initial_state"][:1],
                       cu_seqlens=_cu((3, 4)))
    two = {k: torch.cat([x[k]] * 2) for k in ("u", "delta", "B", "C")}
    with pytest.raises(ValueError, match=r"packed in one row"):
        selective_scan(two["u"], two["delta"], x["A"], two["B"], two["C"], cu_seqlens=_cu((3, 4)))


# ---------------------------------------------------------------- causal conv1d


def _conv_inputs(lengths, dm=6, width=4, seed=0, dtype=F64, device="cpu"):
    torch.manual_seed(seed)
    x = dict(x=torch.randn(1, sum(lengths), dm), weight=torch.randn(dm, width), bias=torch.randn(dm),
             initial_state=torch.randn(len(lengths), width - 1, dm))
    return {k: v.to(device=device, dtype=dtype) for k, v in x.items()}


def _conv_spec(x, cu, activation):
    return reference_conv(x["x"], x["weight"], x["bias"], initial_state=x["initial_state"], output_final_state=True,
                          activation=activation, cu_seqlens=cu)


def _check_conv(lengths, width, activation, tol=1e-5, without=(), weights=(1.0, 1.0), seed=0, bounds=False):
    x = _conv_inputs(lengths, width=width, seed=seed)
    for key in without:
        x[key] = None
    cu = _cu(lengths)
    ref_in, tri_in = _leaves(x), _leaves(x, torch.float32)
    y_ref, s_ref = _conv_spec(ref_in, cu, activation)
    torch.manual_seed(1)
    gy, gs = torch.randn_like(y_ref) * weights[0], torch.randn_like(s_ref) * weights[1]
    with bounds_checked() if bounds else contextlib.nullcontext() as report:
        y, s = causal_conv1d(tri_in["x"], tri_in["weight"], tri_in["bias"], initial_state=tri_in["initial_state"],
                             output_final_state=True, activation=activation, cu_seqlens=cu)
        ((y * gy.float()).sum() + (s * gs.float()).sum()).backward()
    assert not bounds or (report.launches > 0 and report.violations == []), report.violations[:3]
    assert s.shape == (len(lengths), width - 1, x["x"].shape[2])
    assert rel_err(y, y_ref) <= tol and rel_err(s, s_ref) <= tol
    ((y_ref * gy).sum() + (s_ref * gs).sum()).backward()
    _check_grads([k for k in CONV_NAMES if x[k] is not None and x[k].numel()], tri_in, ref_in, tol)


# 2 and 4: the step-ordered backward (W <= 4), 5: the tiled one; documents of 1 and 2 tokens are
# shorter than the tail
@pytest.mark.parametrize("width,activation", [(2, None), (4, "silu"), (5, "silu")])
def test_conv_matches_documents_alone(width, activation):
    _check_conv((1, 2, 8, 9, 3, 17), width, activation, seed=width, bounds=width > 2)


def test_conv_ragged_without_bias_or_tails_and_through_final_states_only():
    _check_conv((5, 1, 1, 2, 9), 4, "silu", without=("bias", "initial_state"), seed=7)
    _check_conv((2, 1, 9, 5), 3, None, weights=(0.0, 1.0), seed=8)


def test_silu_conv_entry_points():
    """``silu_conv`` / ``silu_conv_grads`` / ``doc_final_states`` (the Mamba layers' one-node steps)
    with cu_seqlens, no initial tails: output, final tails, and x's gradient through both."""
    lengths = (2, 9, 1, 8)
    x, cu = _conv_inputs(lengths, seed=9), _cu(lengths)
    x["initial_state"] = None
    ref_in = _leaves(x)
    y_ref, s_ref = _conv_spec(ref_in, cu, "silu")
    xf, wf, bf = (x[k].float() for k in ("x", "weight", "bias"))
    y = silu_conv(xf, wf, bf, cu_seqlens=cu)
    tails = doc_final_states(xf, 4, cu)
    assert rel_err(y, y_ref) <= 1e-5 and rel_err(tails, s_ref) <= 1e-5
    torch.manual_seed(3)
    gy, gs = torch.randn_like(y_ref), torch.randn_like(s_ref)
    ((y_ref * gy).sum() + (s_ref * gs).sum()).backward()
    dx = torch.empty_like(xf)
    dweight, dbias = silu_conv_grads(xf, wf, bf, gy.float(), dx, gs.float(), cu_seqlens=cu)
    for name, grad in (("x", dx), ("weight", dweight), ("bias", dbias)):
        assert rel_err(grad, ref_in[name].grad) <= 1e-5, name


def test_conv_packed_errors():
    x = _conv_inputs((3, 4), seed=10, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"initial_state is per document, \[N_docs, W-1, Dm\]"):
        causal_conv1d(x["x"], x["weight"], initial_state=x["initial_state"][:1], cu_seqlens=_cu((3, 4)))
    with pytest.raises(ValueError, match=r"packed in one row"):
        causal_conv1d(torch.cat([x["x"]] * 2), x["weight"], cu_seqlens=_cu((3, 4)))


# ---------------------------------------------------------------- GPU, real shapes


def lognormal_lengths(total: int, median: float = 600.0, sigma: float = 1.0, seed: int = 0) -> list[int]:
    """Document lengths packed into one row of ``total`` tokens: log-normal (``median``, ``sigma``),
    at least 1, the last cut at the row's end (a document longer than the row fills it)."""
    gen = torch.Generator().manual_seed(seed)
    lengths, left = [], total
    while left > 0:
        draw = math.exp(math.log(median) + sigma * torch.randn((), generator=gen).item())
        lengths.append(min(left, max(1, round(draw))))
        left -= lengths[-1]
    return lengths


def _poison(monkeypatch):
    monkeypatch.setattr(launch, "POISON_OUTPUTS", True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 1e-2), (torch.float32, 1e-4)])
@pytest.mark.parametrize("seed", [0, 1])
def test_gpu_scan_mamba130m_packed(monkeypatch, dtype, tol, seed):
    """Mamba-130m's scan (Dm 1536, N 16, softplus bias, D, z) on T 8192 packed with log-normal
    documents (median ~600), per-document initial states: outputs, final states and every
    gradient against autograd of the float32 reference run per document."""
    _poison(monkeypatch)
    lengths = lognormal_lengths(8192, seed=seed)
    x = _scan_inputs(lengths, dm=1536, n=16, groups=None, seed=seed, dtype=dtype, device="cuda", mamba_init=True)
    x["A"], x["initial_state"] = x["A"].float(), x["initial_state"].float()
    cu = _cu(lengths, "cuda")
    tri_in, ref_in = _leaves(x), _leaves(x, torch.float32)
    y, h = _scan_packed(tri_in, cu)
    y_ref, h_ref = _scan_spec(ref_in, cu, chunk_size=128)
    assert not y.isnan().any() and not h.isnan().any()
    assert rel_err(y, y_ref) <= tol and rel_err(h, h_ref) <= tol
    torch.manual_seed(12)
    gy, gh = torch.randn_like(y_ref), torch.randn_like(h_ref)
    ((y.float() * gy).sum() + (h * gh).sum()).backward()
    ((y_ref * gy).sum() + (h_ref * gh).sum()).backward()
    for name in SCAN_NAMES:
        grad = tri_in[name].grad
        assert grad is not None and not grad.isnan().any(), name
        assert rel_err(grad, ref_in[name].grad) <= tol, name


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 1e-2), (torch.float32, 1e-5)])
@pytest.mark.parametrize("width", [4, 5])
def test_gpu_conv_mamba130m_packed(monkeypatch, dtype, tol, width):
    """Mamba-130m's conv (Dm 1536, width 4, SiLU; 5: the tiled backward) on T 8192 packed with
    log-normal documents and per-document tails: output, final tails and every gradient against
    the float64 reference per document."""
    _poison(monkeypatch)
    lengths = lognormal_lengths(8192, seed=width)
    x = _conv_inputs(lengths, dm=1536, width=width, seed=width, dtype=dtype, device="cuda")
    cu = _cu(lengths, "cuda")
    tri_in, ref_in = _leaves(x), _leaves(x, F64)
    y, s = causal_conv1d(tri_in["x"], tri_in["weight"], tri_in["bias"], initial_state=tri_in["initial_state"],
                         output_final_state=True, activation="silu", cu_seqlens=cu)
    y_ref, s_ref = _conv_spec(ref_in, cu, "silu")
    assert not y.isnan().any()
    assert rel_err(y, y_ref) <= tol and rel_err(s, s_ref) <= tol
    torch.manual_seed(13)
    gy, gs = torch.randn_like(y_ref), torch.randn_like(s_ref)
    ((y.double() * gy).sum() + (s.double() * gs).sum()).backward()
    ((y_ref * gy).sum() + (s_ref * gs).sum()).backward()
    for name in CONV_NAMES:
        grad = tri_in[name].grad
        assert grad is not None and not grad.isnan().any(), name
        assert rel_err(grad, ref_in[name].grad) <= tol, name


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 1e-2), (torch.float32, 1e-5)])
def test_gpu_mamba_ssm_conv_packed(dtype, tol):
    """The mamba_ssm backend's causal_conv1d with cu_seqlens (causal-conv1d's seq_idx), Mamba-130m's
    shape on T 8192 packed with log-normal documents: output, final tails and the gradients of x,
    weight and bias against the float64 reference per document; per-document tails refused."""
    pytest.importorskip("causal_conv1d")
    from hybridzoo.kernels.backends.mamba_ssm import causal_conv1d as mamba_conv

    lengths = lognormal_lengths(8192, seed=7)
    x = _conv_inputs(lengths, dm=1536, width=4, seed=7, dtype=dtype, device="cuda")
    cu = _cu(lengths, "cuda")
    with pytest.raises(NotImplementedError, match="per-document initial tails"):
        mamba_conv(x["x"], x["weight"], x["bias"], initial_state=x["initial_state"], cu_seqlens=cu)
    x["initial_state"] = None
    tri_in, ref_in = _leaves(x), _leaves(x, F64)
    y, s = mamba_conv(tri_in["x"], tri_in["weight"], tri_in["bias"], output_final_state=True, activation="silu",
                      cu_seqlens=cu)
    y_ref, s_ref = _conv_spec(ref_in, cu, "silu")
    assert rel_err(y, y_ref) <= tol and rel_err(s, s_ref) <= tol
    torch.manual_seed(14)
    gy, gs = torch.randn_like(y_ref), torch.randn_like(s_ref)
    ((y.double() * gy).sum() + (s.double() * gs).sum()).backward()
    ((y_ref * gy).sum() + (s_ref * gs).sum()).backward()
    for name in ("x", "weight", "bias"):
        assert rel_err(tri_in[name].grad, ref_in[name].grad) <= tol, name
