"""When the layers' fused Triton passes run: RMSNorm, the gated RMSNorm and the per-head l2 norm
(:mod:`hybridzoo.kernels.triton.norm`), SwiGLU (``.swiglu``), the token cross-entropy
(``.cross_entropy``) and the rotary embedding (``.rotary``).

Those layers are written as autograd Functions whose plain-PyTorch bodies are the spec (any
device, float64 included). On a CUDA GPU that can run our Triton kernels, the same Functions call
one fused kernel instead of a chain of elementwise ops: the values are those of the plain body up
to float32 rounding (each kernel computes in float32 on chip), with far less memory traffic.

``FUSED`` (``HYBRIDZOO_FUSED=0`` turns it off) switches them all; tests set ``FORCE`` to run
the fused path under ``TRITON_INTERPRET=1`` on CPU tensors. This module does not import Triton.
"""

from __future__ import annotations

import os

import torch

FUSED = os.environ.get("HYBRIDZOO_FUSED", "1") != "0"
FORCE = False  # tests: take the fused path on CPU tensors too (under the Triton interpreter)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def applies(*tensors: torch.Tensor) -> bool:
    """Whether the fused Triton path runs for these tensors: all on one CUDA device (or
    :data:`FORCE` set), all float16 / bfloat16 / float32, and a Triton that can run our kernels."""
    if not FUSED or not tensors or any(t.dtype not in DTYPES for t in tensors):
        return False
    if FORCE:
        return True
    device = tensors[0].device
    if device.type != "cuda" or any(t.device != device for t in tensors):
        return False
    return _triton_ok(device)


_OK: dict = {}


def _triton_ok(device: torch.device) -> bool:
    key = (device.type, device.index)
    if key not in _OK:
        try:
            import triton  # noqa: F401
        except ImportError:
            _OK[key] = False
        else:
            from hybridzoo.kernels._dispatch import triton_problem

            _OK[key] = triton_problem("fused", device) is None
    return _OK[key]
