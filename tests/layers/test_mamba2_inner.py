"""Mamba-2's training step as one autograd node (:class:`hybridzoo.layers.mamba2_inner.Mamba2Inner`):
taken on the Triton kernels for a whole sequence without a carried state, with the recomputed
body's outputs and gradients (to float32 rounding), and the float64 reference's."""

from __future__ import annotations

import pytest
import torch

from hybridzoo.kernels import fused
from hybridzoo.layers.mamba2 import Mamba2, Mamba2Config
from tests.layers.one_node import check_against_float64, check_against_general_path, check_general_path

D_MODEL = 16


@pytest.fixture(autouse=True)
def fused_norm(monkeypatch):
    """The fused gated norm on CPU tensors (the interpreter), as a GPU takes it."""
    monkeypatch.setattr(fused, "FORCE", True)


def build(dtype=torch.float32, backend="triton", bias=False, **config) -> Mamba2:
    torch.manual_seed(0)
    mixer = Mamba2(D_MODEL, Mamba2Config(d_state=4, head_dim=8, chunk_size=8, bias=bias, **config), backend=backend)
    with torch.no_grad():  # D and the norm's weight away from their constant init, so that their paths show
        mixer.D.uniform_(0.5, 1.5)
        mixer.norm.weight.uniform_(0.5, 1.5)
    return mixer.to(dtype)


@pytest.mark.parametrize("autocast,tol,bias", [(False, 1e-6, True), (True, 1e-2, False)])
def test_one_node_matches_the_recomputed_body(autocast, tol, bias, monkeypatch):
    """fp32 and bf16 autocast: the same kernels on the same inputs; the outputs and final states are
    equal, the gradients equal to float32 rounding (the written-out backward sums some terms in
    another order; x's two gradient paths in float32 before one cast, where the graph casts each);
    under bf16 autocast to bf16 rounding."""
    check_against_general_path(build(bias=bias), torch.randn(2, 13, D_MODEL), autocast, "Mamba2InnerBackward",
                               monkeypatch, grad_tol=tol)


def test_one_node_against_the_float64_reference():
    """The float32 Triton node against the reference backend in float64 (plain norm), gradients
    from the output, the final state and the conv tail included."""
    check_against_float64(build(bias=True), build(torch.float64, backend="reference", bias=True), torch.randn(2, 21, D_MODEL, dtype=torch.float64), "Mamba2InnerBackward")


@pytest.mark.parametrize("case", ["state", "time_step_limit", "reference backend", "no grad", "unfused norm"])
def test_other_calls_take_the_general_path(case, monkeypatch):
    """A carried state (SeCO, decoding), a step-size limit, another backend, no gradient or the
    plain gated norm: no one-node step."""
    limit = (0.0, 0.05) if case == "time_step_limit" else (0.0, float("inf"))
    mixer = build(backend="reference" if case == "reference backend" else "triton", time_step_limit=limit)
    if case == "unfused norm":
        monkeypatch.setattr(fused, "FORCE", False)
    x = torch.randn(1, 9, D_MODEL)
    check_general_path(mixer, x, case, "Mamba2InnerBackward")
