"""Reference causal_conv1d: whole-sequence form vs the step loop, vs the formula, state carrying,
gradients (autograd of the loop, gradcheck)."""

from __future__ import annotations

import pytest
import torch

from hybridzoo.kernels import causal_conv1d as causal_conv1d_op
from hybridzoo.kernels.reference import causal_conv1d, causal_conv1d_loop, causal_conv1d_step
from hybridzoo.utils import rel_err

F64 = torch.float64
TOL = 1e-10


def _inputs(batch=2, length=7, dm=3, width=4, seed=0, dtype=F64):
    torch.manual_seed(seed)
    x = torch.randn(batch, length, dm, dtype=dtype)
    weight = torch.randn(dm, width, dtype=dtype)
    bias = torch.randn(dm, dtype=dtype)
    state = torch.randn(batch, width - 1, dm, dtype=dtype)
    return x, weight, bias, state


def test_loop_matches_formula():
    """The ground truth itself against y_t[d] = bias[d] + Σ_i w[d, i] x_{t-W+1+i}[d], written out."""
    x, weight, bias, state = _inputs(batch=1, length=5, dm=2, width=3)
    y, final = causal_conv1d_loop(x, weight, bias, initial_state=state, output_final_state=True)
    padded = torch.cat([state, x], dim=1)[0]  # position t of x is row t + W - 1
    expected = torch.zeros(5, 2, dtype=F64)
    for t in range(5):
        for d in range(2):
            expected[t, d] = bias[d] + sum(weight[d, i] * padded[t + i, d] for i in range(3))
    assert rel_err(y[0], expected) <= TOL
    assert rel_err(final[0], padded[-2:]) <= TOL


@pytest.mark.parametrize("width", [1, 2, 4])
@pytest.mark.parametrize("length", [1, 7])
@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("with_bias,activation", [(False, None), (True, "silu")])
def test_matches_loop(width, length, with_state, with_bias, activation):
    x, weight, bias, state = _inputs(length=length, width=width)
    kwargs = dict(initial_state=state if with_state else None, output_final_state=True, activation=activation)
    bias = bias if with_bias else None
    y, final = causal_conv1d(x, weight, bias, **kwargs)
    y_ref, final_ref = causal_conv1d_loop(x, weight, bias, **kwargs)
    assert y.shape == x.shape and final.shape == (2, width - 1, 3)
    assert rel_err(y, y_ref) <= TOL
    assert rel_err(final, final_ref) <= TOL


def test_short_input_keeps_part_of_the_state():
    """T < W - 1: the final state is the tail of cat(initial_state, x), partly the old state."""
    x, weight, bias, state = _inputs(length=1, width=4)
    _, final = causal_conv1d(x, weight, bias, initial_state=state, output_final_state=True)
    assert rel_err(final[:, :2], state[:, 1:]) == 0.0
    assert rel_err(final[:, 2:], x) == 0.0


@pytest.mark.parametrize("width", [2, 4])
def test_two_calls_equal_one(width):
    x, weight, bias, state = _inputs(length=9, width=width)
    y, final = causal_conv1d(x, weight, bias, initial_state=state, output_final_state=True, activation="silu")
    ys, carried = [], state
    for piece in (x[:, :1], x[:, 1:5], x[:, 5:]):  # includes a piece shorter than W - 1
        y_piece, carried = causal_conv1d(piece, weight, bias, initial_state=carried, output_final_state=True,
                                         activation="silu")
        ys.append(y_piece)
    assert rel_err(torch.cat(ys, 1), y) <= TOL
    assert rel_err(carried, final) <= TOL


def test_decoding_steps_equal_full():
    x, weight, bias, _ = _inputs(length=8)
    y, final = causal_conv1d(x, weight, bias, output_final_state=True, activation="silu")
    y_pre, state = causal_conv1d(x[:, :3], weight, bias, output_final_state=True, activation="silu")
    ys = [y_pre]
    for t in range(3, 8):
        y_t, state = causal_conv1d_step(x[:, t], weight, bias, state, activation="silu")
        ys.append(y_t[:, None])
    assert rel_err(torch.cat(ys, 1), y) <= TOL
    assert rel_err(state, final) <= TOL


def _leaves(width=4, length=6):
    x, weight, bias, state = _inputs(length=length, width=width)
    return [t.clone().requires_grad_() for t in (x, weight, bias, state)]


def _loss(fn, x, weight, bias, state):
    y, final = fn(x, weight, bias, initial_state=state, output_final_state=True, activation="silu")
    torch.manual_seed(1)  # fixed cotangents (torch.randn, not randn_like: that follows the strides)
    return (y * torch.randn(y.shape, dtype=y.dtype)).sum() + (final * torch.randn(final.shape, dtype=y.dtype)).sum()


@pytest.mark.parametrize("width", [2, 4])
@pytest.mark.parametrize("length", [2, 6])
def test_gradients_match_loop(width, length):
    leaves = _leaves(width, length)
    grads = torch.autograd.grad(_loss(causal_conv1d, *leaves), leaves)
    grads_ref = torch.autograd.grad(_loss(causal_conv1d_loop, *leaves), leaves)
    for name, g, g_ref in zip(("x", "weight", "bias", "initial_state"), grads, grads_ref):
        assert rel_err(g, g_ref) <= TOL, name


def test_gradcheck():
    x, weight, bias, state = _leaves(width=3, length=4)

    def fn(x, weight, bias, state):
        y, final = causal_conv1d(x, weight, bias, initial_state=state, output_final_state=True, activation="silu")
        return y, final

    assert torch.autograd.gradcheck(fn, (x, weight, bias, state))


def test_dtypes_and_dispatch():
    x, weight, bias, state = _inputs(dtype=torch.bfloat16)
    y, final = causal_conv1d_op(x, weight, bias, initial_state=state, output_final_state=True, backend="reference")
    assert y.dtype == torch.bfloat16 and final.dtype == torch.bfloat16
    y32, _ = causal_conv1d(x.float(), weight.float(), bias.float(), initial_state=state.float())
    assert rel_err(y, y32) < 1e-2


def test_bad_arguments():
    x, weight, bias, state = _inputs()
    with pytest.raises(ValueError, match="activation"):
        causal_conv1d(x, weight, bias, activation="relu")
    with pytest.raises(ValueError, match="weight"):
        causal_conv1d(x, weight[:2], bias)
    with pytest.raises(ValueError, match="initial_state"):
        causal_conv1d(x, weight, bias, initial_state=state[:, :2])
    with pytest.raises(ValueError, match="x must be"):
        causal_conv1d_step(x, weight, bias)


def test_empty_sequence_keeps_the_tail():
    from hybridzoo.kernels.reference import causal_conv1d

    tail = torch.randn(2, 3, 5, dtype=torch.float64)
    y, final = causal_conv1d(torch.zeros(2, 0, 5, dtype=torch.float64), torch.randn(5, 4, dtype=torch.float64),
                             initial_state=tail, output_final_state=True)
    assert y.shape == (2, 0, 5) and torch.equal(final, tail)
