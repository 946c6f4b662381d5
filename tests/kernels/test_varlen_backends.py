"""Packed documents (cu_seqlens) in the torch and fla backends, against the reference.

CPU: the torch backend's SDPA-with-document-mask path in float64 against the step loop per
document. GPU (``@pytest.mark.gpu``): flex_attention's document block mask and fla's varlen chunk
ops against the reference's packed form (itself tested against the loops in
test_varlen_reference.py), outputs, final states and gradients.
"""

from __future__ import annotations

import pytest
import torch

import hybridzoo.kernels as K
from hybridzoo.kernels.reference import attention_loop
from hybridzoo.utils import rel_err
from tests.kernels.test_varlen_reference import LENGTHS, check_packed_equals_separate, cu_of

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

F64 = torch.float64


@pytest.mark.parametrize("window,Hq,Hk", [(None, 2, 2), (3, 4, 2), (5, 2, 1)])
def test_torch_backend_packed_attention_on_cpu_equals_loop_per_document(window, Hq, Hk):
    g = torch.Generator().manual_seed(11)
    T = sum(LENGTHS)
    inputs = {"q": torch.randn(1, T, Hq, 4, generator=g, dtype=F64),
              "k": torch.randn(1, T, Hk, 4, generator=g, dtype=F64),
              "v": torch.randn(1, T, Hk, 3, generator=g, dtype=F64)}

    def packed(q, k, v, cu_seqlens):
        o, _ = K.attention(q, k, v, window=window, cu_seqlens=cu_seqlens, backend="torch")
        return o, o.new_zeros(1, T, Hq)  # SDPA gives no lse: compare the output alone

    def separate(q, k, v):
        o, _ = attention_loop(q, k, v, window=window)
        return o, o.new_zeros(1, o.shape[1], Hq)

    check_packed_equals_separate(packed, separate, inputs, {"q", "k", "v"}, cu_of(LENGTHS), second_per_token=True)


def test_torch_backend_packed_attention_lse_on_cpu():
    g = torch.Generator().manual_seed(12)
    T = sum(LENGTHS)
    q, k, v = (torch.randn(1, T, 2, 4, generator=g, dtype=F64) for _ in range(3))
    cu = cu_of(LENGTHS)
    o, lse = K.attention(q, k, v, window=3, return_lse=True, cu_seqlens=cu, backend="torch")
    o_ref, lse_ref = K.attention(q, k, v, window=3, return_lse=True, cu_seqlens=cu, backend="reference")
    assert (o - o_ref).abs().max() < 1e-12 and (lse - lse_ref).abs().max() < 1e-12


# documents of realistic variety for the GPU: 1 token, a chunk, a chunk + 1, long, short
GPU_LENGTHS = (1, 64, 65, 300, 7, 563)


def _grads(fn, inputs):
    leaves = [None if t is None else t.detach().clone().requires_grad_(True) for t in inputs]
    out, second = fn(*leaves)
    g = torch.Generator(device=out.device).manual_seed(0)
    d_out = torch.randn(out.shape, device=out.device, generator=g, dtype=torch.float32)
    d_second = torch.randn(second.shape, device=out.device, generator=g, dtype=torch.float32)
    grads = torch.autograd.grad((out.float() * d_out).sum() + (second.float() * d_second).sum(),
                                [t for t in leaves if t is not None])
    return out, second, grads


def _gpu_inputs(kind, Hk=2, H=4, D=64, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    T, N = sum(GPU_LENGTHS), len(GPU_LENGTHS)
    q = torch.randn(1, T, Hk, D, device="cuda", generator=g)
    k = torch.nn.functional.normalize(torch.randn(1, T, Hk, D, device="cuda", generator=g), dim=-1)
    v = torch.randn(1, T, H, D, device="cuda", generator=g)
    shape = {"none": None, "scalar": (1, T, H), "per_key": (1, T, H, D)}[kind]
    log_a = None if shape is None else -torch.rand(*shape, device="cuda", generator=g) * 0.1
    beta = torch.rand(1, T, H, device="cuda", generator=g)
    s0 = torch.randn(N, H, D, D, device="cuda", generator=g) * 0.1
    return q, k, v, log_a, beta, s0


def _close(ours, ref, tol):
    out, second, grads = ours
    out_r, second_r, grads_r = ref
    assert rel_err(out.float(), out_r.float()) < tol
    assert rel_err(second.float(), second_r.float()) < tol
    for a, b in zip(grads, grads_r, strict=True):
        assert rel_err(a.float(), b.float()) < tol


def _close_fla(run, inputs, tol):
    """fla against the reference; fla refuses the backward of its gated ops on Hopper with Triton
    < 3.7.1 (its issue #640): there the forward (outputs and final states) is compared alone."""
    ref = _grads(run("reference"), inputs)
    try:
        ours = _grads(run("fla"), inputs)
    except RuntimeError as error:
        if "#640" not in str(error):
            raise
        with torch.no_grad():
            out, final = run("fla")(*inputs)
        assert rel_err(out.float(), ref[0].float()) < tol and rel_err(final.float(), ref[1].float()) < tol
        return
    _close(ours, ref, tol)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["none", "scalar", "per_key"])
def test_fla_packed_chunk_linear_attn_matches_reference(kind):
    pytest.importorskip("fla")
    q, k, v, log_a, _, s0 = _gpu_inputs(kind)
    cu = cu_of(GPU_LENGTHS).cuda()

    def run(backend):
        return lambda q, k, v, log_a, s0: K.chunk_linear_attn(q, k, v, log_a, initial_state=s0, output_final_state=True,
                                                               cu_seqlens=cu, backend=backend)

    _close_fla(run, (q, k, v, log_a, s0), 5e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("gated", [True, False])
def test_fla_packed_chunk_delta_rule_matches_reference(gated):
    pytest.importorskip("fla")
    q, k, v, log_a, beta, s0 = _gpu_inputs("scalar")
    log_a = log_a if gated else None
    cu = cu_of(GPU_LENGTHS).cuda()

    def run(backend):
        return lambda q, k, v, log_a, beta, s0: K.chunk_delta_rule(
            q, k, v, log_a, beta, initial_state=s0, output_final_state=True, cu_seqlens=cu, backend=backend)

    _close_fla(run, (q, k, v, log_a, beta, s0), 5e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("window,dtype", [(None, torch.bfloat16), (128, torch.bfloat16), (None, torch.float32)])
def test_torch_backend_packed_attention_flex_matches_reference(window, dtype):
    g = torch.Generator(device="cuda").manual_seed(3)
    T = sum(GPU_LENGTHS)
    q = torch.randn(1, T, 4, 64, device="cuda", generator=g).to(dtype)
    k, v = (torch.randn(1, T, 2, 64, device="cuda", generator=g).to(dtype) for _ in range(2))
    cu = cu_of(GPU_LENGTHS).cuda()

    def run(backend, cast):
        return lambda q, k, v: K.attention(cast(q), cast(k), cast(v), window=window, return_lse=True,
                                           cu_seqlens=cu, backend=backend)

    tol = 2e-2 if dtype == torch.bfloat16 else 2e-3
    _close(_grads(run("torch", lambda t: t), (q, k, v)), _grads(run("reference", lambda t: t.float()), (q, k, v)), tol)
