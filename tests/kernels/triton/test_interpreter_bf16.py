"""bfloat16 under Triton's interpreter (``launch._interpreter_bf16``): a ``tl.dot`` of bfloat16
operands and a float32 -> bfloat16 cast give what a GPU gives. Without the patch the dot
multiplies the raw uint16 bit patterns (errors ~1e10, triton-lang/triton#11584) and the cast
truncates toward zero (about half of all values off by one bf16 ulp, all rounded down in size)."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from hybridzoo.kernels.triton import launch

pytestmark = pytest.mark.skipif(not launch.interpret(), reason="checks Triton's interpreter")


@triton.jit
def _dot_and_cast(a_ptr, b_ptr, c_ptr, x_ptr, y_ptr, N: tl.constexpr, M: tl.constexpr):
    r = tl.arange(0, N)
    tile = r[:, None] * N + r[None, :]
    tl.store(c_ptr + tile, tl.dot(tl.load(a_ptr + tile), tl.load(b_ptr + tile)))
    m = tl.arange(0, M)
    tl.store(y_ptr + m, tl.load(x_ptr + m).to(tl.bfloat16))


def test_bf16_dot_and_cast_match_torch():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(16, 16, generator=g).bfloat16()
    b = torch.randn(16, 16, generator=g).bfloat16()
    special = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1.0 + 2 ** -8,
                            1.0 + 3 * 2 ** -8, -(1.0 + 2 ** -8), 3.0e38, 1e-40])  # ties go to even
    x = torch.cat([torch.randn(4096 - len(special), generator=g), special])
    c = torch.empty(16, 16)
    y = torch.empty(4096, dtype=torch.bfloat16)
    _dot_and_cast[(1,)](a, b, c, x, y, N=16, M=4096)
    # products of bf16 values are exact in float32; only the summation order may differ
    assert torch.allclose(c, a.float() @ b.float(), rtol=1e-6, atol=1e-6)
    ref = x.bfloat16()  # torch rounds to nearest even, as compiled kernels do
    same = (y == ref) | (y.isnan() & ref.isnan())
    assert bool(same.all()), (x[~same][:5], y[~same][:5], ref[~same][:5])
