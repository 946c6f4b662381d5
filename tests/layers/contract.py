"""Checks every mixer must pass (the state contract of DESIGN.md), shared by the mixer tests.

Each check builds nothing itself: the caller passes a float64 mixer and an input.
"""

from __future__ import annotations

import pytest
import torch

from hybridzoo.layers import Mixer, MixerState, StateError
from hybridzoo.utils import rel_err

TOL = 1e-10


def random_pieces(T: int, generator: torch.Generator) -> list[int]:
    """Random piece lengths summing to T, including some 1-token pieces."""
    sizes, left = [], T
    while left:
        n = int(torch.randint(1, max(2, T // 2), (1,), generator=generator))
        n = min(n, left)
        sizes.append(n)
        left -= n
    return sizes


def run_pieces(mixer: Mixer, x: torch.Tensor, sizes: list[int]):
    state, outs = None, []
    for piece in x.split(sizes, dim=1):
        y, state = mixer(piece, state)
        outs.append(y)
    return torch.cat(outs, dim=1), state


def check_pieces_and_decoding(mixer: Mixer, x: torch.Tensor, seed: int = 0) -> None:
    """One call == random pieces with carried state == token-by-token decoding (float64).

    Also: the final states agree, and gradients of the pieces version (w.r.t. x and every
    parameter, flowing through the carried states) equal those of the one-shot version.
    """
    assert x.dtype == torch.float64
    generator = torch.Generator().manual_seed(seed)
    sizes = random_pieces(x.shape[1], generator)
    x = x.detach().requires_grad_(True)
    y_full, state_full = mixer(x)
    y_pieces, state_pieces = run_pieces(mixer, x, sizes)
    y_tokens, _ = run_pieces(mixer, x, [1] * x.shape[1])
    assert rel_err(y_pieces, y_full) <= TOL, f"pieces {sizes}: {rel_err(y_pieces, y_full)}"
    assert rel_err(y_tokens, y_full) <= TOL, f"token by token: {rel_err(y_tokens, y_full)}"
    assert isinstance(state_full, MixerState) and state_full.kind == mixer.kind
    for name, tensor in state_full.tensors().items():
        other = state_pieces.tensors()[name]
        if tensor.shape == other.shape:
            assert rel_err(other, tensor) <= TOL, f"final state field {name}"

    # gradients through the carried state: a loss on every output and on the final state
    weight = torch.randn(y_full.shape, generator=generator, dtype=torch.float64)
    params = [p for p in mixer.parameters() if p.requires_grad]

    def grads(y):
        return torch.autograd.grad((y * weight).sum(), [x, *params], allow_unused=True)

    g_full, g_pieces = grads(y_full), grads(y_pieces)
    for i, (a, b) in enumerate(zip(g_full, g_pieces)):
        if a is None and b is None:
            continue
        assert a is not None and b is not None, f"gradient {i} missing in one version"
        assert rel_err(b, a) <= TOL, f"gradient {i}: {rel_err(b, a)}"
    assert g_full[0].abs().sum() > 0, "no gradient reached the input"


def check_bad_inputs(mixer: Mixer, x: torch.Tensor, foreign_state: MixerState) -> None:
    """Wrong d_model, a foreign state, a wrong batch size, dtype or device: clear errors."""
    with pytest.raises(ValueError, match="d_model"):
        mixer(torch.zeros(x.shape[0], x.shape[1], mixer.d_model + 1, dtype=x.dtype))
    with pytest.raises(ValueError, match=r"\[B, T, d_model"):
        mixer(x[0])
    with pytest.raises(StateError, match="mixer"):
        mixer(x, foreign_state)
    _, state = mixer(x)
    with pytest.raises(StateError, match="batch size"):
        mixer(torch.cat([x, x]), state)
    wrong_dtype = state.map(lambda t: t.to(torch.float16) if t.is_floating_point() else t)
    with pytest.raises(StateError, match="dtype"):
        mixer(x, wrong_dtype)
    meta_state = state.map(lambda t: t.to("meta"))
    with pytest.raises(StateError, match="on meta"):
        mixer(x, meta_state)
