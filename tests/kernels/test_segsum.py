"""Additions-only segment sums of log decays (seed 000, "Long products without underflow").

Ground truths: explicit double loops over segments in float64, torch.autograd.gradcheck (finite
differences), and float64 sums of the same float32 logs for the float32 numerics tests.
"""

from __future__ import annotations

import math

import torch

from hybridzoo.kernels.reference.segsum import decay_to_end, segsum
from hybridzoo.utils import rel_err

F64 = torch.float64
NEG_INF = float("-inf")


def explicit_segsum(log_a):
    """out[..., t, s] = Σ_{r=s+1}^{t} log_a[..., r] for s <= t, -inf above: one segment at a time."""
    T = log_a.shape[-1]
    out = torch.full((*log_a.shape, T), NEG_INF, dtype=log_a.dtype)
    for t in range(T):
        for s in range(t + 1):
            out[..., t, s] = log_a[..., s + 1 : t + 1].sum(-1)
    return out


def segment_products(a):
    """P[..., t, s] = a_t ⋯ a_{s+1} (1 on the diagonal, 0 above): products, no logs."""
    T = a.shape[-1]
    out = torch.zeros(*a.shape, T, dtype=a.dtype)
    for t in range(T):
        for s in range(t + 1):
            out[..., t, s] = a[..., s + 1 : t + 1].prod(-1)
    return out


def test_segsum_matches_explicit_sums():
    torch.manual_seed(0)
    log_a = -torch.rand(2, 3, 9, dtype=F64)
    out = segsum(log_a)
    assert out.shape == (2, 3, 9, 9) and out.dtype == F64
    ref = explicit_segsum(log_a)
    below = torch.tril(torch.ones(9, 9, dtype=torch.bool))
    assert rel_err(out[..., below], ref[..., below]) <= 1e-12
    assert (out[..., ~below] == NEG_INF).all() and (out.diagonal(dim1=-2, dim2=-1) == 0).all()
    assert rel_err(torch.exp(out), segment_products(log_a.exp())) <= 1e-12
    assert rel_err(decay_to_end(log_a), ref[..., -1, :]) <= 1e-12
    assert segsum(log_a[..., :1]).shape == (2, 3, 1, 1)


def test_exp_segsum_gradcheck():
    torch.manual_seed(1)
    log_a = (-torch.rand(2, 6, dtype=F64)).requires_grad_()
    assert torch.autograd.gradcheck(lambda x: torch.exp(segsum(x)), (log_a,))
    assert torch.autograd.gradcheck(decay_to_end, (log_a,))


def test_reset_gives_exact_zero_and_no_nan_in_values_or_gradients():
    torch.manual_seed(2)
    for dtype in (torch.float32, F64):
        log_a = -torch.rand(3, 12, dtype=dtype)
        log_a[0, 5] = NEG_INF  # reset at step 5 of the first row
        log_a[1, 0] = NEG_INF  # a reset at position 0 is never inside a segment: no effect
        log_a[2, 4] = log_a[2, 9] = NEG_INF
        x = log_a.clone().requires_grad_()
        mask = torch.exp(segsum(x))
        assert not torch.isnan(mask).any()
        # segments (t, s) with s < 5 <= t cross the reset: exactly 0; the others are untouched
        assert (mask[0, 5:, :5] == 0).all() and (mask[0, :5, :5] > 0).tril().sum() == 15
        assert rel_err(mask[1], torch.exp(segsum(log_a[1].clamp_min(-1.0)))) <= 1e-6
        ref = segment_products(log_a.exp().to(F64))
        assert rel_err(mask, ref) <= (1e-6 if dtype == torch.float32 else 1e-12)
        w = torch.randn(mask.shape, dtype=dtype)
        (grad,) = torch.autograd.grad((mask * w).sum(), x)
        assert torch.isfinite(grad).all()
        # against an independent gradient: d/dlog_a[r] Σ w·P = Σ_{s < r <= t} w[t, s] P[t, s]
        P = ref
        ind = torch.zeros(12, 12, 12, dtype=F64)  # ind[r, t, s] = 1 if s < r <= t
        for r in range(12):
            ind[r, r:, :r] = 1
        expected = torch.einsum("rts,bts->br", ind, w.to(F64) * P)
        finite = torch.isfinite(log_a)
        assert rel_err(grad[finite], expected[finite]) <= (1e-5 if dtype == torch.float32 else 1e-12)
        grad_end = torch.autograd.grad(torch.exp(decay_to_end(x)).sum(), x)[0]
        assert torch.isfinite(grad_end).all()
        assert (torch.exp(decay_to_end(log_a))[0, :5] == 0).all()


def test_subtracting_cumulative_logs_gives_nan_at_a_reset():
    log_a = torch.tensor([-0.1, NEG_INF, -0.2, -0.3])
    S = torch.cumsum(log_a, 0)
    assert torch.isnan(torch.exp(S[3] - S[2]))  # -inf - (-inf): the trap segsum avoids
    assert torch.exp(segsum(log_a))[3, 2] == torch.exp(log_a[3])  # segment {3}: finite
    assert torch.exp(segsum(log_a))[3, 0] == 0  # segment {1, 2, 3} crosses the reset: exactly 0


# ----------------------------------------------------------------------------- float32 numerics


def float64_window_products(log_a, W):
    """exp(Σ of the last W float32 logs), summed in float64: the truth for the last window."""
    tail = log_a[-(W + 1) :].to(F64)
    return torch.exp(explicit_segsum(tail))


def test_cumulative_product_ratio_fails_where_segsum_does_not():
    """Decays 0.9 over 1,100 steps in float32: P_1100 / P_1000 is 1.0 or NaN, the truth 0.9**100."""
    log_a = torch.full((1100,), math.log(0.9), dtype=torch.float32)
    P = torch.cumprod(torch.exp(log_a), 0)
    ratio = P[1099] / P[999]
    truth = math.exp(100 * float(log_a[0].double()))  # ≈ 2.66e-5
    assert not (torch.isfinite(ratio) and abs(float(ratio) - truth) <= 0.5 * truth)
    seg = torch.exp(segsum(log_a[-101:]))[100, 0]  # additions only, over the window's own logs
    assert seg.dtype == torch.float32
    assert abs(float(seg) - truth) <= 1e-5 * truth


def test_long_sequence_window_products_float32():
    """100,000 steps: segsum of the final window stays at float32 precision; S_t - S_s does not."""
    T, W = 100_000, 20
    for decay, seg_tol in ((0.9999, 1e-5), (0.9, 1e-5)):  # cumulative log ≈ -10 and ≈ -10,536
        log_a = torch.full((T,), math.log(decay), dtype=torch.float32)
        truth = float64_window_products(log_a, W)
        seg = torch.exp(segsum(log_a[-(W + 1) :]))
        below = torch.tril(torch.ones(W + 1, W + 1, dtype=torch.bool))
        seg_err = rel_err(seg[below], truth[below])
        assert seg_err <= seg_tol
        S = torch.cumsum(log_a, 0)  # over the whole sequence, as the cumulative approach must
        S_tail = S[-(W + 1) :]
        diff = torch.exp(S_tail[:, None] - S_tail[None, :])
        cum_err = rel_err(diff[below], truth[below])
        # even with correctly rounded cumulative sums, the long difference loses accuracy
        assert cum_err > 5 * seg_err
        if decay == 0.9:
            assert cum_err > 1e-5  # float32 spacing at 10,536 is ~1e-3
