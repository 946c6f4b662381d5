"""Backend selection for the kernel ops.

Every public op in :mod:`hybridzoo.kernels` takes ``backend=``:

* ``"auto"``: by device. CPU (and any device without a faster backend for the op) ->
  ``"reference"``; CUDA -> our ``"triton"`` kernels for the ops they implement, else
  ``"torch"`` (SDPA / flex_attention) for ``attention``, else ``"reference"``.
* ``"reference"``: pure PyTorch, any device and dtype (float64 included). THE SPEC.
* ``"triton"``, ``"fla"``, ``"mamba_ssm"``, ``"torch"``: faster paths, where they exist.

A backend module is imported only when it is asked for, so an optional package (fla,
mamba_ssm) is never imported at ``import hybridzoo`` time. A backend that is unknown, not
installed, or that does not implement the op raises :class:`BackendUnavailable` naming the
backend, the op and the fix.
"""

from __future__ import annotations

import importlib
from typing import Callable

import torch

# backend name -> (module path, pip extra / package a user installs to get it)
BACKENDS: dict[str, tuple[str, str | None]] = {
    "reference": ("hybridzoo.kernels.reference", None),
    "triton": ("hybridzoo.kernels.triton", "triton (pip install triton; needs a CUDA GPU or TRITON_INTERPRET=1)"),
    "fla": ("hybridzoo.kernels.backends.fla", "flash-linear-attention (pip install 'hybridzoo[fla]')"),
    "mamba_ssm": ("hybridzoo.kernels.backends.mamba_ssm", "mamba-ssm and causal-conv1d (pip install 'hybridzoo[mamba]')"),
    "torch": ("hybridzoo.kernels.backends.torch_sdpa", None),
}


class BackendUnavailable(RuntimeError):
    """Raised when a requested backend is unknown, not installed, or lacks the op."""


AUTO_CUDA_ORDER = ("triton", "torch")  # on CUDA: our kernels first, then torch's fused attention


def _auto_backend(op: str, device: torch.device) -> str:
    if device.type == "cuda":
        for backend in AUTO_CUDA_ORDER:
            try:
                module = importlib.import_module(BACKENDS[backend][0])
            except ImportError:
                continue
            if op in getattr(module, "OPS", ()):
                return backend
    return "reference"


def resolve(op: str, backend: str, device: torch.device) -> Callable:
    """Return the implementation of ``op`` for ``backend`` on ``device``."""
    if backend == "auto":
        backend = _auto_backend(op, device)
    if backend not in BACKENDS:
        raise BackendUnavailable(
            f"unknown backend {backend!r} for {op}; choose one of 'auto', "
            + ", ".join(repr(b) for b in BACKENDS)
        )
    module_path, package = BACKENDS[backend]
    try:
        module = importlib.import_module(module_path)
    except ModuleNotFoundError as error:
        if error.name and (error.name == module_path or module_path.startswith(error.name + ".")):
            raise BackendUnavailable(
                f"backend {backend!r} is planned but not part of this hybridzoo version yet; "
                f"use backend='reference' or 'auto' for {op}"
            ) from error
        hint = f": install {package}" if package else ""
        raise BackendUnavailable(
            f"backend {backend!r} for {op} needs the package {error.name!r}, which is not installed{hint}"
        ) from error
    impl = getattr(module, op, None)
    if impl is None or op not in getattr(module, "OPS", (op,)):
        raise BackendUnavailable(
            f"backend {backend!r} does not implement {op}; use backend='reference' or 'auto'"
        )
    return impl
