"""Gated delta rule: chunkwise (WY form) vs the step loop, the step vs the matrix formula,
gradients, resets, state passing, and parity with transformers' Qwen3-Next reference functions."""

from __future__ import annotations

import inspect

import pytest
import torch

from benchmarks.transformers_torch_path import torch_function
from hybridzoo.kernels import chunk_delta_rule as chunk_delta_rule_api
from hybridzoo.kernels.reference.delta_rule import chunk_delta_rule, delta_rule_loop, delta_rule_step
from hybridzoo.utils import rel_err
from tests.hf_pure import needs_parity_transformers

F64 = torch.float64


def make_inputs(B=2, T=37, Hk=2, H=4, K=8, V=6, decay=True, state=True, dtype=F64, seed=0,
                requires_grad=False):
    """Random inputs: L2-normalised keys, β in (0, 1), log decays in [-1, 0)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, Hk, K, generator=g, dtype=dtype)
    k = torch.nn.functional.normalize(torch.randn(B, T, Hk, K, generator=g, dtype=dtype), dim=-1)
    v = torch.randn(B, T, H, V, generator=g, dtype=dtype)
    log_a = -torch.rand(B, T, H, generator=g, dtype=dtype) if decay else None
    beta = torch.rand(B, T, H, generator=g, dtype=dtype)
    s0 = torch.randn(B, H, K, V, generator=g, dtype=dtype) if state else None
    tensors = [q, k, v, log_a, beta, s0]
    if requires_grad:
        for t in tensors:
            if t is not None:
                t.requires_grad_()
    return tensors


@pytest.mark.parametrize("chunk_size", [1, 16, 64, 37, 5])
@pytest.mark.parametrize("decay", [True, False])
@pytest.mark.parametrize("state", [True, False])
def test_chunked_matches_loop(chunk_size, decay, state):
    torch.manual_seed(0)
    q, k, v, log_a, beta, s0 = make_inputs(T=37, Hk=2, H=4, decay=decay, state=state)
    o_ref, s_ref = delta_rule_loop(q, k, v, log_a, beta, initial_state=s0, output_final_state=True)
    o, s = chunk_delta_rule(q, k, v, log_a, beta, initial_state=s0, output_final_state=True,
                            chunk_size=chunk_size)
    assert o.dtype == F64 and s.dtype == F64
    assert rel_err(o, o_ref) <= 1e-10
    assert rel_err(s, s_ref) <= 1e-10


def test_scale_and_no_final_state():
    q, k, v, log_a, beta, s0 = make_inputs(T=20, Hk=1, H=2)
    o_ref, _ = delta_rule_loop(q, k, v, log_a, beta, scale=0.3, initial_state=s0)
    o, s = chunk_delta_rule(q, k, v, log_a, beta, scale=0.3, initial_state=s0, chunk_size=8)
    assert s is None
    assert rel_err(o, o_ref) <= 1e-10
    # the default scale is K ** -0.5
    o_def, _ = chunk_delta_rule(q, k, v, log_a, beta, initial_state=s0, chunk_size=8)
    o_exp, _ = chunk_delta_rule(q, k, v, log_a, beta, scale=8 ** -0.5, initial_state=s0, chunk_size=8)
    assert rel_err(o_def, o_exp) <= 1e-14


def test_step_matches_matrix_formula():
    """S_t = a (I − β k kᵀ) S + β k vᵀ, o = scale Sᵀ q, written out per head with explicit matrices."""
    torch.manual_seed(1)
    B, Hk, H, K, V = 2, 1, 3, 4, 5
    q, k = torch.randn(B, Hk, K, dtype=F64), torch.randn(B, Hk, K, dtype=F64)
    v, beta = torch.randn(B, H, V, dtype=F64), torch.rand(B, H, dtype=F64)
    log_a, state = -torch.rand(B, H, dtype=F64), torch.randn(B, H, K, V, dtype=F64)
    o, new = delta_rule_step(q, k, v, log_a, beta, state, scale=0.7)
    for b in range(B):
        for h in range(H):
            kk, qq = k[b, h // (H // Hk)], q[b, h // (H // Hk)]
            a, bt = log_a[b, h].exp(), beta[b, h]
            s = a * (torch.eye(K, dtype=F64) - bt * torch.outer(kk, kk)) @ state[b, h] + bt * torch.outer(kk, v[b, h])
            assert rel_err(new[b, h], s) <= 1e-12
            assert rel_err(o[b, h], 0.7 * s.T @ qq) <= 1e-12
    # no decay = a decay of 1; no state = zeros
    o1, s1 = delta_rule_step(q, k, v, None, beta, None)
    o2, s2 = delta_rule_step(q, k, v, torch.zeros_like(log_a), beta, torch.zeros_like(state))
    assert rel_err(o1, o2) <= 1e-15 and rel_err(s1, s2) <= 1e-15


def test_decoding_with_step_matches_chunked():
    q, k, v, log_a, beta, s0 = make_inputs(T=30, Hk=1, H=2)
    o_full, s_full = chunk_delta_rule(q, k, v, log_a, beta, initial_state=s0, output_final_state=True,
                                      chunk_size=8)
    P = 19  # prefill with the chunked form, then decode token by token
    o_pre, state = chunk_delta_rule(q[:, :P], k[:, :P], v[:, :P], log_a[:, :P], beta[:, :P],
                                    initial_state=s0, output_final_state=True, chunk_size=8)
    outs = [o_pre]
    for t in range(P, q.shape[1]):
        o_t, state = delta_rule_step(q[:, t], k[:, t], v[:, t], log_a[:, t], beta[:, t], state)
        outs.append(o_t[:, None])
    assert rel_err(torch.cat(outs, dim=1), o_full) <= 1e-10
    assert rel_err(state, s_full) <= 1e-10


def test_split_into_two_calls_equals_one():
    q, k, v, log_a, beta, s0 = make_inputs(T=41, Hk=2, H=2)
    o_full, s_full = chunk_delta_rule(q, k, v, log_a, beta, initial_state=s0, output_final_state=True,
                                      chunk_size=16)
    cut = 23
    parts = [(slice(0, cut)), (slice(cut, None))]
    state, outs = s0, []
    for sl in parts:
        o, state = chunk_delta_rule(q[:, sl], k[:, sl], v[:, sl], log_a[:, sl], beta[:, sl],
                                    initial_state=state, output_final_state=True, chunk_size=16)
        outs.append(o)
    assert rel_err(torch.cat(outs, dim=1), o_full) <= 1e-10
    assert rel_err(state, s_full) <= 1e-10


def _grads(fn, inputs, chunk_size=None):
    q, k, v, log_a, beta, s0 = inputs
    kwargs = {} if chunk_size is None else {"chunk_size": chunk_size}
    o, s = fn(q, k, v, log_a, beta, initial_state=s0, output_final_state=True, **kwargs)
    g = torch.Generator().manual_seed(123)
    loss = (o * torch.randn(o.shape, generator=g, dtype=o.dtype)).sum() \
        + (s * torch.randn(s.shape, generator=g, dtype=s.dtype)).sum()  # gradients from the final state
    leaves = [t for t in inputs if t is not None]
    return torch.autograd.grad(loss, leaves)


@pytest.mark.parametrize("decay", [True, False])
@pytest.mark.parametrize("chunk_size", [1, 8, 64])
def test_gradients_match_loop(decay, chunk_size):
    inputs = make_inputs(B=1, T=21, Hk=1, H=2, K=4, V=3, decay=decay, requires_grad=True)
    g_ref = _grads(delta_rule_loop, inputs)
    g_chk = _grads(chunk_delta_rule, inputs, chunk_size=chunk_size)
    names = [n for n, t in zip("q k v log_a beta initial_state".split(), inputs) if t is not None]
    for name, a, b in zip(names, g_chk, g_ref):
        assert rel_err(a, b) <= 1e-10, name


def test_gradcheck_tiny():
    q, k, v, log_a, beta, s0 = make_inputs(B=1, T=5, Hk=1, H=2, K=3, V=2, requires_grad=True)

    def fn(q, k, v, log_a, beta, s0):
        o, s = chunk_delta_rule(q, k, v, log_a, beta, initial_state=s0, output_final_state=True,
                                chunk_size=2)
        return o, s

    assert torch.autograd.gradcheck(fn, (q, k, v, log_a, beta, s0))


def test_resets_give_zero_and_no_nan():
    """log_a = -inf forgets everything before it: no NaN in outputs or gradients."""
    q, k, v, log_a, beta, s0 = make_inputs(B=1, T=26, Hk=1, H=2, K=4, V=3)
    log_a = log_a.clone()
    log_a[0, 0, 0] = float("-inf")       # reset of the initial state, head 0
    log_a[0, 11, :] = float("-inf")      # reset at t = 11 (mid chunk for chunk_size 8), both heads
    log_a[0, 16, 1] = float("-inf")      # reset at a chunk boundary, head 1
    inputs = [t.requires_grad_() for t in (q, k, v, log_a, beta, s0)]
    o_ref, s_ref = delta_rule_loop(*inputs[:5], initial_state=s0, output_final_state=True)
    o, s = chunk_delta_rule(*inputs[:5], initial_state=s0, output_final_state=True, chunk_size=8)
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    assert rel_err(o, o_ref) <= 1e-10 and rel_err(s, s_ref) <= 1e-10
    # after a reset at t the outputs are those of a fresh start at t
    o_fresh, _ = chunk_delta_rule(q[:, 11:], k[:, 11:], v[:, 11:], log_a[:, 11:], beta[:, 11:],
                                  chunk_size=8)
    assert rel_err(o[:, 11:], o_fresh) <= 1e-10
    # gradients: finite, equal to the loop's, and zero for the forgotten initial state of head 0
    g_chk = _grads(chunk_delta_rule, inputs, chunk_size=8)
    g_ref = _grads(delta_rule_loop, inputs)
    for a, b in zip(g_chk, g_ref):
        assert torch.isfinite(a).all()
        assert rel_err(a, b) <= 1e-10
    assert (g_chk[5][:, 0] == 0).all() and (g_chk[5][:, 1] != 0).any()


def test_dtypes_float32_state_and_output_in_v_dtype():
    q, k, v, log_a, beta, s0 = make_inputs(T=20, dtype=torch.float64)
    qb, kb, vb = (x.to(torch.bfloat16) for x in (q, k, v))
    o, s = chunk_delta_rule(qb, kb, vb, log_a.float(), beta.to(torch.bfloat16),
                            initial_state=s0.float(), output_final_state=True, chunk_size=8)
    assert o.dtype == torch.bfloat16 and s.dtype == torch.float32
    o_ref, s_ref = delta_rule_loop(qb.double(), kb.double(), vb.double(), log_a, beta.to(torch.bfloat16).double(),
                                   initial_state=s0.float().double(), output_final_state=True)
    assert rel_err(o, o_ref) < 1e-2 and rel_err(s, s_ref) < 1e-5
    o1, s1 = delta_rule_step(qb[:, 0], kb[:, 0], vb[:, 0], log_a[:, 0].float(), beta[:, 0].float(), None)
    assert o1.dtype == torch.bfloat16 and s1.dtype == torch.float32


def test_public_api_reference_backend():
    q, k, v, log_a, beta, s0 = make_inputs(T=12)
    o, s = chunk_delta_rule_api(q, k, v, log_a, beta, initial_state=s0, output_final_state=True,
                                chunk_size=4, backend="reference")
    o_ref, s_ref = delta_rule_loop(q, k, v, log_a, beta, initial_state=s0, output_final_state=True)
    assert rel_err(o, o_ref) <= 1e-10 and rel_err(s, s_ref) <= 1e-10


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda a: a.update(q=a["q"][0]), "q must be"),
        (lambda a: a.update(k=a["k"][..., :3]), "k must have q's shape"),
        (lambda a: a.update(v=a["v"][:, :5]), "v must be"),
        (lambda a: a.update(v=a["v"][:, :, :3]), "multiple of"),
        (lambda a: a.update(log_a=a["log_a"][..., :1]), "log_a must be"),
        (lambda a: a.update(beta=a["beta"][:, :3]), "beta must be"),
        (lambda a: a.update(initial_state=a["initial_state"][..., :2]), "initial_state must be"),
        (lambda a: a.update(chunk_size=0), "chunk_size"),
    ],
)
def test_bad_shapes_raise(change, match):
    q, k, v, log_a, beta, s0 = make_inputs(T=8)
    args = dict(q=q, k=k, v=v, log_a=log_a, beta=beta, initial_state=s0, chunk_size=4)
    change(args)
    with pytest.raises(ValueError, match=match):
        chunk_delta_rule(args.pop("q"), args.pop("k"), args.pop("v"), args.pop("log_a"), args.pop("beta"), **args)


def test_step_bad_shapes_raise():
    q, k, v, log_a, beta, s0 = make_inputs(T=1)
    with pytest.raises(ValueError, match="state must be"):
        delta_rule_step(q[:, 0], k[:, 0], v[:, 0], log_a[:, 0], beta[:, 0], s0[:, :1])
    with pytest.raises(ValueError, match="q must be"):
        delta_rule_step(q, k, v, log_a, beta, None)


# ---------------------------------------------------------------- parity with transformers


def _transformers_fn(name):
    """The pure-PyTorch function, even when the module-level name is wrapped to dispatch to fla."""
    qwen3_next = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    return torch_function(getattr(qwen3_next, name))


@needs_parity_transformers
@pytest.mark.parametrize("name", ["torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"])
def test_parity_with_transformers(name):
    fn = _transformers_fn(name)
    assert inspect.getsourcefile(fn).endswith("modeling_qwen3_next.py")
    q, k, v, log_a, beta, s0 = make_inputs(B=2, T=45, Hk=2, H=4, K=16, V=8, dtype=torch.float32)
    kwargs = {"chunk_size": 16} if "chunk" in name else {}
    o_ref, s_ref = fn(q, k, v, log_a, beta, initial_state=s0, output_final_state=True,
                      use_qk_l2norm_in_kernel=False, **kwargs)
    # transformers scales queries by K ** -0.5: our default scale
    o, s = chunk_delta_rule(q, k, v, log_a, beta, initial_state=s0, output_final_state=True, chunk_size=16)
    assert o.dtype == torch.float32 and s.dtype == torch.float32
    assert rel_err(o, o_ref) < 1e-5
    assert rel_err(s, s_ref) < 1e-5
