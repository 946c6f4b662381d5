"""Reference scans of the linear recurrence h_t = A_t h_{t-1} + b_t (seed 000).

Ground truths: a plain state loop written here (h = A h + b, no combine), torch autograd of that
loop, central finite differences, and the combine counts quoted by seed 000 for T = 1000.
"""

from __future__ import annotations

import math

import pytest
import torch

from hybridzoo.kernels.reference.scan import (
    CombineCounter,
    blelloch_scan,
    combine_diagonal,
    combine_matrix,
    compose_all,
    hillis_steele_scan,
    linear_recurrence_backward,
    reverse_scan,
    sequential_scan,
)
from hybridzoo.utils import rel_err

F64 = torch.float64
SCANS = {"sequential": sequential_scan, "hillis_steele": hillis_steele_scan, "blelloch": blelloch_scan}


# ----------------------------------------------------------------------------- ground truth


def plain_loop(a, b, h0=None):
    """h_t = A_t h_{t-1} + b_t, one step at a time; dense iff a has one more dim than b."""
    dense = a.dim() == b.dim() + 1
    h = torch.zeros_like(b[0]) if h0 is None else h0
    states = []
    for t in range(b.shape[0]):
        h = (a[t] @ h.unsqueeze(-1)).squeeze(-1) + b[t] if dense else a[t] * h + b[t]
        states.append(h)
    return torch.stack(states)


def plain_decays(a):
    """Prefix products A_t ⋯ A_1, one multiplication at a time (later step on the left)."""
    dense = a.dim() >= 3 and a.shape[-1] == a.shape[-2]
    out, P = [], None
    for t in range(a.shape[0]):
        P = a[t] if P is None else (a[t] @ P if dense else a[t] * P)
        out.append(P)
    return torch.stack(out)


def diag_inputs(seed, T, channels=(2, 3), h0=True):
    g = torch.Generator().manual_seed(seed)
    a = torch.rand(T, *channels, generator=g, dtype=F64) * 0.5 + 0.5  # decays in [0.5, 1)
    b = torch.randn(T, *channels, generator=g, dtype=F64)
    return a, b, (torch.randn(*channels, generator=g, dtype=F64) if h0 else None)


def dense_inputs(seed, T, channels=(2,), N=3, h0=True):
    g = torch.Generator().manual_seed(seed)
    A = torch.randn(T, *channels, N, N, generator=g, dtype=F64) / math.sqrt(N)  # spectral radius ~1
    b = torch.randn(T, *channels, N, generator=g, dtype=F64)
    return A, b, (torch.randn(*channels, N, generator=g, dtype=F64) if h0 else None)


# ----------------------------------------------------------------------------- the combine


def test_dense_combine_is_associative_and_not_commutative():
    torch.manual_seed(0)
    p1, p2, p3 = [(torch.randn(3, 3, dtype=F64), torch.randn(3, dtype=F64)) for _ in range(3)]
    left = combine_matrix(combine_matrix(p1, p2), p3)
    right = combine_matrix(p1, combine_matrix(p2, p3))
    assert rel_err(left[0], right[0]) <= 1e-12 and rel_err(left[1], right[1]) <= 1e-12
    swapped = combine_matrix(p2, p1)
    forward = combine_matrix(p1, p2)
    assert rel_err(swapped[0], forward[0]) > 1e-2 and rel_err(swapped[1], forward[1]) > 1e-2
    # p1 then p2 applied to a state is the composed map applied once (earlier step first)
    h = torch.randn(3, dtype=F64)
    two_steps = p2[0] @ (p1[0] @ h + p1[1]) + p2[1]
    assert rel_err(forward[0] @ h + forward[1], two_steps) <= 1e-12
    total = compose_all([p1, p2, p3])
    assert rel_err(total[0], left[0]) <= 1e-12 and rel_err(total[1], left[1]) <= 1e-12


def test_diagonal_combine_applies_earlier_step_first():
    # seed: "multiply by 0.5 and add 1" then "multiply by 0.5 and add 0" is (0.25, 0.5)
    one = (torch.tensor([0.5], dtype=F64), torch.tensor([1.0], dtype=F64))
    two = (torch.tensor([0.5], dtype=F64), torch.tensor([0.0], dtype=F64))
    a, b = combine_diagonal(one, two)
    assert a.item() == 0.25 and b.item() == 0.5
    a, b = compose_all([two, one])  # the other order: 0.5 (0.5 h + 0) + 1
    assert a.item() == 0.25 and b.item() == 1.0


# ----------------------------------------------------------------------------- scans vs loop


@pytest.mark.parametrize("method", list(SCANS))
@pytest.mark.parametrize("T", [1, 7, 50, 1000])
@pytest.mark.parametrize("with_h0", [False, True])
def test_diagonal_scans_match_loop(method, T, with_h0):
    a, b, h0 = diag_inputs(T, T, h0=with_h0)
    states, decays = SCANS[method](a, b, h0)
    assert states.dtype == F64 and states.shape == b.shape and decays.shape == a.shape
    assert rel_err(states, plain_loop(a, b, h0)) <= 1e-10
    assert rel_err(decays, plain_decays(a)) <= 1e-10


@pytest.mark.parametrize("method", list(SCANS))
@pytest.mark.parametrize("T", [1, 7, 50])
@pytest.mark.parametrize("with_h0", [False, True])
def test_dense_scans_match_loop(method, T, with_h0):
    A, b, h0 = dense_inputs(100 + T, T, h0=with_h0)
    states, decays = SCANS[method](A, b, h0)
    assert states.shape == b.shape and decays.shape == A.shape
    assert rel_err(states, plain_loop(A, b, h0)) <= 1e-10
    assert rel_err(decays, plain_decays(A)) <= 1e-10


@pytest.mark.parametrize("method", list(SCANS))
def test_scalar_decay_broadcast_and_resets(method):
    """a·I transitions: a [T, H, 1] against b [T, H, N]; a = 0 (a reset) zeroes the past."""
    a, b, h0 = diag_inputs(3, 37, channels=(2, 4))
    a = a[..., :1].clone()
    a[20, 1] = 0.0
    states, decays = SCANS[method](a, b, h0)
    assert decays.shape == a.shape
    assert rel_err(states, plain_loop(a, b, h0)) <= 1e-10
    assert torch.equal(states[20, 1], b[20, 1]) and (decays[20:, 1] == 0).all()


def test_scan_rejects_bad_shapes_and_keeps_float32_states():
    a, b, h0 = diag_inputs(0, 5)
    with pytest.raises(ValueError, match="h0"):
        blelloch_scan(a, b, h0[:1])
    with pytest.raises(ValueError, match="diagonal"):
        hillis_steele_scan(a[:4], b)
    with pytest.raises(ValueError, match="dense"):
        sequential_scan(torch.ones(5, 2, 3, 4), torch.ones(5, 2, 3))
    out = blelloch_scan(a.bfloat16(), b.bfloat16())
    assert out.states.dtype == torch.float32 and out.decays.dtype == torch.float32


def test_scans_are_differentiable_into_h0():
    a, b, h0 = diag_inputs(5, 23)
    A, bd, hd = dense_inputs(6, 23)
    for inputs in ((a, b, h0), (A, bd, hd)):
        leaves = [x.clone().requires_grad_() for x in inputs]
        w = torch.randn_like(inputs[1])
        ref = torch.autograd.grad((plain_loop(*leaves) * w).sum(), leaves)
        for method in ("hillis_steele", "blelloch"):
            got = torch.autograd.grad((SCANS[method](*leaves).states * w).sum(), leaves)
            for x, y in zip(got, ref):
                assert rel_err(x, y) <= 1e-10


# ----------------------------------------------------------------------------- combine counts


def count(method, T):
    a, b, _ = diag_inputs(0, T, channels=(1,), h0=False)
    counter = CombineCounter()
    SCANS[method](a, b, counter=counter)
    return counter.combines


def test_seed_combine_counts_for_T_1000():
    # 999 up + 999 down + 1000 to go inclusive (seed 000 also counts the no-op combines with the
    # identity steps that pad 1000 to 1024, and gets 3,046)
    assert count("blelloch", 1000) == 2998
    assert count("hillis_steele", 1000) == 8977
    assert count("sequential", 1000) == 999


@pytest.mark.parametrize("T", [1, 2, 7, 64, 100, 513, 1000])
def test_combine_count_bounds(T):
    L = math.ceil(math.log2(T)) if T > 1 else 0
    padded = 2**L
    blelloch, hillis, loop = count("blelloch", T), count("hillis_steele", T), count("sequential", T)
    assert loop == T - 1
    # work-efficient: at most 3T combines (exactly 3T - 2), against T - 1 for the loop
    assert blelloch <= 3 * T
    assert blelloch == max(3 * T - 2, 1)
    # Hillis-Steele: L rounds of fewer than T combines each, more than T(L - 2) in all
    assert T * (L - 2) < hillis <= T * L or T == 1
    if T >= 64:
        assert hillis > blelloch  # T log T outgrows the work-efficient scan's O(T)


# ----------------------------------------------------------------------------- reverse scan


@pytest.mark.parametrize("method", list(SCANS))
def test_reverse_scan_matches_backward_loop(method):
    a, b, h_end = diag_inputs(7, 29)
    states, decays = reverse_scan(a, b, h_end, method=method)
    h, expected = h_end, []
    for t in reversed(range(29)):  # states[t] = a[t] * states[t + 1] + b[t], states[T] = h_end
        h = a[t] * h + b[t]
        expected.append(h)
    assert rel_err(states, torch.stack(expected[::-1])) <= 1e-10
    assert rel_err(decays[0], a.prod(0)) <= 1e-10 and torch.equal(decays[-1], a[-1])
    A, bd, hd = dense_inputs(8, 11)
    states, decays = reverse_scan(A, bd, hd, method=method)
    h, expected = hd, []
    for t in reversed(range(11)):
        h = A[t] @ h.unsqueeze(-1)
        h = h.squeeze(-1) + bd[t]
        expected.append(h)
    assert rel_err(states, torch.stack(expected[::-1])) <= 1e-10
    assert rel_err(decays[0], compose_all([(A[t], bd[t]) for t in reversed(range(11))])[0]) <= 1e-10


# ----------------------------------------------------------------------------- backward


def test_linear_recurrence_backward_matches_finite_differences():
    """Seed 000: all three gradients of a random 50-step recurrence, by central differences."""
    torch.manual_seed(0)
    T, N = 50, 3
    a = torch.rand(T, N, dtype=F64) * 0.5 + 0.5
    b = torch.randn(T, N, dtype=F64)
    h0 = torch.randn(N, dtype=F64)
    c = torch.randn(T, N, dtype=F64)  # L = Σ_t <c_t, h_t>, so the direct gradient g_t is c_t

    def loss(a, b, h0):
        return float((plain_loop(a, b, h0) * c).sum())

    eps = 1e-6
    fd = []
    for i, x in enumerate((a, b, h0)):
        grad = torch.zeros_like(x)
        for j in range(x.numel()):
            plus, minus = [[a, b, h0][k].clone() for k in range(3)], [[a, b, h0][k].clone() for k in range(3)]
            plus[i].view(-1)[j] += eps
            minus[i].view(-1)[j] -= eps
            grad.view(-1)[j] = (loss(*plus) - loss(*minus)) / (2 * eps)
        fd.append(grad)
    for method in SCANS:
        da, db, dh0 = linear_recurrence_backward(a, b, h0, c, method=method)
        assert rel_err(da, fd[0]) <= 1e-7 and rel_err(db, fd[1]) <= 1e-7 and rel_err(dh0, fd[2]) <= 1e-7
    # the placeholder answer db = g (ignoring paths through later states) is far off
    assert rel_err(c, fd[1]) > 0.1


def test_linear_recurrence_backward_matches_autograd_diagonal_and_scalar():
    a, b, h0 = diag_inputs(11, 40, channels=(2, 5))
    for decay in (a, a[..., :1]):  # diagonal, then scalar a·I broadcast over the state
        g = torch.randn_like(b)
        leaves = [x.clone().requires_grad_() for x in (decay, b, h0)]
        ref = torch.autograd.grad((plain_loop(*leaves) * g).sum(), leaves)
        got = linear_recurrence_backward(decay, b, h0, g)
        assert got[0].shape == decay.shape
        for x, y in zip(got, ref):
            assert rel_err(x, y) <= 1e-10


@pytest.mark.parametrize("method", list(SCANS))
def test_linear_recurrence_backward_matches_autograd_dense(method):
    A, b, h0 = dense_inputs(12, 30, channels=(2,), N=4)
    g = torch.randn_like(b)
    leaves = [x.clone().requires_grad_() for x in (A, b, h0)]
    ref = torch.autograd.grad((plain_loop(*leaves) * g).sum(), leaves)
    got = linear_recurrence_backward(A, b, h0, g, method=method)
    for x, y in zip(got, ref):
        assert rel_err(x, y) <= 1e-10
    # without an initial state the gradient into a zero state is still returned
    da, db, dh0 = linear_recurrence_backward(A, b, None, g, method=method)
    assert dh0.shape == h0.shape and torch.isfinite(da).all()
