"""Every Triton kernel stays inside its tensors (interpreter + :mod:`.bounds` address checks).

On a GPU an out-of-bounds access is an "illegal memory access" that kills the process's CUDA
context; under the interpreter it silently reads neighbouring bytes. These tests run each op,
forward and backward, on awkward shapes (ragged T, K != V, grouped heads, head sizes below and
above the 16/64 tiles, initial and final states) and fail on any unmasked address outside the
launch's tensor arguments.
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

import hybridzoo.kernels as K
from tests.kernels.triton.bounds import bounds_checked

pytestmark = pytest.mark.usefixtures("interpreter")


@pytest.fixture
def interpreter():
    import os

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("address checks need TRITON_INTERPRET=1 (set by the test suite's conftest)")


@triton.jit
def _shift_kernel(x, y, n, MASKED: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    src = tl.load(x + i + 1, mask=(i + 1 < n) if MASKED else i < n, other=0.0)
    tl.store(y + i, src, mask=i < n)


@pytest.mark.parametrize("masked", [False, True])
def test_checker_sees_an_out_of_bounds_load(masked):
    x, y = torch.randn(10), torch.empty(10)
    with bounds_checked() as report:
        _shift_kernel[(1,)](x, y, 10, MASKED=masked, BLOCK=16)
    assert report.launches == 1 and report.accesses > 0
    assert (report.violations == []) == masked, report.violations


def _backward(outputs, inputs):
    loss = sum((o.float() * torch.randn(o.shape, generator=torch.Generator().manual_seed(i))).sum()
               for i, o in enumerate(outputs) if o is not None)
    loss.backward()
    return [x.grad for x in inputs]


def _leaf(*shape, dtype=torch.float32, scale=1.0, negative=False):
    x = torch.randn(*shape) * scale
    x = -x.abs() if negative else x
    return x.to(dtype).requires_grad_(True)


LINEAR = [  # (B, T, Hk, H, K, V, decay)
    (2, 77, 1, 4, 8, 32, "scalar"),
    (1, 70, 2, 4, 64, 32, "scalar"),
    (1, 40, 1, 2, 80, 16, "per_key"),
    (1, 33, 2, 2, 16, 72, "none"),
]


@pytest.mark.parametrize("B,T,Hk,H,Kd,V,decay", LINEAR)
def test_chunk_linear_attn_in_bounds(B, T, Hk, H, Kd, V, decay):
    torch.manual_seed(0)
    q, k, v = _leaf(B, T, Hk, Kd, dtype=torch.float16), _leaf(B, T, Hk, Kd, dtype=torch.float16), \
        _leaf(B, T, H, V, dtype=torch.float16)
    log_a = None if decay == "none" else _leaf(B, T, H, *(() if decay == "scalar" else (Kd,)), negative=True)
    h0 = _leaf(B, H, Kd, V)
    inputs = [x for x in (q, k, v, log_a, h0) if x is not None]
    with bounds_checked() as report:
        o, hT = K.chunk_linear_attn(q, k, v, log_a, initial_state=h0, output_final_state=True,
                                    chunk_size=32, backend="triton")
        grads = _backward([o, hT], inputs)
    assert all(g is not None for g in grads)
    assert report.launches > 0 and report.violations == [], report.violations


@pytest.mark.parametrize("decay", ["scalar", "per_key"])
def test_packed_chunk_linear_attn_in_bounds(decay):
    """Packed documents (cu_seqlens) of 1, 32 (a chunk) and 33 tokens at chunk 32 (two sub-chunks
    of 16 for the per-key kernels): every access stays inside the packed tensors, the score
    buffers and the state slots (a document's chunk reading past its end would read the next
    document's rows, which the reference comparisons of test_linear_attn_varlen.py catch)."""
    torch.manual_seed(0)
    cu = torch.tensor([0, 1, 33, 66], dtype=torch.int32)
    H = 2 if decay == "scalar" else 1  # (one head: the per-key kernels are slow under the checker)
    q, k, v = (_leaf(1, 66, 1, 16, dtype=torch.float16), _leaf(1, 66, 1, 16, dtype=torch.float16),
               _leaf(1, 66, H, 24, dtype=torch.float16))
    log_a = _leaf(1, 66, H, *(() if decay == "scalar" else (16,)), negative=True)
    h0 = _leaf(3, H, 16, 24)
    with bounds_checked() as report:
        o, hT = K.chunk_linear_attn(q, k, v, log_a, initial_state=h0, output_final_state=True,
                                    chunk_size=32, cu_seqlens=cu, backend="triton")
        grads = _backward([o, hT], [q, k, v, log_a, h0])
    assert all(g is not None for g in grads)
    assert report.launches > 0 and report.violations == [], report.violations


@pytest.mark.parametrize("B,T,Hk,H,Kd,V,split", [(1, 45, 1, 2, 32, 16, False), (2, 20, 2, 2, 16, 40, False),
                                                 (1, 21, 1, 2, 150, 40, True)],
                         ids=["K32", "K16", "K150-split-state"])
def test_chunk_delta_rule_in_bounds(B, T, Hk, H, Kd, V, split, monkeypatch):
    """The last case runs the state kernels in 64-row pieces (delta_rule_split): K 150 has a
    piece masked past K and one wholly past it."""
    import importlib

    monkeypatch.setattr(importlib.import_module("hybridzoo.kernels.triton.delta_rule_common"), "SPLIT_STATE", split)
    torch.manual_seed(1)
    q = _leaf(B, T, Hk, Kd, dtype=torch.float16)
    k = torch.nn.functional.normalize(torch.randn(B, T, Hk, Kd), dim=-1).half().requires_grad_(True)
    v = _leaf(B, T, H, V, dtype=torch.float16)
    log_a, beta, h0 = _leaf(B, T, H, negative=True, scale=0.1), torch.rand(B, T, H).requires_grad_(True), \
        _leaf(B, H, Kd, V)
    with bounds_checked() as report:
        o, hT = K.chunk_delta_rule(q, k, v, log_a, beta, initial_state=h0, output_final_state=True,
                                   chunk_size=16, backend="triton")
        grads = _backward([o, hT], [q, k, v, log_a, beta, h0])
    assert all(g is not None for g in grads)
    assert report.launches > 0 and report.violations == [], report.violations


@pytest.mark.parametrize("segments", [1, 3], ids=["whole", "3-segments"])
def test_selective_scan_in_bounds(monkeypatch, segments):
    import importlib

    monkeypatch.setattr(importlib.import_module("hybridzoo.kernels.triton.selective_scan"), "SEGMENTS", segments)
    torch.manual_seed(2)
    Bt, T, Dm, N, G = 2, 37, 24, 6, 2
    u, delta, z = _leaf(Bt, T, Dm), _leaf(Bt, T, Dm, scale=0.5), _leaf(Bt, T, Dm)
    A = _leaf(Dm, N, negative=True)
    Bm, Cm = _leaf(Bt, T, G, N), _leaf(Bt, T, G, N)
    D, bias, h0 = _leaf(Dm), _leaf(Dm), _leaf(Bt, Dm, N)
    inputs = [u, delta, A, Bm, Cm, D, z, bias, h0]
    with bounds_checked() as report:
        y, hT = K.selective_scan(u, delta, A, Bm, Cm, D, z, bias, True, initial_state=h0,
                                 output_final_state=True, backend="triton")
        grads = _backward([y, hT], inputs)
    assert all(g is not None for g in grads)
    assert report.launches > 0 and report.violations == [], report.violations


@pytest.mark.parametrize("T,W", [(19, 4), (3, 4)])
def test_causal_conv1d_in_bounds(T, W):
    torch.manual_seed(3)
    x, weight, bias, tail = _leaf(2, T, 40), _leaf(40, W), _leaf(40), _leaf(2, W - 1, 40)
    with bounds_checked() as report:
        y, new_tail = K.causal_conv1d(x, weight, bias, initial_state=tail, output_final_state=True,
                                      activation="silu", backend="triton")
        grads = _backward([y, new_tail], [x, weight, bias, tail])
    assert all(g is not None for g in grads)
    assert report.launches > 0 and report.violations == [], report.violations


def test_prefix_block_backward_in_bounds():
    from hybridzoo.kernels.triton.prefix_attention_bwd import prefix_block_backward, prepare_prefix_backward

    torch.manual_seed(4)
    B, T, S, H, HK, D = 1, 21, 37, 4, 2, 24
    q, o = torch.randn(B, T, H, D).half(), torch.randn(B, T, H, D).half()
    lse, d_o, d_lse = torch.randn(B, T, H) + 3, torch.randn(B, T, H, D), torch.randn(B, T, H)
    k_block, v_block = torch.randn(B, S, HK, D).half(), torch.randn(B, S, HK, D).half()
    with bounds_checked() as report:
        grad = prepare_prefix_backward(q, o, lse, d_o, d_lse)
        dq, dk, dv = prefix_block_backward(grad, k_block, v_block, D ** -0.5)
    assert dq.shape == q.shape and dk.shape == k_block.shape and dv.shape == v_block.shape
    assert report.launches > 0 and report.violations == [], report.violations


def test_fused_layer_passes_in_bounds(monkeypatch):
    """The layers' fused passes (norms, l2 norm, SwiGLU, cross-entropy, rotary) through their modules,
    forward and backward, on ragged shapes (rows, vocabularies, head sizes off the tiles)."""
    from hybridzoo.kernels import fused
    from hybridzoo.layers import GatedRMSNorm, RMSNorm, SwiGLU
    from hybridzoo.layers.norms import l2_normalize
    from hybridzoo.layers.rotary import Rotary
    from hybridzoo.zoo.model import lm_loss

    monkeypatch.setattr(fused, "FORCE", True)
    torch.manual_seed(5)
    x, z = _leaf(2, 7, 20), _leaf(2, 7, 20)
    heads = _leaf(2, 7, 3, 12)
    logits, targets = _leaf(2, 7, 45), torch.randint(0, 45, (2, 7))
    targets[0, 2] = -100
    modules = [RMSNorm(20), GatedRMSNorm(20, group_size=10), SwiGLU(20, 36), Rotary(12, 8)]
    with bounds_checked() as report:
        outs = [modules[0](x), modules[1](x, z), modules[2](x), modules[3](heads, offset=5),
                lm_loss(logits, targets), l2_normalize(z[..., 5:], 5, 1e-6)]
        grads = _backward(outs, [x, z, heads, logits])
    assert all(g is not None for g in grads)
    assert report.launches >= 12 and report.violations == [], report.violations
