"""What the chunked mixers hand their kernels under bf16 autocast.

q, k and v must reach ``chunk_linear_attn`` / ``chunk_delta_rule`` in the activation dtype
(bf16 here), so the Triton kernels take the tensor-core path; decays and write strengths stay
float32. (float32 q/k next to bf16 v once sent Gated DeltaNet and Mamba-2 down exact fp32 dots,
~30x slower on an H200.) Without autocast nothing changes: float32 in, float32 to the kernel.
"""

from __future__ import annotations

import pytest
import torch

import hybridzoo.layers.gated_deltanet as gdn_module
import hybridzoo.layers.gated_linear as gated_linear_module
import hybridzoo.layers.mamba2 as mamba2_module
from hybridzoo.layers.gated_deltanet import GatedDeltaNet, GatedDeltaNetConfig
from hybridzoo.layers.gla import GLA, GLAConfig
from hybridzoo.layers.mamba2 import Mamba2, Mamba2Config
from hybridzoo.layers.retnet import RetNet, RetNetConfig

D_MODEL = 16
BF16, F32 = torch.bfloat16, torch.float32

MIXERS = {
    "gdn": (lambda: GatedDeltaNet(D_MODEL, GatedDeltaNetConfig(num_k_heads=2, num_v_heads=2, head_k_dim=8,
                                                                head_v_dim=8, chunk_size=4)),
            gdn_module, "chunk_delta_rule"),
    "mamba2": (lambda: Mamba2(D_MODEL, Mamba2Config(d_state=8, head_dim=8, chunk_size=4)),
               mamba2_module, "chunk_linear_attn"),
    "gla": (lambda: GLA(D_MODEL, GLAConfig(num_heads=2, chunk_size=4)), gated_linear_module, "chunk_linear_attn"),
    "retnet": (lambda: RetNet(D_MODEL, RetNetConfig(num_heads=2, chunk_size=4)), gated_linear_module,
               "chunk_linear_attn"),
}


def kernel_dtypes(kind: str, monkeypatch, autocast: bool) -> dict[str, torch.dtype]:
    build, module, op_name = MIXERS[kind]
    seen = {}
    op = getattr(module, op_name)

    def spy(q, k, v, log_a=None, *args, **kwargs):
        seen.update(q=q.dtype, k=k.dtype, v=v.dtype, log_a=None if log_a is None else log_a.dtype)
        return op(q, k, v, log_a, *args, **kwargs)

    monkeypatch.setattr(module, op_name, spy)
    torch.manual_seed(0)
    mixer = build()
    x = torch.randn(2, 10, D_MODEL)
    with torch.autocast("cpu", dtype=BF16, enabled=autocast):
        y, _ = mixer(x)
    assert seen, f"{kind}: {op_name} was not called"
    assert torch.isfinite(y).all()
    return seen


@pytest.mark.parametrize("kind", sorted(MIXERS))
def test_bf16_autocast_hands_16bit_qkv_to_the_kernel(kind, monkeypatch):
    seen = kernel_dtypes(kind, monkeypatch, autocast=True)
    assert (seen["q"], seen["k"], seen["v"]) == (BF16, BF16, BF16), seen
    assert seen["log_a"] in (None, F32), seen


@pytest.mark.parametrize("kind", sorted(MIXERS))
def test_no_autocast_keeps_float32(kind, monkeypatch):
    seen = kernel_dtypes(kind, monkeypatch, autocast=False)
    assert {seen["q"], seen["k"], seen["v"]} == {F32}, seen
