"""Reference selective scan (Mamba-1): chunked Hillis–Steele form vs the step loop, vs the formula,
state carrying, decoding, gradients (autograd of the loop, gradcheck), large step sizes."""

from __future__ import annotations

import math

import pytest
import torch

from hybridzoo.kernels import selective_scan as selective_scan_op
from hybridzoo.kernels.reference import selective_scan, selective_scan_loop, selective_scan_step
from hybridzoo.utils import rel_err

F64 = torch.float64
TOL = 1e-10


def _inputs(batch=2, length=11, dm=4, n=3, groups=None, seed=0, dtype=F64):
    """groups=None: B, C are [B, T, N]; an int G: [B, T, G, N]."""
    torch.manual_seed(seed)
    bc_shape = (batch, length, n) if groups is None else (batch, length, groups, n)
    return dict(
        u=torch.randn(batch, length, dm, dtype=dtype),
        delta=torch.randn(batch, length, dm, dtype=dtype),
        A=-torch.rand(dm, n, dtype=dtype) - 0.1,
        B=torch.randn(bc_shape, dtype=dtype),
        C=torch.randn(bc_shape, dtype=dtype),
        D=torch.randn(dm, dtype=dtype),
        z=torch.randn(batch, length, dm, dtype=dtype),
        delta_bias=torch.randn(dm, dtype=dtype),
        initial_state=torch.randn(batch, dm, n, dtype=dtype),
    )


def _args(x, softplus=True):
    return (x["u"], x["delta"], x["A"], x["B"], x["C"], x["D"], x["z"], x["delta_bias"], softplus)


def test_loop_matches_formula():
    """The ground truth itself against the recurrence written out with scalars (G = 2 groups)."""
    x = _inputs(batch=1, length=3, dm=4, n=2, groups=2)
    x["delta"] = x["delta"].abs()
    y, final = selective_scan_loop(*_args(x, softplus=False), x["initial_state"], True)
    u, dt, A, B, C = x["u"][0], x["delta"][0] + x["delta_bias"], x["A"], x["B"][0], x["C"][0]
    for d in range(4):
        g = d // 2
        h = [x["initial_state"][0, d, k].item() for k in range(2)]
        for t in range(3):
            h = [math.exp(dt[t, d] * A[d, k]) * h[k] + dt[t, d] * B[t, g, k] * u[t, d] for k in range(2)]
            out = sum(C[t, g, k] * h[k] for k in range(2)) + x["D"][d] * u[t, d]
            z = x["z"][0, t, d]
            out = out * z / (1 + math.exp(-z))
            assert abs(y[0, t, d].item() - out) <= TOL * (1 + abs(out))
        assert rel_err(final[0, d], torch.tensor(h, dtype=F64)) <= TOL


@pytest.mark.parametrize("groups", [None, 1, 2])
@pytest.mark.parametrize("length,chunk_size", [(11, 4), (11, 64), (1, 4), (16, 8)])
@pytest.mark.parametrize("with_state", [False, True])
def test_matches_loop(groups, length, chunk_size, with_state):
    x = _inputs(length=length, groups=groups)
    state = x["initial_state"] if with_state else None
    y, final = selective_scan(*_args(x), state, True, chunk_size=chunk_size)
    y_ref, final_ref = selective_scan_loop(*_args(x), state, True)
    assert y.shape == x["u"].shape and final.shape == (2, 4, 3)
    assert rel_err(y, y_ref) <= TOL
    assert rel_err(final, final_ref) <= TOL


@pytest.mark.parametrize("use_D", [False, True])
@pytest.mark.parametrize("use_z", [False, True])
@pytest.mark.parametrize("use_bias", [False, True])
@pytest.mark.parametrize("softplus", [False, True])
def test_optional_inputs_match_loop(use_D, use_z, use_bias, softplus):
    x = _inputs(length=9, groups=2)
    args = (x["u"], x["delta"], x["A"], x["B"], x["C"], x["D"] if use_D else None, x["z"] if use_z else None,
            x["delta_bias"] if use_bias else None, softplus, x["initial_state"], True)
    y, final = selective_scan(*args, chunk_size=4)
    y_ref, final_ref = selective_scan_loop(*args)
    assert rel_err(y, y_ref) <= TOL
    assert rel_err(final, final_ref) <= TOL


def test_two_calls_equal_one():
    x = _inputs(length=13, groups=2)
    y, final = selective_scan(*_args(x), x["initial_state"], True, chunk_size=4)
    ys, state = [], x["initial_state"]
    for part in (slice(0, 5), slice(5, 6), slice(6, 13)):
        piece = {k: (v[:, part] if k in ("u", "delta", "B", "C", "z") else v) for k, v in x.items()}
        y_part, state = selective_scan(*_args(piece), state, True, chunk_size=4)
        ys.append(y_part)
    assert rel_err(torch.cat(ys, 1), y) <= TOL
    assert rel_err(state, final) <= TOL


def test_decoding_steps_equal_full():
    """Prefill with the chunked form, then decode token by token with the step."""
    x = _inputs(length=10, groups=2)
    y, final = selective_scan(*_args(x), None, True)
    y_pre, state = selective_scan(*_args({k: (v[:, :4] if v.dim() >= 3 else v) for k, v in x.items()}), None, True)
    ys = [y_pre]
    for t in range(4, 10):
        y_t, state = selective_scan_step(x["u"][:, t], x["delta"][:, t], x["A"], x["B"][:, t], x["C"][:, t],
                                         x["D"], x["z"][:, t], x["delta_bias"], True, state)
        ys.append(y_t[:, None])
    assert rel_err(torch.cat(ys, 1), y) <= TOL
    assert rel_err(state, final) <= TOL


NAMES = ("u", "delta", "A", "B", "C", "D", "z", "delta_bias", "initial_state")


def _loss(fn, leaves, **kwargs):
    u, delta, A, B, C, D, z, delta_bias, state = leaves
    y, final = fn(u, delta, A, B, C, D, z, delta_bias, True, state, True, **kwargs)
    torch.manual_seed(1)  # fixed cotangents, also through the final state
    return (y * torch.randn(y.shape, dtype=y.dtype)).sum() + (final * torch.randn(final.shape, dtype=y.dtype)).sum()


@pytest.mark.parametrize("groups", [None, 2])
def test_gradients_match_loop(groups):
    x = _inputs(length=9, groups=groups)
    leaves = [x[name].clone().requires_grad_() for name in NAMES]
    grads = torch.autograd.grad(_loss(selective_scan, leaves, chunk_size=4), leaves)
    grads_ref = torch.autograd.grad(_loss(selective_scan_loop, leaves), leaves)
    for name, g, g_ref in zip(NAMES, grads, grads_ref):
        assert rel_err(g, g_ref) <= TOL, name


def test_gradcheck():
    x = _inputs(batch=1, length=5, dm=2, n=2, groups=2)
    leaves = tuple(x[name].clone().requires_grad_() for name in NAMES)

    def fn(u, delta, A, B, C, D, z, delta_bias, state):
        return selective_scan(u, delta, A, B, C, D, z, delta_bias, True, state, True, chunk_size=2)

    assert torch.autograd.gradcheck(fn, leaves)


def test_large_step_size_no_nan():
    """Δ·A of order -1e4 (decay underflows to 0): finite outputs and gradients, state forgotten."""
    x = _inputs(length=9, groups=2)
    x["delta"] = torch.full_like(x["delta"], 1e4)
    leaves = [x[name].clone().requires_grad_() for name in NAMES]
    y, final = selective_scan(*leaves[:8], True, leaves[8], True, chunk_size=4)
    y_ref, final_ref = selective_scan_loop(*leaves[:8], True, leaves[8], True)
    assert torch.isfinite(y).all() and torch.isfinite(final).all()
    assert rel_err(y, y_ref) <= TOL and rel_err(final, final_ref) <= TOL
    grads = torch.autograd.grad(y.sum() + final.sum(), leaves)
    assert all(torch.isfinite(g).all() for g in grads)
    assert grads[-1].abs().max() == 0  # the initial state is fully forgotten after the first token


def test_dtypes_and_dispatch():
    x = _inputs(groups=2, dtype=torch.bfloat16)
    x["A"] = x["A"].float()
    y, final = selective_scan_op(*_args(x), x["initial_state"].float(), True, backend="reference")
    assert y.dtype == torch.bfloat16 and final.dtype == torch.float32
    x32 = {k: v.float() for k, v in x.items()}
    y32, final32 = selective_scan_loop(*_args(x32), x32["initial_state"], True)
    assert rel_err(y, y32) < 1e-2 and rel_err(final, final32) < 1e-5


def test_bad_arguments():
    x = _inputs(groups=2)
    with pytest.raises(ValueError, match="A must be"):
        selective_scan(x["u"], x["delta"], x["A"][:3], x["B"], x["C"])
    with pytest.raises(ValueError, match="B must be"):
        selective_scan(x["u"], x["delta"], x["A"], x["B"][..., :2], x["C"])
    with pytest.raises(ValueError, match="divisible"):
        groups3 = torch.randn(2, 11, 3, 3, dtype=F64)
        selective_scan(x["u"], x["delta"], x["A"], groups3, groups3)
    with pytest.raises(ValueError, match="initial_state"):
        selective_scan(x["u"], x["delta"], x["A"], x["B"], x["C"], initial_state=x["initial_state"][:, :2])
    with pytest.raises(ValueError, match="delta must be"):
        selective_scan(x["u"], x["delta"][:, :3], x["A"], x["B"], x["C"])
