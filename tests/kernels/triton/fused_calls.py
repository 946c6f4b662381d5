"""Tests' helper: take the layers' fused path on CPU tensors (``hybridzoo.kernels.fused.FORCE``,
under the Triton interpreter) and count the calls of a Triton module's launchers."""

from __future__ import annotations

from hybridzoo.kernels import fused


def force_and_count(monkeypatch, module) -> dict[str, int]:
    """Set ``fused.FORCE`` and wrap every ``*_fwd`` / ``*_bwd`` of ``module.__all__``; returns
    the dict ``{launcher name: calls}`` that the wrappers fill."""
    monkeypatch.setattr(fused, "FORCE", True)
    counts: dict[str, int] = {}
    for name in module.__all__:
        if name.endswith(("_fwd", "_bwd")):
            def counted(*args, _name=name, _fn=getattr(module, name), **kwargs):
                counts[_name] = counts.get(_name, 0) + 1
                return _fn(*args, **kwargs)

            monkeypatch.setattr(module, name, counted)
    return counts
