"""Mamba-1's training step as one autograd node (:class:`hybridzoo.layers.mamba1_inner.Mamba1Inner`):
taken on the Triton kernels for a whole sequence without a carried state, with the recomputed
body's outputs and gradients, and the float64 reference's within float32 rounding."""

from __future__ import annotations

import pytest
import torch

from hybridzoo.layers.mamba1 import Mamba1, Mamba1Config
from tests.layers.one_node import check_against_float64, check_against_general_path, check_general_path, nodes

D_MODEL = 16


def build(dtype=torch.float32, backend="triton", **config) -> Mamba1:
    torch.manual_seed(0)
    return Mamba1(D_MODEL, Mamba1Config(d_state=4, **config), backend=backend).to(dtype)


@pytest.mark.parametrize("autocast", [False, True])
def test_one_node_equals_the_recomputed_body(autocast, monkeypatch):
    """fp32 and bf16 autocast: the same kernels and products in the same order, so the outputs,
    the final state and every gradient equal the recomputed body's exactly."""
    check_against_general_path(build(), torch.randn(1, 11, D_MODEL), autocast, "Mamba1InnerBackward", monkeypatch)


def test_one_node_against_the_float64_reference():
    """The float32 Triton node against the reference backend in float64, gradients from the
    output, the final state and the conv tail included."""
    check_against_float64(build(), build(torch.float64, backend="reference"), torch.randn(1, 13, D_MODEL, dtype=torch.float64), "Mamba1InnerBackward")


@pytest.mark.parametrize("case", ["state", "keep_scan_states=False", "reference backend", "no grad"])
def test_other_calls_take_the_general_path(case):
    """A carried state (SeCO, decoding), recomputed scan states, another backend or no gradient:
    no one-node step."""
    mixer = build(keep_scan_states=case != "keep_scan_states=False",
                  backend="reference" if case == "reference backend" else "triton")
    x = torch.randn(1, 5, D_MODEL)
    check_general_path(mixer, x, case, "Mamba1InnerBackward")


def test_no_copy_of_the_gate_or_b_c_and_xz_gradient_in_one_buffer(monkeypatch):
    """The scan reads z (the gate half of ``in_proj``'s output) and B, C (columns of ``x_proj``'s)
    in place, and the backward writes the scan's dz and the conv's dx into the halves of one
    ``[B, T, 2·d_inner]`` buffer: no aten op copies a per-token tensor (only the conv tail
    ``[B, W-1, d_inner]`` is cloned) and none concatenates xz's gradient (the one concatenation
    is the small ``[dt, B, C]`` gradient of ``x_proj``'s output). Kernel launches are
    skipped (their values do not matter here), every aten op recorded with its output's shape."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from triton.runtime import interpreter

    monkeypatch.setattr(interpreter.GridExecutor, "__call__", lambda self, *a, **k: None)
    mixer = build()
    batch, length = 2, 11
    seen: list[tuple[str, tuple]] = []

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            seen.append((str(func.overloadpacket), tuple(out.shape) if isinstance(out, torch.Tensor) else ()))
            return out

    x = torch.randn(batch, length, D_MODEL, requires_grad=True)
    with Ops():
        y, final = mixer.mix(x, None)
        (y.sum() + final.recurrent.sum() + final.conv.sum()).backward()
    assert "Mamba1InnerBackward" in nodes(y)
    copies = [(op, shape) for op, shape in seen if op in ("aten.clone", "aten.copy_") and shape[:2] == (batch, length)]
    assert copies == [], copies
    joined = [shape for op, shape in seen if op == "aten.cat" and shape == (batch, length, 2 * mixer.d_inner)]
    assert joined == [], joined
    assert ("aten.clone", (batch, mixer.config.d_conv - 1, mixer.d_inner)) in seen  # the tail: the test sees clones
