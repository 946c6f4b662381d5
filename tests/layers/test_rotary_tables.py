"""Rotary's cos / sin tables: shared by q, k and every layer of a step, and never a table made
under inference mode in a graph that trains."""

from __future__ import annotations

import torch

from hybridzoo.layers.rotary import Rotary, rotate_half


def _formula(x: torch.Tensor, offset: int, rotary_dim: int, base: float) -> torch.Tensor:
    """The rotate-half rotation in float64, written out here (not the module's code)."""
    T = x.shape[1]
    inv = base ** -(torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    ang = torch.arange(offset, offset + T, dtype=torch.float64)[:, None] * inv[None, :]
    cos, sin = torch.cat((ang, ang), -1).cos()[None, :, None], torch.cat((ang, ang), -1).sin()[None, :, None]
    rot = x[..., :rotary_dim].double()
    return torch.cat((rot * cos + rotate_half(rot) * sin, x[..., rotary_dim:].double()), -1)


def test_layers_of_one_shape_share_one_table_and_rotate_as_the_formula():
    a, b = Rotary(16, 8, base=500.0), Rotary(16, 8, base=500.0)
    q, k = torch.randn(2, 7, 3, 16), torch.randn(2, 7, 1, 16)
    assert a._tables(5, 7, q, False)[0] is b._tables(5, 7, k, False)[0]  # computed once
    assert a._tables(5, 7, q, False)[0] is not a._tables(6, 7, q, False)[0]  # other positions
    assert Rotary(16, 8, base=10.0)._tables(5, 7, q, False)[0] is not a._tables(5, 7, q, False)[0]
    for rot, x in ((a, q), (b, k), (Rotary(16, 8, base=10.0), q)):
        torch.testing.assert_close(rot(x, offset=5).double(), _formula(x, 5, 8, rot.base), atol=1e-5, rtol=1e-5)


def test_long_sequences_tables_are_not_kept(monkeypatch):
    import hybridzoo.layers.rotary as module

    monkeypatch.setattr(module, "_TABLE_MAX", 8 * 6)
    rot, x = Rotary(8), torch.randn(1, 7, 1, 8)
    assert rot._tables(0, 6, x, False)[0] is rot._tables(0, 6, x, False)[0]
    assert rot._tables(0, 7, x, False)[0] is not rot._tables(0, 7, x, False)[0]


def test_a_table_made_under_inference_mode_is_not_used_for_training():
    rot = Rotary(8)
    x = torch.randn(1, 4, 2, 8)
    with torch.inference_mode():
        rot(x, offset=3)
    leaf = x.clone().requires_grad_()
    rot(leaf, offset=3).square().sum().backward()  # an inference tensor saved for backward raises
    assert leaf.grad is not None and torch.isfinite(leaf.grad).all()
