"""Replaced or hooked submodules are honoured: a mixer whose fast path uses its submodules' weights
directly (recomputed Mamba bodies, fused MLP) calls them as modules instead when one is replaced
(an adapter such as peft's LoRA) or hooked. Checked in float64 against the same mixer with the
adapter's update merged into the weight (the fast path), outputs and every gradient."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from hybridzoo.layers.mamba1 import Mamba1, Mamba1Config
from hybridzoo.layers.mamba2 import Mamba2, Mamba2Config
from hybridzoo.layers.mlp import SwiGLU


class LowRank(nn.Module):
    """``base(x) + x A B`` (a LoRA-style adapter around a Linear; A, B trainable)."""

    def __init__(self, base: nn.Linear, rank: int = 2):
        super().__init__()
        self.base = base
        self.A = nn.Parameter(torch.randn(base.in_features, rank, dtype=base.weight.dtype) * 0.3)
        self.B = nn.Parameter(torch.randn(rank, base.out_features, dtype=base.weight.dtype) * 0.3)

    def forward(self, x):
        return self.base(x) + x @ self.A @ self.B

    def merged(self) -> nn.Linear:
        linear = copy.deepcopy(self.base)
        with torch.no_grad():
            linear.weight += (self.A @ self.B).T
        return linear


CASES = {
    "mamba1.x_proj": (lambda: Mamba1(16, Mamba1Config(d_state=4)), "x_proj"),
    "mamba2.out_proj": (lambda: Mamba2(16, Mamba2Config(d_state=8, head_dim=8, chunk_size=8)), "out_proj"),
    "swiglu.down_proj": (lambda: SwiGLU(16, 24), "down_proj"),
    "swiglu.gate_proj": (lambda: SwiGLU(16, 24), "gate_proj"),
}


def _run(module, x):
    out = module(x)
    y = out[0] if isinstance(out, tuple) else out
    (y * torch.linspace(-1, 1, y.numel(), dtype=y.dtype).view_as(y)).sum().backward()
    return y.detach(), x.grad.clone()


@pytest.mark.parametrize("case", list(CASES))
def test_an_adapter_on_a_submodule_is_applied(case):
    build, name = CASES[case]
    torch.manual_seed(0)
    mixer = build().double()
    adapted = copy.deepcopy(mixer)
    setattr(adapted, name, LowRank(getattr(mixer, name)))
    merged = copy.deepcopy(mixer)
    setattr(merged, name, getattr(adapted, name).merged())
    x = torch.randn(2, 11, 16, dtype=torch.float64)
    y_a, dx_a = _run(adapted, x.clone().requires_grad_())
    y_m, dx_m = _run(merged, x.clone().requires_grad_())
    y_plain, _ = _run(mixer, x.clone().requires_grad_())
    assert (y_a - y_plain).abs().max() > 1e-6  # the adapter changes the output ...
    torch.testing.assert_close(y_a, y_m, rtol=1e-10, atol=1e-10)  # ... exactly as merged weights do
    torch.testing.assert_close(dx_a, dx_m, rtol=1e-10, atol=1e-10)
    low_rank = getattr(adapted, name)
    assert low_rank.A.grad is not None and low_rank.A.grad.abs().max() > 0
    for (pname, p), q in zip(adapted.named_parameters(), merged.parameters()):
        if p.shape == q.shape and not pname.startswith(name):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-10, msg=pname)


@pytest.mark.parametrize("case", ["mamba1.x_proj", "mamba2.out_proj", "swiglu.down_proj"])
def test_a_forward_hook_on_a_submodule_fires(case):
    build, name = CASES[case]
    mixer = build().double()
    seen = []
    getattr(mixer, name).register_forward_hook(lambda module, args, out: seen.append(out.shape))
    _run(mixer, torch.randn(1, 5, 16, dtype=torch.float64, requires_grad=True))
    assert seen, f"the forward hook on {name} did not fire"
