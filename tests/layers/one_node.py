"""Shared by the one-node step tests of Mamba-1 and Mamba-2 (test_mamba1_inner.py,
test_mamba2_inner.py): a mixer's training step with every gradient, and its graph's node names."""

from __future__ import annotations

import torch

from hybridzoo.layers.state import RecurrentState
from hybridzoo.memory import _graph_nodes


def nodes(tensor: torch.Tensor) -> set[str]:
    """The names of the autograd nodes behind ``tensor``."""
    return {type(node).__name__ for node in _graph_nodes([tensor.grad_fn])}


def step(mixer, x: torch.Tensor, state: RecurrentState | None = None, autocast: bool = False):
    """Output, final state, the graph's node names and the gradients of x, every parameter and any
    initial state, for a loss on the output and on both parts of the final state."""
    mixer.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    if state is not None:
        state = RecurrentState(kind=state.kind, recurrent=state.recurrent.detach().clone().requires_grad_(True),
                               conv=state.conv.detach().clone().requires_grad_(True), offset=state.offset)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        y, final = mixer.mix(x, state)
    generator = torch.Generator().manual_seed(1)
    probe = lambda t: torch.randn(t.shape, generator=generator, dtype=torch.float64).to(t.dtype)  # noqa: E731
    loss = ((y * probe(y)).float().sum() + (final.recurrent * probe(final.recurrent)).float().sum()
            + (final.conv * probe(final.conv)).float().sum())
    loss.backward()
    grads = {"x": x.grad}
    grads.update({name: p.grad for name, p in mixer.named_parameters()})
    if state is not None:
        grads.update({"state.recurrent": state.recurrent.grad, "state.conv": state.conv.grad})
    return y.detach(), final, nodes(y), grads


def check_general_path(mixer, x: torch.Tensor, case: str, node: str) -> None:
    """A call that must not take the one-node step (autograd node ``node``): without gradients
    (``case == "no grad"``) no graph at all; with a carried state (``"state"``) or otherwise, a
    graph without ``node`` and a gradient for x and every parameter (and the state)."""
    if case == "no grad":
        with torch.no_grad():
            y, _ = mixer.mix(x, None)
        assert y.grad_fn is None
        return
    state = None
    if case == "state":
        shapes = mixer.expected_state(x.shape[0], x.dtype)
        state = RecurrentState(kind=mixer.kind, recurrent=torch.randn(shapes["recurrent"][0]),
                               conv=torch.randn(shapes["conv"][0]), offset=4)
    _, _, graph, grads = step(mixer, x, state)
    assert node not in graph, graph
    assert all(g is not None for g in grads.values())


def check_against_general_path(mixer, x: torch.Tensor, autocast: bool, node: str, monkeypatch,
                               grad_tol: float = 0.0) -> None:
    """The one-node step (autograd node ``node``) against the recomputed body on the same weights
    and input: outputs and final states equal, gradients of x and every parameter equal
    (``grad_tol`` 0) or within ``grad_tol`` relative error, each in the general path's dtype."""
    from hybridzoo.utils import rel_err

    y, final, graph, fused = step(mixer, x, autocast=autocast)
    assert node in graph and "_RecomputedBackward" not in graph, graph
    monkeypatch.setattr(mixer, "_fused_inner", lambda inputs, params, state: False)
    y_ref, final_ref, graph_ref, general = step(mixer, x, autocast=autocast)
    assert "_RecomputedBackward" in graph_ref and node not in graph_ref, graph_ref
    torch.testing.assert_close(y, y_ref, rtol=0, atol=0)
    torch.testing.assert_close(final.recurrent, final_ref.recurrent, rtol=0, atol=0)
    torch.testing.assert_close(final.conv, final_ref.conv, rtol=0, atol=0)
    assert final.offset == final_ref.offset == x.shape[1]
    assert set(fused) == set(general)
    for name in general:
        assert fused[name] is not None and fused[name].dtype == general[name].dtype, name
        if grad_tol == 0:
            torch.testing.assert_close(fused[name], general[name], rtol=0, atol=0, msg=name)
        else:
            assert rel_err(fused[name].double(), general[name].double()) <= grad_tol, name


def check_against_float64(fast, ref, x: torch.Tensor, node: str) -> None:
    """The float32 one-node step of ``fast`` (autograd node ``node``) against ``ref``, the same
    mixer on the reference backend in float64 given ``fast``'s weights, on ``x`` (float64): the
    output and final state within 1e-5, every gradient within 1e-4 (from the output, the final
    state and the conv tail)."""
    from hybridzoo.utils import rel_err

    y, final, graph, grads = step(fast, x.float())
    assert node in graph, graph
    ref.load_state_dict({k: v.double() for k, v in fast.state_dict().items()})
    y64, final64, graph64, grads64 = step(ref, x)
    assert node not in graph64, graph64
    assert rel_err(y.double(), y64) <= 1e-5
    assert rel_err(final.recurrent.double(), final64.recurrent) <= 1e-5
    for name in grads64:
        assert rel_err(grads[name].double(), grads64[name]) <= 1e-4, name
