"""Packed documents (cu_seqlens) in the reference backend: THE SPEC of every op's packed form.

A packed call (through the public op, ``backend="reference"``, float64) must equal the step
loops (``*_loop``: the independent ground truth, not the chunked code under test) run on each
document alone from its own initial state, concatenated: outputs, final states and every
gradient (initial states included) to 1e-10. Documents of length 1, exactly a chunk, a chunk + 1,
several chunks, and longer than the attention window.
"""

from __future__ import annotations

import pytest
import torch

from hybridzoo.kernels import (
    attention,
    causal_conv1d,
    chunk_delta_rule,
    chunk_linear_attn,
    chunk_linear_attn_grads,
    selective_scan,
    selective_scan_grads,
    selective_scan_saved,
)
from hybridzoo.kernels.reference import (
    attention_loop,
    causal_conv1d_loop,
    delta_rule_loop,
    linear_attn_loop,
    selective_scan_loop,
)

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

F64 = torch.float64
CHUNK = 4
WINDOW = 3
# 1 token, exactly a chunk, a chunk + 1, several chunks (and longer than the window), 2 tokens
LENGTHS = (1, CHUNK, CHUNK + 1, 2 * CHUNK + 3, 2)
TOL = 1e-10


def cu_of(lengths, dtype=torch.int32):
    return torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=dtype)


def check_packed_equals_separate(packed, separate, inputs, per_token, cu, *, second_per_token=False, seed=0):
    """``packed(**inputs, cu_seqlens=cu)`` against ``separate(**slices)`` per document.

    Args:
        packed, separate: return ``(output [1, T, ...], second)``; ``second`` is the final state
            (``[N, ...]`` packed, ``[1, ...]`` per document) or, with ``second_per_token``, a
            per-token output (attention's lse) concatenated along time.
        inputs: name -> tensor or None; ``initial_state`` is sliced per document along dim 0.
        per_token: the names of the ``[1, T, ...]`` inputs, sliced along time.
    """
    g = torch.Generator().manual_seed(seed)
    bounds = list(zip(cu[:-1].tolist(), cu[1:].tolist()))

    def leaves():
        return {n: None if t is None else t.detach().clone().requires_grad_(True) for n, t in inputs.items()}

    mine = leaves()
    out, second = packed(**mine, cu_seqlens=cu)
    d_out = torch.randn(out.shape, generator=g, dtype=F64)
    d_second = torch.randn(second.shape, generator=g, dtype=F64)
    wanted = [n for n, t in mine.items() if t is not None]
    grads = torch.autograd.grad((out * d_out).sum() + (second * d_second).sum(), [mine[n] for n in wanted])

    truth = leaves()
    outs, seconds = [], []
    for n, (start, end) in enumerate(bounds):
        pieces = {}
        for name, t in truth.items():
            if t is None or (name not in per_token and name != "initial_state"):
                pieces[name] = t
            elif name in per_token:
                pieces[name] = t[:, start:end]
            else:
                pieces[name] = t[n:n + 1]
        o, s = separate(**pieces)
        outs.append(o)
        seconds.append(s)
    out_ref = torch.cat(outs, dim=1)
    second_ref = torch.cat(seconds, dim=1 if second_per_token else 0)
    grads_ref = torch.autograd.grad((out_ref * d_out).sum() + (second_ref * d_second).sum(),
                                    [truth[n] for n in wanted])

    assert out.shape == out_ref.shape and (out - out_ref).abs().max() < TOL
    assert second.shape == second_ref.shape and (second - second_ref).abs().max() < TOL
    for name, mine_g, ref_g in zip(wanted, grads, grads_ref, strict=True):
        assert mine_g is not None and ref_g is not None, name
        assert (mine_g - ref_g).abs().max() < TOL, f"d{name}: {(mine_g - ref_g).abs().max():.2e}"
    return grads, wanted


def linear_attn_inputs(decay, Hk, H, K=3, V=2, state=True, seed=1):
    g = torch.Generator().manual_seed(seed)
    T = sum(LENGTHS)
    gate = {"none": None, "scalar": (1, T, H), "per_key": (1, T, H, K)}[decay]
    return {
        "q": torch.randn(1, T, Hk, K, generator=g, dtype=F64),
        "k": torch.randn(1, T, Hk, K, generator=g, dtype=F64),
        "v": torch.randn(1, T, H, V, generator=g, dtype=F64),
        "log_a": None if gate is None else -1.5 * torch.rand(gate, generator=g, dtype=F64),
        "initial_state": torch.randn(len(LENGTHS), H, K, V, generator=g, dtype=F64) if state else None,
    }


@pytest.mark.parametrize("decay,Hk,H", [
    ("none", 2, 2), ("scalar", 2, 4), ("scalar", 1, 3),  # scalar with grouped heads: SSD
    ("per_key", 1, 2), ("per_key", 2, 2)])
def test_chunk_linear_attn_packed_equals_loop_per_document(decay, Hk, H):
    inputs = linear_attn_inputs(decay, Hk, H)

    def packed(q, k, v, log_a, initial_state, cu_seqlens):
        return chunk_linear_attn(q, k, v, log_a, initial_state=initial_state, output_final_state=True,
                                 chunk_size=CHUNK, cu_seqlens=cu_seqlens, backend="reference")

    def separate(q, k, v, log_a, initial_state):
        return linear_attn_loop(q, k, v, log_a, initial_state=initial_state, output_final_state=True)

    _, names = check_packed_equals_separate(packed, separate, inputs, {"q", "k", "v", "log_a"}, cu_of(LENGTHS))
    assert "initial_state" in names and ("log_a" in names) == (decay != "none")


def test_chunk_linear_attn_packed_without_initial_state_and_int64_cu():
    inputs = linear_attn_inputs("per_key", 2, 2, state=False)

    def packed(q, k, v, log_a, initial_state, cu_seqlens):
        return chunk_linear_attn(q, k, v, log_a, output_final_state=True, chunk_size=CHUNK,
                                 cu_seqlens=cu_seqlens, backend="reference")

    def separate(q, k, v, log_a, initial_state):
        return linear_attn_loop(q, k, v, log_a, output_final_state=True)

    check_packed_equals_separate(packed, separate, inputs, {"q", "k", "v", "log_a"}, cu_of(LENGTHS, torch.int64))


def test_chunk_linear_attn_grads_packed_equal_autograd():
    """The public ``*_grads`` entry point passes cu_seqlens through (reference: by rerun)."""
    x = linear_attn_inputs("scalar", 1, 2)
    cu = cu_of(LENGTHS)
    g = torch.Generator().manual_seed(5)
    leaves = {n: t.clone().requires_grad_(True) for n, t in x.items()}
    o, f = chunk_linear_attn(*(leaves[n] for n in ("q", "k", "v", "log_a")), initial_state=leaves["initial_state"],
                             output_final_state=True, chunk_size=CHUNK, cu_seqlens=cu, backend="reference")
    do, df = torch.randn(o.shape, generator=g, dtype=F64), torch.randn(f.shape, generator=g, dtype=F64)
    expected = torch.autograd.grad((o * do).sum() + (f * df).sum(), list(leaves.values()))
    got = chunk_linear_attn_grads(x["q"], x["k"], x["v"], x["log_a"], x["initial_state"], do, df,
                                  chunk_size=CHUNK, cu_seqlens=cu, backend="reference")
    # a call that ignored cu_seqlens would give other gradients (state leaks across documents)
    leaked = chunk_linear_attn_grads(x["q"], x["k"], x["v"], x["log_a"], x["initial_state"][:1], do, df[:1],
                                     chunk_size=CHUNK, backend="reference")
    assert (leaked[0] - expected[0]).abs().max() > 1e-3
    for a, b in zip(got, expected, strict=True):
        assert (a - b).abs().max() < TOL


@pytest.mark.parametrize("gated,Hk,H", [(True, 2, 2), (True, 1, 2), (False, 1, 2)])
def test_chunk_delta_rule_packed_equals_loop_per_document(gated, Hk, H):
    g = torch.Generator().manual_seed(2)
    T, K, V = sum(LENGTHS), 3, 2
    inputs = {
        "q": torch.randn(1, T, Hk, K, generator=g, dtype=F64),
        "k": torch.nn.functional.normalize(torch.randn(1, T, Hk, K, generator=g, dtype=F64), dim=-1),
        "v": torch.randn(1, T, H, V, generator=g, dtype=F64),
        "log_a": -torch.rand(1, T, H, generator=g, dtype=F64) if gated else None,
        "beta": torch.rand(1, T, H, generator=g, dtype=F64),
        "initial_state": torch.randn(len(LENGTHS), H, K, V, generator=g, dtype=F64),
    }

    def packed(q, k, v, log_a, beta, initial_state, cu_seqlens):
        return chunk_delta_rule(q, k, v, log_a, beta, initial_state=initial_state, output_final_state=True,
                                chunk_size=CHUNK, cu_seqlens=cu_seqlens, backend="reference")

    def separate(q, k, v, log_a, beta, initial_state):
        return delta_rule_loop(q, k, v, log_a, beta, initial_state=initial_state, output_final_state=True)

    check_packed_equals_separate(packed, separate, inputs, {"q", "k", "v", "log_a", "beta"}, cu_of(LENGTHS))


def scan_inputs(groups, with_z=True, seed=3):
    g = torch.Generator().manual_seed(seed)
    T, Dm, N = sum(LENGTHS), 4, 3
    shape_bc = (1, T, N) if groups is None else (1, T, groups, N)
    return {
        "u": torch.randn(1, T, Dm, generator=g, dtype=F64),
        "delta": torch.randn(1, T, Dm, generator=g, dtype=F64),
        "A": -torch.rand(Dm, N, generator=g, dtype=F64) - 0.1,
        "B": torch.randn(shape_bc, generator=g, dtype=F64),
        "C": torch.randn(shape_bc, generator=g, dtype=F64),
        "D": torch.randn(Dm, generator=g, dtype=F64),
        "z": torch.randn(1, T, Dm, generator=g, dtype=F64) if with_z else None,
        "delta_bias": torch.randn(Dm, generator=g, dtype=F64),
        "initial_state": torch.randn(len(LENGTHS), Dm, N, generator=g, dtype=F64),
    }


@pytest.mark.parametrize("groups,with_z", [(None, True), (2, True), (2, False)])
def test_selective_scan_packed_equals_loop_per_document(groups, with_z):
    def packed(u, delta, A, B, C, D, z, delta_bias, initial_state, cu_seqlens):
        return selective_scan(u, delta, A, B, C, D, z, delta_bias, True, initial_state, True,
                              cu_seqlens=cu_seqlens, backend="reference")

    def separate(u, delta, A, B, C, D, z, delta_bias, initial_state):
        return selective_scan_loop(u, delta, A, B, C, D, z, delta_bias, True, initial_state, True)

    _, names = check_packed_equals_separate(packed, separate, scan_inputs(groups, with_z),
                                            {"u", "delta", "B", "C", "z"}, cu_of(LENGTHS))
    assert {"A", "D", "delta_bias", "initial_state"} <= set(names)


def test_selective_scan_saved_and_grads_take_cu_seqlens():
    x = scan_inputs(2)
    cu = cu_of(LENGTHS)
    args = [x[n] for n in ("u", "delta", "A", "B", "C", "D", "z", "delta_bias")]
    y, final, saved = selective_scan_saved(*args, True, x["initial_state"], cu_seqlens=cu, backend="reference")
    y_ref, final_ref = selective_scan(*args, True, x["initial_state"], True, cu_seqlens=cu, backend="reference")
    assert final.shape == (len(LENGTHS), 4, 3)
    assert (y - y_ref).abs().max() < TOL and (final - final_ref).abs().max() < TOL
    g = torch.Generator().manual_seed(6)
    dy, df = torch.randn(y.shape, generator=g, dtype=F64), torch.randn(final.shape, generator=g, dtype=F64)
    leaves = [t.clone().requires_grad_(True) for t in args + [x["initial_state"]]]
    out, fin = selective_scan(*leaves[:8], True, leaves[8], True, cu_seqlens=cu, backend="reference")
    expected = torch.autograd.grad((out * dy).sum() + (fin * df).sum(), leaves)
    got = selective_scan_grads(*args, x["initial_state"], saved, dy, df, delta_softplus=True,
                               cu_seqlens=cu, backend="reference")
    for a, b in zip(got, expected, strict=True):
        assert (a - b).abs().max() < TOL


@pytest.mark.parametrize("activation,with_bias", [("silu", True), (None, False)])
def test_causal_conv1d_packed_equals_loop_per_document(activation, with_bias):
    g = torch.Generator().manual_seed(4)
    T, Dm, W = sum(LENGTHS), 3, 4  # documents of 1 and 2 tokens are shorter than the tail W - 1
    inputs = {
        "x": torch.randn(1, T, Dm, generator=g, dtype=F64),
        "weight": torch.randn(Dm, W, generator=g, dtype=F64),
        "bias": torch.randn(Dm, generator=g, dtype=F64) if with_bias else None,
        "initial_state": torch.randn(len(LENGTHS), W - 1, Dm, generator=g, dtype=F64),
    }

    def packed(x, weight, bias, initial_state, cu_seqlens):
        return causal_conv1d(x, weight, bias, initial_state=initial_state, output_final_state=True,
                             activation=activation, cu_seqlens=cu_seqlens, backend="reference")

    def separate(x, weight, bias, initial_state):
        return causal_conv1d_loop(x, weight, bias, initial_state=initial_state, output_final_state=True,
                                  activation=activation)

    check_packed_equals_separate(packed, separate, inputs, {"x"}, cu_of(LENGTHS))


@pytest.mark.parametrize("window,Hq,Hk", [(None, 2, 2), (WINDOW, 4, 2), (1, 2, 1), (None, 3, 1)])
def test_attention_packed_equals_loop_per_document(window, Hq, Hk):
    g = torch.Generator().manual_seed(7)
    T, D, Dv = sum(LENGTHS), 3, 2
    inputs = {
        "q": torch.randn(1, T, Hq, D, generator=g, dtype=F64),
        "k": torch.randn(1, T, Hk, D, generator=g, dtype=F64),
        "v": torch.randn(1, T, Hk, Dv, generator=g, dtype=F64),
    }

    def packed(q, k, v, cu_seqlens):
        return attention(q, k, v, window=window, return_lse=True, cu_seqlens=cu_seqlens, backend="reference")

    def separate(q, k, v):
        return attention_loop(q, k, v, window=window, return_lse=True)

    check_packed_equals_separate(packed, separate, inputs, {"q", "k", "v"}, cu_of(LENGTHS), second_per_token=True)


def test_one_document_equals_the_unpacked_call():
    x = linear_attn_inputs("per_key", 1, 2)
    T = x["q"].shape[1]
    args = [x[n] for n in ("q", "k", "v", "log_a")]
    o1, f1 = chunk_linear_attn(*args, initial_state=x["initial_state"][:1], output_final_state=True,
                               chunk_size=CHUNK, cu_seqlens=torch.tensor([0, T], dtype=torch.int32), backend="reference")
    o2, f2 = chunk_linear_attn(*args, initial_state=x["initial_state"][:1], output_final_state=True,
                               chunk_size=CHUNK, backend="reference")
    assert (o1 - o2).abs().max() < TOL and (f1 - f2).abs().max() < TOL


def test_packed_calls_refuse_bad_shapes():
    x = linear_attn_inputs("scalar", 1, 2)
    cu = cu_of(LENGTHS)
    args = [x[n] for n in ("q", "k", "v", "log_a")]
    with pytest.raises(ValueError, match="one per document"):
        chunk_linear_attn(*args, initial_state=x["initial_state"][:2], cu_seqlens=cu, backend="reference")
    with pytest.raises(ValueError, match="batch dimension must be 1"):
        chunk_linear_attn(*(t.expand(2, *t.shape[1:]) for t in args), cu_seqlens=cu, backend="reference")
    with pytest.raises(ValueError, match="must end at the packed length"):
        chunk_linear_attn(*args, cu_seqlens=cu_of(LENGTHS[:-1]), backend="reference")
    q = x["q"]
    with pytest.raises(ValueError, match="prefix together with cu_seqlens"):
        attention(q, q, q, prefix=(q, q), cu_seqlens=cu, backend="reference")
    with pytest.raises(ValueError, match="prefix together with cu_seqlens"):
        from hybridzoo.kernels.reference import attention as reference_attention

        reference_attention(q, q, q, prefix=(q, q), cu_seqlens=cu)
