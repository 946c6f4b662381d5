"""The torch backend of ``attention`` (SDPA / flex_attention) against the reference."""

import pytest
import torch

from hybridzoo.kernels import attention
from hybridzoo.utils import rel_err


@pytest.mark.parametrize("window", [None, 1, 7])
@pytest.mark.parametrize("prefix_len", [0, 5, 20])
@pytest.mark.parametrize("return_lse", [False, True])
def test_matches_reference(window, prefix_len, return_lse):
    torch.manual_seed(0)
    B, T, Hq, Hk, D = 2, 19, 4, 2, 16
    q, k, v = torch.randn(B, T, Hq, D), torch.randn(B, T, Hk, D), torch.randn(B, T, Hk, D)
    prefix = (torch.randn(B, prefix_len, Hk, D), torch.randn(B, prefix_len, Hk, D)) if prefix_len else None
    ref, ref_lse = attention(q.double(), k.double(), v.double(), window=window, return_lse=True,
                             prefix=tuple(p.double() for p in prefix) if prefix else None, backend="reference")
    out, lse = attention(q, k, v, window=window, prefix=prefix, return_lse=return_lse, backend="torch")
    assert rel_err(out, ref) < 1e-5
    if return_lse:
        assert rel_err(lse, ref_lse) < 1e-5
    else:
        assert lse is None


@pytest.mark.gpu
def test_gradients_match_reference_on_gpu():
    # flex_attention has no CPU backward; on CUDA it is compiled
    torch.manual_seed(1)
    q, k, v = (torch.randn(1, 300, 2, 64, device="cuda", requires_grad=True) for _ in range(3))
    grads = {}
    for backend in ("reference", "torch"):
        out, lse = attention(q, k, v, window=4, return_lse=True, backend=backend)
        grads[backend] = torch.autograd.grad(out.square().sum() + lse.sum(), (q, k, v))
    for a, b in zip(grads["reference"], grads["torch"]):
        assert rel_err(b, a) < 1e-5


def test_cpu_backward_and_small_head_dims_fall_back_to_the_reference():
    # flex_attention has no CPU backward and needs head dims >= 16 on CUDA: same math via the reference
    torch.manual_seed(2)
    q, k, v = (torch.randn(1, 9, 2, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    grads = {}
    for backend in ("reference", "torch"):
        out, lse = attention(q, k, v, window=3, return_lse=True, backend=backend)
        grads[backend] = torch.autograd.grad(out.square().sum() + lse.sum(), (q, k, v))
    for a, b in zip(grads["reference"], grads["torch"]):
        assert rel_err(b, a) <= 1e-12
