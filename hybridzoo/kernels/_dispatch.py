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
backend, the op and the fix. Our Triton kernels need Triton >= 3.6 and (compiled) a GPU of
compute capability 8.0 or more; where the installed Triton or the GPU cannot run them, or a shape
needs more shared memory than the GPU has, :class:`TritonUnsupported` names the op, the reason and
the fallback (``backend="reference"``, or the fla / mamba_ssm backend for the op).

Packed documents (``cu_seqlens=``, :mod:`hybridzoo.kernels.varlen`): a backend module declares the
ops it runs packed in a module-level ``VARLEN_OPS`` set (missing = none). A call with
``cu_seqlens`` on a backend that does not declare the op raises :class:`BackendUnavailable` naming
the op, the backend and the backends that do, never ignores the boundaries. ``"auto"`` picks the
backend it would pick without ``cu_seqlens``; if that one has no packed path for the op, the call
is refused the same way (it does not fall back to a slower backend silently).
"""

from __future__ import annotations

import functools
import importlib
import os
import sys
from importlib import metadata
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


class TritonUnsupported(BackendUnavailable):
    """Raised when the installed Triton or the GPU cannot run one of our Triton kernels."""


# The oldest Triton the kernels are tested with (the interpreter suite and the sm_90 compile run
# on 3.6, 3.7.1 and 3.9), and the oldest GPU they target (bf16 / tf32 tensor-core dots: Ampere).
MIN_TRITON = (3, 6)
MIN_CAPABILITY = (8, 0)
# what a user can run an op with instead of our Triton kernels
FALLBACKS = {
    "chunk_linear_attn": "backend='reference' (any device) or backend='fla'",
    "chunk_delta_rule": "backend='reference' (any device) or backend='fla'",
    "selective_scan": "backend='reference' (any device) or backend='mamba_ssm'",
    "causal_conv1d": "backend='reference' (any device) or backend='mamba_ssm'",
}


@functools.lru_cache(maxsize=None)
def _triton_version() -> tuple[int, ...] | None:
    """The installed Triton's ``(major, minor)``, None if Triton is not installed. Read once per
    process: ``metadata.version`` parses the package's metadata files from disk (0.6 ms on a 2-core CPU),
    and :func:`resolve` asks on every op call (four per layer in a training step)."""
    try:
        version = metadata.version("triton")
    except metadata.PackageNotFoundError:
        return None
    return tuple(int(part) for part in version.split("+")[0].split(".")[:2] if part.isdigit())


def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def triton_problem(op: str, device: torch.device) -> str | None:
    """Why our Triton kernel for ``op`` cannot run on ``device`` with the installed Triton (a
    sentence), or None when it can. Under ``TRITON_INTERPRET=1`` the GPU is not asked."""
    version = _triton_version()
    if version is not None and version < MIN_TRITON:
        return (f"the installed Triton {'.'.join(map(str, version))} is older than "
                f"{'.'.join(map(str, MIN_TRITON))}, the oldest these kernels are tested with "
                f"(pip install -U triton, or the versions of constraints.txt)")
    if device.type == "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        capability = _capability(device)
        if tuple(capability) < MIN_CAPABILITY:
            return (f"the GPU has compute capability {capability[0]}.{capability[1]}; the kernels need "
                    f"{MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or more (Ampere, Hopper or newer: bf16/tf32 "
                    "tensor-core dots)")
    return None


def _unsupported(op: str, reason: str) -> TritonUnsupported:
    return TritonUnsupported(f"the triton backend cannot run {op}: {reason}; use "
                             f"{FALLBACKS.get(op, 'backend=' + repr('reference'))} instead")


@functools.lru_cache(maxsize=None)
def _guard_resources(op: str, impl: Callable) -> Callable:
    """``impl`` with Triton's out-of-resources error (a launch past the GPU's shared memory or
    registers, e.g. head sizes above what the kernels were sized for) turned into
    :class:`TritonUnsupported` naming the op, the need, the limit and the fallback. Made once per
    op and implementation: :func:`resolve` runs on every op call (wrapping anew took half of its
    2.3 µs on a 2-core CPU)."""

    @functools.wraps(impl)
    def run(*args, **kwargs):
        try:
            return impl(*args, **kwargs)
        except Exception as error:  # noqa: BLE001 - only Triton's OutOfResources is translated
            if type(error).__name__ != "OutOfResources":
                raise
            need = getattr(error, "name", "resources")
            detail = f"needs {getattr(error, 'required', '?')} of {need}, the GPU has {getattr(error, 'limit', '?')}"
            raise _unsupported(op, f"these shapes are past the GPU's {need} limit ({detail})") from error

    return run


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


def varlen_backends(op: str) -> list[str]:
    """The backends that run ``op`` on packed documents, of those without an optional package and
    those already imported (naming a fix must not import fla, which takes seconds)."""
    found = []
    for name, (module_path, package) in BACKENDS.items():
        if package is not None and module_path not in sys.modules:
            continue
        try:
            module = importlib.import_module(module_path)
        except Exception:  # noqa: BLE001 - a backend that cannot load here is not offered
            continue
        if op in getattr(module, "VARLEN_OPS", ()):
            found.append(name)
    return found


def _refuse_varlen(op: str, backend: str, auto: bool) -> BackendUnavailable:
    others = [b for b in varlen_backends(op) if b != backend]
    fix = " or ".join(f"backend={b!r}" for b in others) or "backend='reference'"
    how = f"backend='auto' picked {backend!r} for {op} on this device, but it" if auto else f"backend {backend!r}"
    return BackendUnavailable(
        f"{how} has no packed-documents (cu_seqlens) path for {op}; pass {fix}, "
        f"or call without cu_seqlens (one document per row)")


def resolve(op: str, backend: str, device: torch.device, varlen: bool = False) -> Callable:
    """Return the implementation of ``op`` for ``backend`` on ``device``; ``varlen=True`` (the
    call passes ``cu_seqlens``) also requires the backend to declare ``op`` in its ``VARLEN_OPS``."""
    auto = backend == "auto"
    if auto:
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
    if varlen and op not in getattr(module, "VARLEN_OPS", ()):
        raise _refuse_varlen(op, backend, auto)
    if backend == "triton":
        problem = triton_problem(op, device)
        if problem is not None:
            raise _unsupported(op, problem)
        return _guard_resources(op, impl)
    return impl


def runs_on_triton(backend: str, device: torch.device, ops: tuple[str, ...], varlen: bool = False) -> bool:
    """True when ``backend`` runs every op of ``ops`` on our Triton kernels on ``device`` (the
    condition of the Mamba layers' one-node training steps). An unusable Triton raises the op's
    usual error."""
    for op in ops:
        if (_auto_backend(op, device) if backend == "auto" else backend) != "triton":
            return False
        resolve(op, backend, device, varlen)  # the clear error of an unusable backend, as the general path gives
    return True
