"""Run Hugging Face transformers' models and layers on their own pure-PyTorch code paths.

transformers binds kernel entry points (fla's Triton GDN kernels, mamba_ssm's scans,
causal_conv1d, hub kernels) at import time when those packages import, even on CPU where they
cannot run. :func:`force_module_pure_path` rebinds each name in a modeling module to the torch
function under its wrappers (:func:`benchmarks.transformers_torch_path.torch_function`) and
counts the calls, so that a test can confirm that the pure path really ran.
"""

from __future__ import annotations

import importlib
import importlib.metadata

import pytest
from packaging.version import Version

from benchmarks.transformers_torch_path import torch_function

PARITY_TRANSFORMERS = (5, 24)


def _installed_transformers() -> tuple[int, int] | None:
    """(major, minor) of the installed transformers, without importing it (None: not installed)."""
    try:
        return Version(importlib.metadata.version("transformers")).release[:2]
    except importlib.metadata.PackageNotFoundError:
        return None


#: Parity tests written against transformers >= 5.24's models and caches. Older releases differ:
#: 5.23 has no ``cache`` keyword in ``create_causal_mask`` and no ``DynamicCache.get_recurrent_state``;
#: 5.22 and older also fail in ``torch_chunk_gated_delta_rule`` with fewer key heads than value heads
#: and give other Mamba-2 outputs with ``n_groups`` > 1. Python 3.10 resolves transformers 5.20.2,
#: the newest release for it.
_INSTALLED = _installed_transformers()
needs_parity_transformers = pytest.mark.skipif(
    _INSTALLED is not None and _INSTALLED < PARITY_TRANSFORMERS,
    reason=f"written against transformers >= {'.'.join(map(str, PARITY_TRANSFORMERS))}'s models and caches; "
           f"the installed {'.'.join(map(str, _INSTALLED or ()))} differs")

_QWEN_KERNELS = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule",
                 "causal_conv1d_fn", "causal_conv1d_update")
KERNELS = {
    "mamba": ("transformers.models.mamba.modeling_mamba",
              ("mamba_inner_fn", "mamba_selective_scan", "mamba_selective_state_update",
               "causal_conv1d_fn", "causal_conv1d_update")),
    "mamba2": ("transformers.models.mamba2.modeling_mamba2",
               ("mamba2_split_conv1d_scan_combined", "mamba2_chunk_scan",
                "mamba2_selective_state_update", "causal_conv1d_fn", "causal_conv1d_update")),
    "qwen3_next": ("transformers.models.qwen3_next.modeling_qwen3_next", _QWEN_KERNELS),
    "qwen3_5": ("transformers.models.qwen3_5.modeling_qwen3_5", _QWEN_KERNELS),
}


def force_module_pure_path(monkeypatch, module, names) -> dict[str, int]:
    """Route the kernel names ``names`` of the imported modeling ``module`` to that module's own
    pure-PyTorch functions; returns ``{name: calls so far}``. Fails if a name does not wrap a
    function of ``module`` of the same name."""
    calls = dict.fromkeys(names, 0)
    for name in names:
        pure = torch_function(getattr(module, name))
        assert pure.__module__ == module.__name__ and pure.__name__ == name, \
            f"{module.__name__}.{name} does not wrap transformers' torch code: {pure}"

        def counted(*args, _pure=pure, _name=name, **kwargs):
            calls[_name] += 1
            return _pure(*args, **kwargs)

        monkeypatch.setattr(module, name, counted)
    return calls


def force_pure_path(monkeypatch, family: str) -> dict[str, int]:
    """:func:`force_module_pure_path` for transformers' ``family`` module (a key of :data:`KERNELS`)
    and its kernel names; skips the test if this transformers has no such module."""
    module_name, names = KERNELS[family]
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        pytest.skip(f"this transformers has no {module_name}")
    return force_module_pure_path(monkeypatch, module, names)
