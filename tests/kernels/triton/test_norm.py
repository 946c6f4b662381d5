"""The fused RMSNorm / gated RMSNorm kernels against the float64 formulas written out here.

CPU (``TRITON_INTERPRET=1``): odd widths (40, 24, 36), row counts that are not a multiple of the
interpreter's 4-row block, several backward programs each looping over row blocks, groups
narrower than the row, both gate orders, zero-centred weights; float32 inputs to ~1e-6 and bf16
inputs against float64 of the bf16 values. Outputs start as NaN (``launch.POISON_OUTPUTS``), so an
element a kernel leaves unwritten shows. GPU (``@pytest.mark.gpu``): a model's shapes.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybridzoo.kernels.triton import launch, norm
from hybridzoo.utils import rel_err

F64 = torch.float64
EPS = 0.05  # comparable to mean(x²) of the inputs below (x ~ 0.3 N(0, 1)): dropping it shows


def formula(x, z, weight, eps, group, norm_before_gate=True, zero_centered=False):
    """``u / sqrt(mean_group(u²) + eps) · w`` in the inputs' dtype (float64 here); ``u = x``, or
    ``x · silu(z)`` when the gate comes first; ``· silu(z)`` after the norm otherwise."""
    w = 1 + weight if zero_centered else weight
    gate = None if z is None else z * torch.sigmoid(z)
    u = x * gate if gate is not None and not norm_before_gate else x
    groups = u.unflatten(-1, (-1, group))
    y = (groups / torch.sqrt((groups * groups).mean(-1, keepdim=True) + eps)).flatten(-2) * w
    return y * gate if gate is not None and norm_before_gate else y


def _inputs(n, d, gated, dtype, seed=0):
    torch.manual_seed(seed)
    x = 0.3 * torch.randn(n, d, dtype=F64)
    z = 1.5 * torch.randn(n, d, dtype=F64) if gated else None
    weight = torch.randn(d, dtype=F64)
    grad = torch.randn(n, d, dtype=F64)
    # the kernels' inputs, and float64 copies of exactly those values (bf16-rounded for bf16)
    ins = [None if t is None else t.to(dtype) for t in (x, z, grad)] + [weight.float()]
    return ins, [None if t is None else t.to(F64) for t in ins]


def _expected(ref, group, norm_before_gate, zero_centered):
    """Float64 output and gradients (x, z, weight) of the formula at the float64 inputs ``ref``."""
    x, z, grad, weight = ref
    leaves = [t.clone().requires_grad_() for t in (x, z, weight) if t is not None]
    x_, z_ = leaves[0], leaves[1] if z is not None else None
    y = formula(x_, z_, leaves[-1], EPS, group, norm_before_gate, zero_centered)
    return y.detach(), torch.autograd.grad(y, leaves, grad)


CASES = [  # (rows, dim, group, gated, norm_before_gate, zero_centered)
    (13, 40, 40, False, True, False),
    (13, 40, 40, False, True, True),
    (6, 24, 24, False, True, True),
    (11, 48, 24, True, True, False),
    (11, 48, 24, True, False, False),
    (9, 36, 12, True, True, False),
    (9, 36, 12, True, False, False),
    (7, 24, 24, True, False, False),
]


def _tol(result: torch.Tensor) -> float:
    """A float32 result is float32-exact; a bf16 one is off by its rounding (~1.6e-3 seen)."""
    return 2e-6 if result.dtype == torch.float32 else 4e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, dim, group, gated, norm_before_gate, zero_centered", CASES)
def test_values_and_gradients_are_the_float64_formula(monkeypatch, dtype, rows, dim, group, gated,
                                                      norm_before_gate, zero_centered):
    monkeypatch.setattr(launch, "POISON_OUTPUTS", True)
    (x, z, grad, weight), ref = _inputs(rows, dim, gated, dtype)
    y_ref, grads_ref = _expected(ref, group, norm_before_gate, zero_centered)
    if gated:
        y, rstd = norm.gated_rms_norm_fwd(x, z, weight, EPS, group, norm_before_gate)
        grads = norm.gated_rms_norm_bwd(grad, x, z, weight, rstd, EPS, group, norm_before_gate)
    else:
        y, rstd = norm.rms_norm_fwd(x, weight, EPS, zero_centered)
        grads = norm.rms_norm_bwd(grad, x, weight, rstd, zero_centered)
    assert y.dtype == dtype and rstd.dtype == torch.float32
    assert rstd.shape == ((rows, dim // group) if gated else (rows,))
    u = ref[0] if not gated or norm_before_gate else ref[0] * F.silu(ref[1])  # what is normalised
    rstd_ref = (u.unflatten(-1, (-1, group)).pow(2).mean(-1) + EPS).rsqrt()
    assert rel_err(rstd.view(rows, -1), rstd_ref) <= 2e-6
    assert rel_err(y, y_ref) <= _tol(y)
    names, want_dtypes = (("x", "z", "weight"), (dtype, dtype, torch.float32)) if gated else (
        ("x", "weight"), (dtype, torch.float32))
    for name, got, want, want_dtype in zip(names, grads, grads_ref, want_dtypes):
        assert got.dtype == want_dtype, name
        assert rel_err(got, want) <= _tol(got), name


def test_strided_rows_are_read_in_place():
    """``x`` and ``z`` as column slices of a wider tensor (Mamba-2's z is a split of the
    in-projection's output) and an expanded upstream gradient (row stride 0)."""
    torch.manual_seed(0)
    wide = torch.randn(10, 3 * 24)
    x, z = wide[:, :24], wide[:, 24:48]
    weight, grad = torch.randn(24), torch.randn(1, 24).expand(10, 24)
    assert x.stride(0) == 72 and grad.stride(0) == 0
    y, rstd = norm.gated_rms_norm_fwd(x, z, weight, EPS, 12, False)
    leaves = [t.double().requires_grad_() for t in (x, z, weight)]
    y_ref = formula(*leaves, EPS, 12, False)
    assert rel_err(y, y_ref) <= 2e-6
    grads = norm.gated_rms_norm_bwd(grad, x, z, weight, rstd, EPS, 12, False)
    for got, want in zip(grads, torch.autograd.grad(y_ref, leaves, grad.double())):
        assert rel_err(got, want) <= 2e-6


def test_dz_out_writes_z_gradient_into_columns_of_a_wider_tensor():
    """``dz_out``: z's gradient written straight into a column slice of a wider buffer (Mamba-2's
    one-node step writes it into in_proj's gradient), equal to the gradient returned otherwise and
    to the float64 formula's; the other columns untouched; a buffer of the wrong shape, dtype or
    layout refused."""
    torch.manual_seed(1)
    x, z, weight, grad = torch.randn(11, 24), torch.randn(11, 24), torch.randn(24), torch.randn(11, 24)
    y, rstd = norm.gated_rms_norm_fwd(x, z, weight, EPS, 12, False)
    dx, dz, dw = norm.gated_rms_norm_bwd(grad, x, z, weight, rstd, EPS, 12, False)
    wide = torch.full((11, 40), 7.0)
    dx2, dz2, dw2 = norm.gated_rms_norm_bwd(grad, x, z, weight, rstd, EPS, 12, False, dz_out=wide[:, 8:32])
    assert dz2.data_ptr() == wide[:, 8:32].data_ptr()
    assert torch.equal(wide[:, 8:32], dz) and torch.equal(dx2, dx) and torch.equal(dw2, dw)
    assert torch.all(wide[:, :8] == 7.0) and torch.all(wide[:, 32:] == 7.0)
    leaves = [t.double().requires_grad_() for t in (x, z, weight)]
    want = torch.autograd.grad(formula(*leaves, EPS, 12, False), leaves, grad.double())[1]
    assert rel_err(wide[:, 8:32], want) <= 2e-6
    for bad in (torch.empty(11, 20), torch.empty(11, 24, dtype=torch.bfloat16), torch.empty(24, 11).t()):
        with pytest.raises(ValueError, match="dz_out"):
            norm.gated_rms_norm_bwd(grad, x, z, weight, rstd, EPS, 12, False, dz_out=bad)


def test_out_dtype_rounds_the_float32_output_once():
    """``out_dtype``: the kernel's float32 value rounded once on the store, bit for bit what casting
    its float32 output gives (Mamba-2's step hands the norm's output to ``out_proj`` this way), and
    still the float64 formula to bf16 rounding; a dtype the kernel cannot store is refused."""
    torch.manual_seed(0)
    x, z, weight = torch.randn(9, 24), torch.randn(9, 24), torch.randn(24)
    y32, rstd32 = norm.gated_rms_norm_fwd(x, z, weight, EPS, 12, False)
    y16, rstd16 = norm.gated_rms_norm_fwd(x, z, weight, EPS, 12, False, out_dtype=torch.bfloat16)
    assert y16.dtype == torch.bfloat16 and y32.dtype == torch.float32
    assert torch.equal(y16, y32.to(torch.bfloat16)) and torch.equal(rstd16, rstd32)
    assert rel_err(y16, formula(x.double(), z.double(), weight.double(), EPS, 12, False)) <= 8e-3
    with pytest.raises(ValueError, match="out_dtype"):
        norm.gated_rms_norm_fwd(x, z, weight, EPS, 12, False, out_dtype=torch.int32)


def test_bad_inputs_are_named():
    x, w = torch.randn(4, 24), torch.randn(24)
    with pytest.raises(ValueError, match=r"x must be \[N, 24\]"):
        norm.rms_norm_fwd(x[:, :20], w, EPS)
    with pytest.raises(ValueError, match="not a multiple of group_size 10"):
        norm.gated_rms_norm_fwd(x, x, w, EPS, 10, True)
    with pytest.raises(ValueError, match="z .* must have the shape of x"):
        norm.gated_rms_norm_fwd(x, x[:2], w, EPS, 24, True)
    wide = torch.randn(2 * norm.MAX_GROUP)
    with pytest.raises(ValueError, match="exceed"):
        norm.rms_norm_fwd(torch.randn(1, wide.numel()), wide, EPS)
    with pytest.raises(ValueError, match="rstd"):
        norm.rms_norm_bwd(x, x, w, torch.ones(3))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("dim, group, gated, norm_before_gate", [
    (1024, 1024, False, True), (4096, 4096, False, True), (8192, 8192, False, True),
    (128, 128, True, True), (2048, 1024, True, False), (2048, 256, True, False)])
def test_gpu_model_shapes(monkeypatch, dtype, tol, dim, group, gated, norm_before_gate):
    monkeypatch.setattr(launch, "POISON_OUTPUTS", True)
    rows = 2 * 2048 * (8 if dim == 128 else 1) + 5
    (x, z, grad, weight), ref = _inputs(rows, dim, gated, dtype)
    x, z, grad, weight = (None if t is None else t.cuda() for t in (x, z, grad, weight))
    ref = [None if t is None else t.cuda() for t in ref]
    y_ref, grads_ref = _expected(ref, group, norm_before_gate, False)
    if gated:
        y, rstd = norm.gated_rms_norm_fwd(x, z, weight, EPS, group, norm_before_gate)
        grads = norm.gated_rms_norm_bwd(grad, x, z, weight, rstd, EPS, group, norm_before_gate)
    else:
        y, rstd = norm.rms_norm_fwd(x, weight, EPS)
        grads = norm.rms_norm_bwd(grad, x, weight, rstd)
    assert rel_err(y, y_ref) <= tol
    for got, want in zip(grads, grads_ref):
        assert rel_err(got, want) <= tol
