"""Triton causal_conv1d against the reference.

CPU (``TRITON_INTERPRET=1``): tiny shapes, float32 kernels against the float64 step loop: output,
final state, gradients for x, weight, bias, initial_state (also through final_state).
GPU (``@pytest.mark.gpu``): real shapes, bf16 and fp32, against the float64 reference (cuDNN's
float32 convolutions may use TF32), outputs poisoned with NaN first.
"""

from __future__ import annotations

import pytest
import torch

from hybridzoo.kernels import causal_conv1d as causal_conv1d_op
from hybridzoo.kernels.reference import causal_conv1d as reference_conv
from hybridzoo.kernels.reference import causal_conv1d_loop
from hybridzoo.kernels.triton import launch
from hybridzoo.kernels.triton.conv import causal_conv1d
from hybridzoo.utils import rel_err
from tests.kernels.triton.tuning import tuning_rounds

F64 = torch.float64


def _inputs(batch=2, length=19, dm=11, width=4, seed=0, dtype=F64, device="cpu"):
    torch.manual_seed(seed)
    x = dict(
        x=torch.randn(batch, length, dm),
        weight=torch.randn(dm, width),
        bias=torch.randn(dm),
        initial_state=torch.randn(batch, width - 1, dm),
    )
    return {k: v.to(device=device, dtype=dtype) for k, v in x.items()}


def _run(fn, x, activation):
    return fn(x["x"], x["weight"], x["bias"], initial_state=x["initial_state"], output_final_state=True,
              activation=activation)


def _leaves(x, dtype=None):
    return {k: (None if v is None else v.detach().to(dtype or v.dtype).requires_grad_()) for k, v in x.items()}


def _check_against_loop(x, activation, tol=1e-5, weights=(1.0, 1.0)):
    ref_in, tri_in = _leaves(x), _leaves(x, torch.float32)
    y_ref, s_ref = _run(causal_conv1d_loop, ref_in, activation)
    y, s = _run(causal_conv1d, tri_in, activation)
    assert y.dtype == torch.float32 and s.dtype == torch.float32
    assert rel_err(y, y_ref) <= tol
    assert rel_err(s, s_ref) <= tol
    torch.manual_seed(1)
    gy, gs = torch.randn_like(y_ref) * weights[0], torch.randn_like(s_ref) * weights[1]
    ((y_ref * gy).sum() + (s_ref * gs).sum()).backward()
    ((y * gy.float()).sum() + (s * gs.float()).sum()).backward()
    for name, leaf in tri_in.items():
        if leaf is None or leaf.numel() == 0:  # no tail when W = 1
            continue
        ref = ref_in[name].grad
        assert rel_err(leaf.grad, torch.zeros_like(ref_in[name]) if ref is None else ref) <= tol, name


@pytest.mark.parametrize("width", [2, 4, 5])  # 5: the tiled backward (W > 4), else the step-ordered one
@pytest.mark.parametrize("length", [19, 2])  # 2 < W - 1 = 3: the final state mixes tail and x
@pytest.mark.parametrize("activation", [None, "silu"])
def test_matches_loop(width, length, activation):
    _check_against_loop(_inputs(length=length, width=width, seed=length + width), activation)


def test_without_bias_and_state():
    x = _inputs(length=13, width=3, seed=3)
    x.update(bias=None, initial_state=None)
    _check_against_loop(x, "silu")


def test_width_one_and_state_only_gradient():
    """W = 1 (no tail); and a loss through the final state alone (zero output gradient)."""
    _check_against_loop(_inputs(length=9, width=1, seed=4), "silu")
    _check_against_loop(_inputs(length=9, width=4, seed=5), "silu", weights=(0.0, 1.0))


def test_state_carrying():
    x = _inputs(length=17, dtype=torch.float32, seed=6)
    y, s = _run(causal_conv1d, x, "silu")
    first = dict(x, x=x["x"][:, :6])
    y1, s1 = _run(causal_conv1d, first, "silu")
    y2, s2 = _run(causal_conv1d, dict(x, x=x["x"][:, 6:], initial_state=s1), "silu")
    assert rel_err(torch.cat([y1, y2], dim=1), y) <= 1e-6
    assert torch.equal(s2, s)


@pytest.mark.parametrize("width", [4, 5])  # the step-ordered backward and the tiled one
@pytest.mark.parametrize("batch", [2, 1])
def test_channel_slice_of_a_wider_tensor_is_read_in_place(width, batch):
    """x as Mamba's layers pass it: the channels ``[dm, 2·dm)`` of a ``[B, T, 2·dm + 3]`` tensor
    (one token every ``2·dm + 3`` elements). The kernels read it in place (no copy) and give the
    float64 loop's output and gradients, the gradient reaching the wide tensor at those channels
    only; a transposed view (channels not adjacent) is copied first and gives the same."""
    x = _inputs(batch=batch, length=19, dm=11, width=width, seed=20 + width)
    torch.manual_seed(21)
    wide = torch.randn(batch, 19, 2 * 11 + 3)
    wide[..., 11:22] = x["x"].float()
    wide.requires_grad_()
    sliced = wide[..., 11:22]
    assert not sliced.is_contiguous() and launch.token_rows(sliced).data_ptr() == sliced.data_ptr()
    ref_in = _leaves(x)
    rest = _leaves({k: v for k, v in x.items() if k != "x"}, torch.float32)
    y_ref, s_ref = _run(causal_conv1d_loop, ref_in, "silu")
    y, s = _run(causal_conv1d, dict(rest, x=sliced), "silu")
    assert rel_err(y, y_ref) <= 1e-5 and rel_err(s, s_ref) <= 1e-5
    gy, gs = torch.randn_like(y_ref), torch.randn_like(s_ref)
    ((y_ref * gy).sum() + (s_ref * gs).sum()).backward()
    ((y * gy.float()).sum() + (s * gs.float()).sum()).backward()
    assert rel_err(wide.grad[..., 11:22], ref_in["x"].grad) <= 1e-5
    assert torch.count_nonzero(wide.grad[..., :11]) == 0 and torch.count_nonzero(wide.grad[..., 22:]) == 0
    for name in ("weight", "bias", "initial_state"):
        assert rel_err(rest[name].grad, ref_in[name].grad) <= 1e-5, name
    # the same op on a contiguous copy: bitwise the same output
    assert torch.equal(_run(causal_conv1d, dict(rest, x=sliced.detach().contiguous()), "silu")[0], y.detach())
    transposed = x["x"].float().transpose(0, 1).contiguous().transpose(0, 1)  # tokens of a sequence far apart
    assert launch.token_rows(transposed).data_ptr() != transposed.data_ptr() or batch == 1
    assert rel_err(_run(causal_conv1d, dict(rest, x=transposed), "silu")[0], y_ref) <= 1e-5


@pytest.mark.parametrize("width", [4, 5])  # the step-ordered backward and the tiled one
def test_grads_write_dx_where_asked(width):
    """conv_grads' ``dx_out``: the input gradient goes into the given slice of a wider tensor
    (Mamba-1's ``x`` half of xz's gradient), bitwise the gradient it returns otherwise; the slice
    is returned, the other columns left as they were, and the weight, bias and tail gradients
    are unchanged. A buffer of another shape or dtype, or with unevenly spaced tokens, is refused."""
    from hybridzoo.kernels.triton.conv import conv_grads

    x = {k: v.float() for k, v in _inputs(length=19, width=width, seed=40).items()}
    torch.manual_seed(41)
    dy = torch.randn_like(x["x"])
    args = (x["x"], x["weight"], x["bias"], x["initial_state"], True, dy)
    plain = conv_grads(*args)
    wide = torch.full((2, 19, 2 * 11), 5.0)
    into = conv_grads(*args, dx_out=wide[..., :11])
    assert into[0].data_ptr() == wide.data_ptr()
    assert torch.equal(wide[..., :11], plain[0]) and bool((wide[..., 11:] == 5.0).all())
    for a, b in zip(plain[1:], into[1:]):
        assert torch.equal(a, b)
    for bad in (torch.empty(2, 19, 11, dtype=torch.bfloat16), torch.empty(2, 18, 11),
                torch.empty(19, 2, 11).transpose(0, 1)):
        with pytest.raises(ValueError, match="dx_out"):
            conv_grads(*args, dx_out=bad)


def test_row_stride_reads_evenly_spaced_tokens_only():
    """launch.row_stride: the elements from one token to the next where the tokens of
    ``[B, T, ...]`` are evenly spaced (across sequences too) and the dims after T dense; None
    otherwise. A contiguous tensor always has one, even with odd strides on its size-1 dims."""
    wide = torch.empty(3, 5, 20)
    assert launch.row_stride(torch.empty(3, 5, 7)) == 7
    assert launch.row_stride(wide[..., 4:11]) == 20  # a channel slice
    assert launch.row_stride(wide[..., 4:12].reshape(3, 5, 2, 4)) == 20  # grouped columns
    assert launch.row_stride(wide[:, 2:3, 4:11]) == 100  # one token a sequence: the sequences' stride
    assert launch.row_stride(wide[:1, 2:3, 4:11]) == 7  # one token of one sequence: any stride
    assert launch.row_stride(torch.empty(3, 1, 7).as_strided((3, 1, 7), (7, 99, 1))) == 7  # odd size-1 stride
    assert launch.row_stride(torch.empty(5, 3, 7).transpose(0, 1)) is None  # a sequence's tokens far apart
    assert launch.row_stride(wide[..., ::2]) is None  # channels not adjacent
    assert launch.row_stride(torch.empty(1, 1, 7).expand(3, 5, 7)) is None  # tokens overlap
    odd = torch.empty(3, 1, 7).as_strided((3, 1, 7), (7, 99, 1))
    assert odd.is_contiguous() and launch.token_rows(odd) is odd


def test_poisoned_outputs(monkeypatch):
    monkeypatch.setattr(launch, "POISON_OUTPUTS", True)
    _check_against_loop(_inputs(length=23, dm=13, seed=7), "silu")


def test_dispatch_and_errors():
    x = _inputs(length=7, dtype=torch.float32)
    y, s = _run(lambda *a, **k: causal_conv1d_op(*a, **k, backend="triton"), x, "silu")
    y_ref, s_ref = _run(reference_conv, x, "silu")
    assert rel_err(y, y_ref) <= 1e-5 and torch.equal(s, s_ref)
    with pytest.raises(ValueError, match="backend='reference'"):
        _run(causal_conv1d, _inputs(length=4), None)  # float64
    with pytest.raises(ValueError, match="weight must be"):
        causal_conv1d(x["x"], x["weight"][:3])
    empty = _inputs(length=0, dtype=torch.float32)
    y0, s0 = _run(causal_conv1d, empty, None)
    assert y0.shape == (2, 0, 11) and torch.equal(s0, empty["initial_state"])


# ---------------------------------------------------------------- GPU, real shapes


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 1e-2), (torch.float32, 1e-4)])
@pytest.mark.parametrize("dm,width", [(2048, 4), (256, 2), (320, 5)])
def test_gpu_real_shapes(monkeypatch, dtype, tol, dm, width):
    monkeypatch.setattr(launch, "POISON_OUTPUTS", True)
    x = _inputs(batch=2, length=16384, dm=dm, width=width, seed=8, dtype=dtype, device="cuda")
    tri_in, ref_in = _leaves(x), _leaves(x, F64)
    y, s = _run(causal_conv1d, tri_in, "silu")
    y_ref, s_ref = _run(reference_conv, ref_in, "silu")
    assert y.dtype == dtype and not y.isnan().any()
    assert rel_err(y, y_ref) <= tol and torch.equal(s.to(F64), s_ref)
    torch.manual_seed(9)
    gy, gs = torch.randn_like(y_ref), torch.randn_like(s_ref)
    ((y.to(F64) * gy).sum() + (s.to(F64) * gs).sum()).backward()
    ((y_ref * gy).sum() + (s_ref * gs).sum()).backward()
    for name, leaf in tri_in.items():
        assert leaf.grad.dtype == leaf.dtype and not leaf.grad.isnan().any(), name
        assert rel_err(leaf.grad, ref_in[name].grad) <= tol, name


@pytest.mark.gpu
@pytest.mark.parametrize("width", [4, 5])
def test_gpu_channel_slice(monkeypatch, width):
    """bf16 x as Mamba-1 passes it (the second half of a ``[B, T, 2·1536]`` tensor), read in place,
    against the float64 reference: output and gradients, the wide tensor's other half untouched."""
    monkeypatch.setattr(launch, "POISON_OUTPUTS", True)
    x = _inputs(batch=8, length=2048, dm=1536, width=width, seed=10, dtype=torch.bfloat16, device="cuda")
    wide = torch.cat([torch.randn_like(x["x"]), x["x"]], dim=-1).requires_grad_()
    rest = _leaves({k: v for k, v in x.items() if k != "x"})
    ref_in = _leaves(x, F64)
    y, s = _run(causal_conv1d, dict(rest, x=wide[..., 1536:]), "silu")
    y_ref, s_ref = _run(reference_conv, ref_in, "silu")
    assert not y.isnan().any() and rel_err(y, y_ref) <= 1e-2 and torch.equal(s.to(F64), s_ref)
    torch.manual_seed(11)
    gy = torch.randn_like(y_ref)
    (y.to(F64) * gy).sum().backward()
    (y_ref * gy).sum().backward()
    assert rel_err(wide.grad[..., 1536:], ref_in["x"].grad) <= 1e-2 and not wide.grad[..., :1536].any()
    for name, leaf in rest.items():
        assert rel_err(leaf.grad, ref_in[name].grad) <= 1e-2, name


@pytest.mark.gpu
@pytest.mark.parametrize("autotune", [False, True], ids=["each-setting", "autotuner"])
def test_gpu_every_launch_setting(monkeypatch, autotune):
    """Each forward and backward setting the autotuner may pick (i-th of each together), and the
    autotuner itself, at a length no tile divides; bf16 against the float64 reference. Width 4
    runs the step-ordered backward, width 5 the tiled one."""
    import hybridzoo.kernels.triton.conv as conv

    monkeypatch.setattr(launch, "POISON_OUTPUTS", True)
    configs_of = {conv._fwd: conv.FWD_CONFIGS, conv._bwd: conv.BWD_CONFIGS, conv._bwd_seq: conv.SEQ_CONFIGS}
    for i in tuning_rounds(monkeypatch, configs_of, each=not autotune):
        for width in (4, 5):
            x = _inputs(batch=2, length=1000, dm=300, width=width, seed=10, dtype=torch.bfloat16, device="cuda")
            tri_in, ref_in = _leaves(x), _leaves(x, F64)
            y, s = _run(causal_conv1d, tri_in, "silu")
            y_ref, s_ref = _run(reference_conv, ref_in, "silu")
            assert rel_err(y, y_ref) <= 1e-2, (i, width)
            gy = torch.randn_like(y_ref)
            (y.to(F64) * gy).sum().backward()
            (y_ref * gy).sum().backward()
            for name, leaf in tri_in.items():
                assert rel_err(leaf.grad, ref_in[name].grad) <= 1e-2, (name, i, width)


@pytest.mark.gpu
def test_gpu_auto_dispatch_picks_triton():
    x = _inputs(length=64, dm=64, dtype=torch.float32, device="cuda")
    y, s = _run(lambda *a, **k: causal_conv1d_op(*a, **k, backend="auto"), x, None)
    y_t, s_t = _run(causal_conv1d, x, None)
    assert torch.equal(y, y_t) and torch.equal(s, s_t)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_half_precision_inputs_match_the_float64_loop(dtype):
    """fp16 / bf16 under the interpreter: output and final state in the input dtype (the state is
    the last inputs, copied exactly), every gradient in its input's dtype, within 1e-2 of the
    float64 step loop run on the same (rounded) inputs."""
    x = _inputs(length=19, dm=11, width=4, seed=23, dtype=dtype)
    tri_in, ref_in = _leaves(x), _leaves(x, F64)
    y, s = _run(causal_conv1d, tri_in, "silu")
    y_ref, s_ref = _run(causal_conv1d_loop, ref_in, "silu")
    assert y.dtype == s.dtype == dtype and not y.isnan().any()
    assert rel_err(y, y_ref) <= 1e-2 and torch.equal(s.to(F64), s_ref)
    torch.manual_seed(24)
    gy, gs = torch.randn_like(y_ref), torch.randn_like(s_ref)
    ((y.to(F64) * gy).sum() + (s.to(F64) * gs).sum()).backward()
    ((y_ref * gy).sum() + (s_ref * gs).sum()).backward()
    for name, leaf in tri_in.items():
        assert leaf.grad.dtype == leaf.dtype and not leaf.grad.isnan().any(), name
        assert rel_err(leaf.grad, ref_in[name].grad) <= 1e-2, (name, rel_err(leaf.grad, ref_in[name].grad))
