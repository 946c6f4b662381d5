"""Reference attention: masked-softmax form vs the per-query loop (full, windows, prefixes incl.
longer than the window, GQA, Dv != D), vs torch SDPA, decoding with a K/V prefix, split calls,
log-sum-exp merging (the SeCO prefix/own-chunk split), gradients and gradcheck."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybridzoo.kernels import attention as attention_op
from hybridzoo.kernels.reference import attention, attention_loop, merge_attention
from hybridzoo.utils import rel_err

F64 = torch.float64
TOL = 1e-10
BATCH, LENGTH, HQ, HK, DK, DV = 2, 19, 4, 2, 8, 5


def _qkv(length=LENGTH, prefix_len=0, seed=0, dtype=F64, hq=HQ, hk=HK):
    torch.manual_seed(seed)
    q = torch.randn(BATCH, length, hq, DK, dtype=dtype)
    k = torch.randn(BATCH, length, hk, DK, dtype=dtype)
    v = torch.randn(BATCH, length, hk, DV, dtype=dtype)
    prefix = (torch.randn(BATCH, prefix_len, hk, DK, dtype=dtype), torch.randn(BATCH, prefix_len, hk, DV, dtype=dtype))
    return q, k, v, prefix


def _expand(x, groups):
    """[B, S, Hk, *] -> [B, Hk * groups, S, *] for SDPA (test only)."""
    return x.repeat_interleave(groups, dim=2).transpose(1, 2)


@pytest.mark.parametrize("window", [None, 1, 3, 8])
def test_loop_matches_sdpa(window):
    """The ground truth itself against torch's scaled_dot_product_attention (no prefix)."""
    q, k, v, _ = _qkv()
    o, _ = attention_loop(q, k, v, window=window)
    pos = torch.arange(LENGTH)
    mask = (pos[:, None] >= pos[None, :]) & (pos[:, None] - pos[None, :] < (window or LENGTH))
    o_sdpa = F.scaled_dot_product_attention(q.transpose(1, 2), _expand(k, HQ // HK), _expand(v, HQ // HK),
                                            attn_mask=mask).transpose(1, 2)
    assert rel_err(o, o_sdpa) <= TOL


@pytest.mark.parametrize("window", [None, 1, 3, 8])
@pytest.mark.parametrize("prefix_len", [None, 0, 5, 23])
def test_matches_loop(window, prefix_len):
    q, k, v, prefix = _qkv(prefix_len=prefix_len or 0)
    prefix = None if prefix_len is None else prefix
    o, lse = attention(q, k, v, window=window, prefix=prefix, return_lse=True)
    o_ref, lse_ref = attention_loop(q, k, v, window=window, prefix=prefix, return_lse=True)
    assert o.shape == (BATCH, LENGTH, HQ, DV) and lse.shape == (BATCH, LENGTH, HQ)
    assert rel_err(o, o_ref) <= TOL
    assert rel_err(lse, lse_ref) <= TOL


@pytest.mark.parametrize("hq,hk", [(4, 4), (4, 1)])
def test_head_layouts_and_scale(hq, hk):
    q, k, v, prefix = _qkv(prefix_len=5, hq=hq, hk=hk)
    o, lse = attention(q, k, v, window=4, prefix=prefix, scale=0.3, return_lse=True)
    o_ref, lse_ref = attention_loop(q, k, v, window=4, prefix=prefix, scale=0.3, return_lse=True)
    assert rel_err(o, o_ref) <= TOL and rel_err(lse, lse_ref) <= TOL


@pytest.mark.parametrize("window", [None, 3])
def test_decoding_with_prefix_equals_full(window):
    """Feed one token at a time with all previous K/V as prefix."""
    q, k, v, _ = _qkv(length=9)
    o, lse = attention(q, k, v, window=window, return_lse=True)
    for t in range(9):
        o_t, lse_t = attention(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], window=window,
                               prefix=(k[:, :t], v[:, :t]), return_lse=True)
        assert rel_err(o_t, o[:, t:t + 1]) <= TOL and rel_err(lse_t, lse[:, t:t + 1]) <= TOL
        if window is not None:  # a decoding cache keeps only the last window - 1 positions
            start = max(0, t - (window - 1))
            o_w, _ = attention(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], window=window,
                               prefix=(k[:, start:t], v[:, start:t]))
            assert rel_err(o_w, o[:, t:t + 1]) <= TOL


@pytest.mark.parametrize("window", [None, 3, 8])
def test_two_calls_equal_one(window):
    q, k, v, (kp, vp) = _qkv(prefix_len=5)
    o, lse = attention(q, k, v, window=window, prefix=(kp, vp), return_lse=True)
    o1, lse1 = attention(q[:, :7], k[:, :7], v[:, :7], window=window, prefix=(kp, vp), return_lse=True)
    prefix2 = (torch.cat([kp, k[:, :7]], 1), torch.cat([vp, v[:, :7]], 1))
    o2, lse2 = attention(q[:, 7:], k[:, 7:], v[:, 7:], window=window, prefix=prefix2, return_lse=True)
    assert rel_err(torch.cat([o1, o2], 1), o) <= TOL
    assert rel_err(torch.cat([lse1, lse2], 1), lse) <= TOL


@pytest.mark.parametrize("window", [None, 1, 3, 8])
@pytest.mark.parametrize("prefix_len", [5, 23])
def test_merge_prefix_part_and_own_part(window, prefix_len):
    """SeCO's split: [q attends only the prefix] merged with [q attends its own chunk causally]."""
    q, k, v, prefix = _qkv(prefix_len=prefix_len)
    o, lse = attention(q, k, v, window=window, prefix=prefix, return_lse=True)
    o_pre, lse_pre = attention(q, k[:, :0], v[:, :0], window=window, prefix=prefix, return_lse=True)
    o_pre_ref, lse_pre_ref = attention_loop(q, k[:, :0], v[:, :0], window=window, prefix=prefix, return_lse=True)
    assert rel_err(o_pre, o_pre_ref) <= TOL and torch.equal(lse_pre.isinf(), lse_pre_ref.isinf())
    assert rel_err(lse_pre.clamp(min=-1e4), lse_pre_ref.clamp(min=-1e4)) <= TOL
    o_own, lse_own = attention(q, k, v, window=window, return_lse=True)
    o_m, lse_m = merge_attention(o_pre, lse_pre, o_own, lse_own)
    assert torch.isfinite(o_m).all()
    assert rel_err(o_m, o) <= TOL and rel_err(lse_m, lse) <= TOL


def test_merge_prefix_blocks_full_attention():
    """Full attention: the prefix can be attended block by block and every part merged."""
    q, k, v, (kp, vp) = _qkv(prefix_len=23)
    o, lse = attention(q, k, v, prefix=(kp, vp), return_lse=True)
    o_m, lse_m = attention(q, k, v, return_lse=True)
    for block in (slice(0, 10), slice(10, 23)):
        o_b, lse_b = attention(q, k[:, :0], v[:, :0], prefix=(kp[:, block], vp[:, block]), return_lse=True)
        o_m, lse_m = merge_attention(o_m, lse_m, o_b, lse_b)
    assert rel_err(o_m, o) <= TOL and rel_err(lse_m, lse) <= TOL


def test_merge_empty_parts_no_nan():
    """lse = -inf parts contribute nothing, in values and gradients; two empty parts give 0, -inf."""
    torch.manual_seed(0)
    o1 = torch.randn(2, 3, 4, 5, dtype=F64, requires_grad=True)
    o2 = torch.randn(2, 3, 4, 5, dtype=F64, requires_grad=True)
    lse1 = torch.randn(2, 3, 4, dtype=F64)
    lse2 = torch.randn(2, 3, 4, dtype=F64)
    lse1[0] = float("-inf")
    lse2[0, 0] = float("-inf")  # both empty here
    lse1, lse2 = lse1.requires_grad_(), lse2.requires_grad_()
    o, lse = merge_attention(o1, lse1, o2, lse2)
    assert rel_err(o[0, 1:], o2[0, 1:]) <= TOL and rel_err(lse[0, 1:], lse2[0, 1:]) <= TOL
    assert (o[0, 0] == 0).all() and torch.isneginf(lse[0, 0]).all()
    assert rel_err(lse[1], torch.logaddexp(lse1[1], lse2[1])) <= TOL
    grads = torch.autograd.grad(o.sum() + lse.clamp(min=-1e4).sum(), (o1, lse1, o2, lse2))
    assert all(torch.isfinite(g).all() for g in grads)
    assert (grads[0][0] == 0).all() and (grads[1][0] == 0).all()


def test_prefix_only_without_visible_key():
    """window=1: the prefix is out of every window: o = 0, lse = -inf, gradients finite."""
    q, k, v, (kp, vp) = _qkv(prefix_len=5)
    leaves = [t.clone().requires_grad_() for t in (q, kp, vp)]
    o, lse = attention(leaves[0], k[:, :0], v[:, :0], window=1, prefix=(leaves[1], leaves[2]), return_lse=True)
    assert (o == 0).all() and torch.isneginf(lse).all()
    # window=3: some queries see prefix keys, later ones see none
    o, lse = attention(leaves[0], k[:, :0], v[:, :0], window=3, prefix=(leaves[1], leaves[2]), return_lse=True)
    assert torch.isneginf(lse[:, 2:]).all() and torch.isfinite(lse[:, :2]).all()
    grads = torch.autograd.grad(o.sum() + lse[:, :2].sum(), leaves)
    assert all(torch.isfinite(g).all() for g in grads)


NAMES = ("q", "k", "v", "k_prefix", "v_prefix")


def _loss(fn, leaves, window):
    q, k, v, kp, vp = leaves
    o, lse = fn(q, k, v, window=window, prefix=(kp, vp), return_lse=True)
    torch.manual_seed(1)  # fixed cotangents for o and lse
    return (o * torch.randn(o.shape, dtype=o.dtype)).sum() + (lse * torch.randn(lse.shape, dtype=lse.dtype)).sum()


@pytest.mark.parametrize("window", [None, 3])
def test_gradients_match_loop(window):
    q, k, v, (kp, vp) = _qkv(length=7, prefix_len=5)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, kp, vp)]
    grads = torch.autograd.grad(_loss(attention, leaves, window), leaves)
    grads_ref = torch.autograd.grad(_loss(attention_loop, leaves, window), leaves)
    for name, g, g_ref in zip(NAMES, grads, grads_ref):
        assert rel_err(g, g_ref) <= TOL, name


def test_gradcheck():
    torch.manual_seed(0)
    shapes = [(1, 3, 2, 3), (1, 3, 1, 3), (1, 3, 1, 2), (1, 4, 1, 3), (1, 4, 1, 2)]
    leaves = tuple(torch.randn(s, dtype=F64, requires_grad=True) for s in shapes)

    def fn(q, k, v, kp, vp):
        return attention(q, k, v, window=3, prefix=(kp, vp), return_lse=True)

    assert torch.autograd.gradcheck(fn, leaves)


def test_gradcheck_merge():
    torch.manual_seed(0)
    leaves = (torch.randn(1, 2, 2, 3, dtype=F64, requires_grad=True), torch.randn(1, 2, 2, dtype=F64, requires_grad=True),
              torch.randn(1, 2, 2, 3, dtype=F64, requires_grad=True), torch.randn(1, 2, 2, dtype=F64, requires_grad=True))
    assert torch.autograd.gradcheck(merge_attention, leaves)


def test_dtypes_and_dispatch():
    q, k, v, prefix = _qkv(prefix_len=5, dtype=torch.bfloat16)
    o, lse = attention_op(q, k, v, window=8, prefix=prefix, return_lse=True, backend="reference")
    assert o.dtype == torch.bfloat16 and lse.dtype == torch.float32
    o32, lse32 = attention_loop(q.float(), k.float(), v.float(), window=8,
                                prefix=tuple(t.float() for t in prefix), return_lse=True)
    assert rel_err(o, o32) < 1e-2 and rel_err(lse, lse32) < 1e-5
    o_m, lse_m = merge_attention(o, lse, o, lse)
    assert o_m.dtype == torch.bfloat16 and lse_m.dtype == torch.float32


def test_bad_arguments():
    q, k, v, (kp, vp) = _qkv(prefix_len=5)
    with pytest.raises(ValueError, match="multiple"):
        attention(q[:, :, :3], k, v)
    with pytest.raises(ValueError, match="k must be"):
        attention(q, k[:, :4], v[:, :4])
    with pytest.raises(ValueError, match="v must be"):
        attention(q, k, v[:, :, :1])
    with pytest.raises(ValueError, match="prefix values"):
        attention(q, k, v, prefix=(kp, vp[:, :2]))
    with pytest.raises(ValueError, match="window"):
        attention(q, k, v, window=0)
    with pytest.raises(ValueError, match="merge_attention"):
        merge_attention(q, q[..., 0], q[:, :3], q[..., 0])


@pytest.mark.parametrize("window", [None, 1, 4])
def test_attention_step_decodes_like_the_full_call(window):
    from hybridzoo.kernels import attention_step
    from hybridzoo.kernels.reference import attention_loop

    torch.manual_seed(3)
    B, T, Hq, Hk, D = 2, 11, 4, 2, 8
    q = torch.randn(B, T, Hq, D, dtype=torch.float64)
    k, v = torch.randn(B, T, Hk, D, dtype=torch.float64), torch.randn(B, T, Hk, D, dtype=torch.float64)
    ref, _ = attention_loop(q, k, v, window=window)
    cache, outs = None, []
    for t in range(T):
        out, cache = attention_step(q[:, t], k[:, t], v[:, t], cache, window=window)
        outs.append(out)
        if window is not None:
            assert cache[0].shape[1] <= window - 1  # bounded: only what a later query can see
    assert rel_err(torch.stack(outs, 1), ref) <= 1e-10
