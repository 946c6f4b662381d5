"""Reference (gated) linear attention: chunked form, step, loop and closed-form decay gradient.

Ground truths: the step loop (itself checked against the explicit sum over paths), autograd
of the loop, and torch.autograd.gradcheck (finite differences).
"""

from __future__ import annotations

import pytest
import torch

from hybridzoo.kernels.reference.linear_attn import (
    chunk_linear_attn,
    gla_decay_grad,
    linear_attn_loop,
    linear_attn_step,
)
from hybridzoo.utils import rel_err

F64 = torch.float64
DECAYS = ("none", "scalar", "per_key")


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def make_inputs(seed, T, decay, *, B=None, Hk=None, H=None, K=None, V=None, state=True):
    """Random q, k, v, log_a, initial_state with random small B/Hk/H/K/V unless given."""
    g = torch.Generator().manual_seed(seed)
    pick = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=g))  # noqa: E731
    B = B or pick(1, 2)
    Hk = Hk or pick(1, 2)
    H = H or Hk * pick(1, 2)
    K = K or pick(2, 6)
    V = V or pick(2, 5)
    q = torch.randn(B, T, Hk, K, generator=g, dtype=F64)
    k = torch.randn(B, T, Hk, K, generator=g, dtype=F64)
    v = torch.randn(B, T, H, V, generator=g, dtype=F64)
    gate = {"none": None, "scalar": (B, T, H), "per_key": (B, T, H, K)}[decay]
    # decays in about (0.2, 1): strong enough to matter, weak enough for memory across chunks
    log_a = None if gate is None else -1.5 * torch.rand(gate, generator=g, dtype=F64)
    s0 = torch.randn(B, H, K, V, generator=g, dtype=F64) if state else None
    return q, k, v, log_a, s0


def explicit_sum(q, k, v, log_a, s0, scale):
    """The read as a sum over paths, token by token:

    o_t = scale * sum_{s<=t} (q_t ⊙ prod_{s<r<=t} a_r ⊙ k_s) v_s + scale * (q_t ⊙ prod_{r<=t} a_r) S_0.
    """
    B, T, Hk, K = q.shape
    H = v.shape[2]
    G = H // Hk
    if log_a is None:
        log_a = torch.zeros(B, T, H, dtype=q.dtype)
    la = log_a if log_a.dim() == 4 else log_a[..., None].expand(B, T, H, K)
    o = torch.zeros_like(v)
    for h in range(H):
        for t in range(T):
            qt = q[:, t, h // G]
            for s in range(t + 1):
                decay = torch.exp(la[:, s + 1:t + 1, h].sum(1))          # [B, K]
                o[:, t, h] += ((qt * decay * k[:, s, h // G]).sum(-1))[:, None] * v[:, s, h]
            if s0 is not None:
                decay = torch.exp(la[:, :t + 1, h].sum(1))
                o[:, t, h] += torch.einsum("bk,bkv->bv", qt * decay, s0[:, h])
    return scale * o


@pytest.mark.parametrize("decay", DECAYS)
def test_loop_is_the_explicit_sum(decay):
    q, k, v, log_a, s0 = make_inputs(1, 6, decay, Hk=1, H=2)
    o, _ = linear_attn_loop(q, k, v, log_a, initial_state=s0, scale=0.7)
    assert rel_err(o, explicit_sum(q, k, v, log_a, s0, 0.7)) <= 1e-12


@pytest.mark.parametrize("decay", DECAYS)
@pytest.mark.parametrize("T", [37, 100])
@pytest.mark.parametrize("with_state", [False, True])
def test_chunked_matches_loop(decay, T, with_state):
    q, k, v, log_a, s0 = make_inputs(10 + T, T, decay, state=with_state)
    o_ref, s_ref = linear_attn_loop(q, k, v, log_a, initial_state=s0, output_final_state=True)
    for chunk_size in (1, 16, 64, T):
        o, s = chunk_linear_attn(q, k, v, log_a, initial_state=s0, output_final_state=True,
                                 chunk_size=chunk_size)
        assert o.dtype == v.dtype and s.dtype == F64 and o.shape == v.shape
        assert rel_err(o, o_ref) <= 1e-10, chunk_size
        assert rel_err(s, s_ref) <= 1e-10, chunk_size
    o, s = chunk_linear_attn(q, k, v, log_a, initial_state=s0, chunk_size=16)
    assert s is None


def test_grouped_heads_read_their_own_qk_head():
    """Hk < H: value head h uses q/k head h // (H // Hk), i.e. the same as repeating q/k."""
    q, k, v, log_a, s0 = make_inputs(3, 21, "per_key", B=2, Hk=2, H=6, K=3, V=2)
    o, s = chunk_linear_attn(q, k, v, log_a, initial_state=s0, output_final_state=True, chunk_size=8)
    rep = lambda x: x.repeat_interleave(3, dim=2)  # noqa: E731
    o_ref, s_ref = linear_attn_loop(rep(q), rep(k), v, log_a, initial_state=s0, output_final_state=True)
    assert rel_err(o, o_ref) <= 1e-10 and rel_err(s, s_ref) <= 1e-10
    head1, _ = linear_attn_loop(q[:, :, 1:], k[:, :, 1:], v[:, :, 3:], log_a[:, :, 3:],
                                initial_state=s0[:, 3:])
    assert rel_err(o[:, :, 3:], head1) <= 1e-10


@pytest.mark.parametrize("decay", DECAYS)
def test_step_decoding_matches_chunked(decay):
    T, prefill = 29, 11
    q, k, v, log_a, s0 = make_inputs(4, T, decay, Hk=1, H=2)
    o_ref, s_ref = chunk_linear_attn(q, k, v, log_a, initial_state=s0, output_final_state=True,
                                     chunk_size=8)
    la = lambda sl: None if log_a is None else log_a[:, sl]  # noqa: E731
    o_pre, state = chunk_linear_attn(q[:, :prefill], k[:, :prefill], v[:, :prefill], la(slice(0, prefill)),
                                     initial_state=s0, output_final_state=True, chunk_size=8)
    outs = [o_pre]
    for t in range(prefill, T):
        o_t, state = linear_attn_step(q[:, t], k[:, t], v[:, t], la(t), state)
        outs.append(o_t[:, None])
    assert rel_err(torch.cat(outs, 1), o_ref) <= 1e-10
    assert rel_err(state, s_ref) <= 1e-10


def test_step_with_no_state_starts_from_zero():
    q, k, v, log_a, _ = make_inputs(5, 1, "scalar", B=2, Hk=1, H=2, K=3, V=2)
    o, s = linear_attn_step(q[:, 0], k[:, 0], v[:, 0], log_a[:, 0], None, scale=0.5)
    o_ref, s_ref = linear_attn_step(q[:, 0], k[:, 0], v[:, 0], log_a[:, 0], torch.zeros_like(s), scale=0.5)
    assert rel_err(o, o_ref) == 0.0 and rel_err(s, s_ref) == 0.0
    assert rel_err(s, torch.einsum("bhk,bhv->bhkv", k[:, 0].expand(-1, 2, -1), v[:, 0])) == 0.0


@pytest.mark.parametrize("decay", DECAYS)
def test_split_calls_carry_the_state(decay):
    T, cut = 45, 19                         # the cut is not on a chunk boundary
    q, k, v, log_a, s0 = make_inputs(6, T, decay)
    o_ref, s_ref = chunk_linear_attn(q, k, v, log_a, initial_state=s0, output_final_state=True, chunk_size=16)
    la = lambda sl: None if log_a is None else log_a[:, sl]  # noqa: E731
    o1, s1 = chunk_linear_attn(q[:, :cut], k[:, :cut], v[:, :cut], la(slice(0, cut)), initial_state=s0,
                               output_final_state=True, chunk_size=16)
    o2, s2 = chunk_linear_attn(q[:, cut:], k[:, cut:], v[:, cut:], la(slice(cut, T)), initial_state=s1,
                               output_final_state=True, chunk_size=16)
    assert rel_err(torch.cat([o1, o2], 1), o_ref) <= 1e-10
    assert rel_err(s2, s_ref) <= 1e-10


def loss_and_grads(fn, q, k, v, log_a, s0, **kw):
    """Autograd gradients of a loss that uses both the output and the final state."""
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v, log_a, s0) if x is not None]
    args = iter(leaves)
    q_, k_, v_ = next(args), next(args), next(args)
    la_ = next(args) if log_a is not None else None
    s0_ = next(args) if s0 is not None else None
    o, s = fn(q_, k_, v_, la_, initial_state=s0_, output_final_state=True, **kw)
    g = torch.Generator().manual_seed(123)
    w_o = torch.randn(o.shape, generator=g, dtype=o.dtype)
    w_s = torch.randn(s.shape, generator=g, dtype=s.dtype)
    ((o * w_o).sum() + (s * w_s).sum()).backward()
    return [x.grad for x in leaves]


@pytest.mark.parametrize("decay", DECAYS)
def test_gradients_match_loop(decay):
    q, k, v, log_a, s0 = make_inputs(7, 37, decay, Hk=1, H=2)
    ref = loss_and_grads(linear_attn_loop, q, k, v, log_a, s0)
    got = loss_and_grads(chunk_linear_attn, q, k, v, log_a, s0, chunk_size=16)
    for name, a, b in zip(["q", "k", "v", "log_a", "initial_state"][: len(ref)], got, ref):
        assert rel_err(a, b) <= 1e-10, name


@pytest.mark.parametrize("decay", DECAYS)
def test_gradcheck(decay):
    q, k, v, log_a, s0 = make_inputs(8, 5, decay, B=1, Hk=1, H=2, K=2, V=2)
    inputs = [x.requires_grad_() for x in (q, k, v, log_a, s0) if x is not None]

    def fn(*xs):
        q, k, v = xs[:3]
        la = xs[3] if log_a is not None else None
        return chunk_linear_attn(q, k, v, la, initial_state=xs[-1], output_final_state=True, chunk_size=2)

    assert torch.autograd.gradcheck(fn, inputs)


@pytest.mark.parametrize("per_key", [True, False])
@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("use_final_state", [False, True])
def test_decay_grad_closed_form(per_key, with_state, use_final_state):
    T, Hk, H = 23, 1, 2
    q, k, v, log_a, s0 = make_inputs(9, T, "per_key" if per_key else "scalar", B=2, Hk=Hk, H=H,
                                     state=with_state)
    # q, k repeated to H heads (Hk < H) as leaves: autograd then gives each value head's share of dq, dk
    q_rep = q.repeat_interleave(H // Hk, dim=2).requires_grad_()
    k_rep = k.repeat_interleave(H // Hk, dim=2).requires_grad_()
    log_a.requires_grad_()
    o, s = chunk_linear_attn(q_rep, k_rep, v, log_a, initial_state=s0, output_final_state=True, chunk_size=8)
    g = torch.Generator().manual_seed(0)
    w_o, w_s = torch.randn(o.shape, generator=g, dtype=F64), torch.randn(s.shape, generator=g, dtype=F64)
    loss = (o * w_o).sum() + (use_final_state * (s * w_s).sum())
    loss.backward()
    extra = dict(final_state=s.detach(), dfinal_state=w_s) if use_final_state else {}
    dlog_a = gla_decay_grad(q, k, q_rep.grad, k_rep.grad, per_key=per_key, **extra)
    assert dlog_a.shape == log_a.shape
    assert rel_err(dlog_a, log_a.grad) <= 1e-10
    if use_final_state:                     # the final-state term is needed: without it, wrong
        assert rel_err(gla_decay_grad(q, k, q_rep.grad, k_rep.grad, per_key=per_key), log_a.grad) > 1e-3


@pytest.mark.parametrize("decay", ["scalar", "per_key"])
def test_reset_splits_the_sequence(decay):
    T, resets = 40, (9, 16, 27)             # 16 is on a chunk boundary of chunk_size 8
    q, k, v, log_a, s0 = make_inputs(11, T, decay, B=2, Hk=1, H=2)
    log_a = log_a.clone()
    for r in resets:
        log_a[:, r] = float("-inf")
    o, s = chunk_linear_attn(q, k, v, log_a, initial_state=s0, output_final_state=True, chunk_size=8)
    bounds = (0,) + resets + (T,)
    for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        o_seg, s_seg = linear_attn_loop(q[:, a:b], k[:, a:b], v[:, a:b], log_a[:, a:b],
                                        initial_state=s0 if i == 0 else None, output_final_state=True)
        assert rel_err(o[:, a:b], o_seg) <= 1e-10
    assert rel_err(s, s_seg) <= 1e-10

    # gradients: finite, equal to the loop's, and exactly 0 at the resets
    ref = loss_and_grads(linear_attn_loop, q, k, v, log_a, s0)
    got = loss_and_grads(chunk_linear_attn, q, k, v, log_a, s0, chunk_size=8)
    for name, a, b in zip(["q", "k", "v", "log_a", "initial_state"], got, ref):
        assert torch.isfinite(a).all() and rel_err(a, b) <= 1e-10, name
    assert (got[3][:, list(resets)] == 0).all()


def test_partial_per_key_reset_has_no_nan():
    q, k, v, log_a, s0 = make_inputs(12, 30, "per_key", B=1, Hk=1, H=2, K=4)
    log_a = log_a.clone()
    log_a[:, 5, :, :2] = float("-inf")      # only some keys reset
    log_a[:, 18, 1, 3] = float("-inf")
    ref = loss_and_grads(linear_attn_loop, q, k, v, log_a, s0)
    got = loss_and_grads(chunk_linear_attn, q, k, v, log_a, s0, chunk_size=7)
    for a, b in zip(got, ref):
        assert torch.isfinite(a).all() and rel_err(a, b) <= 1e-10
    o, _ = chunk_linear_attn(q, k, v, log_a, initial_state=s0, chunk_size=7)
    assert torch.isfinite(o).all()


@pytest.mark.parametrize("decay", DECAYS)
def test_float32_inputs_keep_a_float32_state(decay):
    q, k, v, log_a, s0 = make_inputs(13, 100, decay, B=2, Hk=2, H=4, K=8, V=8)
    o_ref, s_ref = linear_attn_loop(q, k, v, log_a, initial_state=s0, output_final_state=True)
    f32 = lambda x: None if x is None else x.float()  # noqa: E731
    o, s = chunk_linear_attn(f32(q), f32(k), f32(v), f32(log_a), initial_state=f32(s0),
                             output_final_state=True, chunk_size=32)
    assert o.dtype == torch.float32 and s.dtype == torch.float32
    assert rel_err(o, o_ref) < 1e-5 and rel_err(s, s_ref) < 1e-5


def test_bad_shapes_raise_clear_errors():
    q, k, v, log_a, s0 = make_inputs(14, 8, "per_key", B=2, Hk=2, H=4, K=3, V=2)
    cases = [
        (dict(q=q[0]), "q must be"),
        (dict(k=k[..., :2]), "k must have"),
        (dict(v=v[:, :5]), "v must be"),
        (dict(v=v[:, :, :3]), "multiple of"),
        (dict(log_a=log_a[..., :2]), "log_a must be"),
        (dict(initial_state=s0[:, :2]), "initial_state must be"),
        (dict(chunk_size=0), "chunk_size"),
    ]
    for change, message in cases:
        args = dict(q=q, k=k, v=v, log_a=log_a, initial_state=s0, chunk_size=4) | change
        with pytest.raises(ValueError, match=message):
            chunk_linear_attn(args.pop("q"), args.pop("k"), args.pop("v"), args.pop("log_a"), **args)
    with pytest.raises(ValueError, match="state must be"):
        linear_attn_step(q[:, 0], k[:, 0], v[:, 0], log_a[:, 0], s0[..., :1])
    with pytest.raises(ValueError, match="dq and dk"):
        gla_decay_grad(q, k, q[:, :, :1], k[:, :, :1])
