"""exp as one ``ex2.approx.ftz.f32`` on CUDA, shared by the scan and chunk kernels.

``tl.exp`` on float32 compiles for sm_90 to a multiply by log2(e), a range check and two
predicated multiplies around one ``MUFU.EX2`` (the PTX ``ex2.approx.f32`` keeps results below
2^-126 as subnormals). :func:`_exp2` is the bare ``ex2.approx.ftz.f32``: one ``MUFU.EX2``; results
below 2^-126 flush to zero, where every decay of these kernels is zero to float32 anyway.
:func:`_exp` is ``_exp2(x · log2(e))``; kernels that can fold log2(e) into a factor they already
multiply by (the selective scan's ``A``) call :func:`_exp2` directly. Under the interpreter and on
other backends (:data:`FAST_EXP` false) both are ``tl.exp2``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridzoo.kernels.triton import launch

FAST_EXP = tl.constexpr(not launch.interpret() and torch.version.hip is None)
LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _exp2(x):
    """``2^x``, float32 (:data:`FAST_EXP`)."""
    if FAST_EXP:
        return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32,
                                         is_pure=True, pack=1)
    else:
        return tl.exp2(x)


@triton.jit
def _exp(x):
    """``e^x``, float32: :func:`_exp2` of ``x · log2(e)``."""
    return _exp2(x * LOG2E)
