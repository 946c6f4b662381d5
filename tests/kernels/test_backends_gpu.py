"""fla / mamba_ssm adapters against the reference, on a GPU (skipped without CUDA or package)."""

import pytest
import torch

import hybridzoo.kernels as K
from hybridzoo.utils import rel_err

pytestmark = pytest.mark.gpu


def _inputs(kind, B=2, T=1000, H=4, D=64, dtype=torch.bfloat16):
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(B, T, H, D, device="cuda", generator=g).to(dtype) for _ in range(3))
    k = torch.nn.functional.normalize(k.float(), dim=-1).to(dtype)
    shape = (B, T, H, D) if kind == "per_key" else (B, T, H)
    log_a = -torch.rand(*shape, device="cuda", generator=g) * 0.1
    beta = torch.rand(B, T, H, device="cuda", generator=g).to(dtype)
    s0 = torch.randn(B, H, D, D, device="cuda", generator=g) * 0.1
    return q, k, v, log_a, beta, s0


@pytest.mark.parametrize("kind", ["scalar", "per_key"])
def test_fla_chunk_linear_attn_matches_reference(kind):
    pytest.importorskip("fla")
    q, k, v, log_a, _, s0 = _inputs(kind)
    ref, ref_s = K.chunk_linear_attn(q.float(), k.float(), v.float(), log_a, initial_state=s0,
                                     output_final_state=True, backend="reference")
    out, s = K.chunk_linear_attn(q, k, v, log_a, initial_state=s0, output_final_state=True, backend="fla")
    assert rel_err(out, ref) < 1e-2 and rel_err(s, ref_s) < 1e-2


def test_fla_chunk_delta_rule_matches_reference():
    pytest.importorskip("fla")
    q, k, v, log_a, beta, s0 = _inputs("scalar")
    ref, _ = K.chunk_delta_rule(q.float(), k.float(), v.float(), log_a, beta.float(), initial_state=s0,
                                backend="reference")
    out, _ = K.chunk_delta_rule(q, k, v, log_a, beta, initial_state=s0, backend="fla")
    assert rel_err(out, ref) < 1e-2


def test_mamba_ssm_selective_scan_matches_reference():
    pytest.importorskip("mamba_ssm")
    g = torch.Generator(device="cuda").manual_seed(0)
    B, T, Dm, N = 2, 512, 64, 16
    u, delta, z = (torch.randn(B, T, Dm, device="cuda", generator=g) for _ in range(3))
    A = -torch.rand(Dm, N, device="cuda", generator=g) - 0.5
    Bm, Cm = torch.randn(B, T, N, device="cuda", generator=g), torch.randn(B, T, N, device="cuda", generator=g)
    D, bias = torch.randn(Dm, device="cuda", generator=g), torch.randn(Dm, device="cuda", generator=g)
    args = (u, delta, A, Bm, Cm, D, z, bias, True)
    ref, ref_s = K.selective_scan(*args, output_final_state=True, backend="reference")
    out, s = K.selective_scan(*args, output_final_state=True, backend="mamba_ssm")
    assert rel_err(out, ref) < 1e-4 and rel_err(s, ref_s) < 1e-4
