"""Helpers shared by the Mamba-1 and Mamba-2 parity tests against transformers' pure-PyTorch mixers."""

from __future__ import annotations

import torch

from hybridzoo.utils import rel_err


def copy_from_hf(ours, hf):
    """Copy every HF parameter into ours, same name (HF conv1d.weight [C, 1, W] -> ours [C, W])."""
    mine = dict(ours.named_parameters())
    assert set(mine) == {n for n, _ in hf.named_parameters()}
    with torch.no_grad():
        for name, p in hf.named_parameters():
            mine[name].copy_(p.reshape(mine[name].shape))


def output_and_grads(module, x: torch.Tensor, weight: torch.Tensor):
    """``(y, dx, {parameter name: grad})`` of ``(y * weight).sum()`` (HF mixers return tuples)."""
    xi = x.clone().requires_grad_(True)
    y = module(xi)
    y = y[0] if isinstance(y, tuple) else y
    grads = torch.autograd.grad((y * weight).sum(), [xi, *module.parameters()])
    return y, grads[0], dict(zip([n for n, _ in module.named_parameters()], grads[1:]))


def assert_same_output_and_grads(ours, hf, tol: float = 1e-5) -> None:
    """Compare two :func:`output_and_grads` results (HF parameter grads reshaped to ours)."""
    (y, dx, dp), (y_hf, dx_hf, dp_hf) = ours, hf
    assert rel_err(y, y_hf) <= tol, rel_err(y, y_hf)
    assert rel_err(dx, dx_hf) <= tol, rel_err(dx, dx_hf)
    for name, g in dp_hf.items():
        assert rel_err(dp[name], g.reshape(dp[name].shape)) <= tol, name
