"""Triton selective scan (Mamba-1) against the reference.

CPU (``TRITON_INTERPRET=1``): tiny shapes, float32 kernels against the float64 step loop, every
gradient (u, delta, A, B, C, D, z, delta_bias, initial_state, and through final_state).
GPU (``@pytest.mark.gpu``): real shapes, bf16 and fp32 inputs, against the float32 reference;
outputs poisoned with NaN first so that an unwritten element fails.
"""

from __future__ import annotations

import pytest
import torch
import triton

from hybridzoo.kernels import selective_scan as selective_scan_op
from hybridzoo.kernels.reference import selective_scan as reference_scan
from hybridzoo.kernels.reference import selective_scan_loop
from hybridzoo.kernels.triton import launch
from hybridzoo.kernels.triton.selective_scan import selective_scan, selective_scan_grads, selective_scan_saved
from hybridzoo.utils import rel_err
from tests.kernels.triton.tuning import tuning_rounds

F64 = torch.float64
NAMES = ("u", "delta", "A", "B", "C", "D", "z", "delta_bias", "initial_state")


def _inputs(batch=2, length=19, dm=12, n=3, groups=None, seed=0, dtype=F64, device="cpu", mamba_init=False):
    """groups=None: B, C are [B, T, N]; an int G: [B, T, G, N]."""
    torch.manual_seed(seed)
    bc = (batch, length, n) if groups is None else (batch, length, groups, n)
    x = dict(
        u=torch.randn(batch, length, dm),
        delta=torch.randn(batch, length, dm),
        A=-torch.rand(dm, n) - 0.1,
        B=torch.randn(bc),
        C=torch.randn(bc),
        D=torch.randn(dm),
        z=torch.randn(batch, length, dm),
        delta_bias=torch.randn(dm),
        initial_state=torch.randn(batch, dm, n),
    )
    if mamba_init:  # Mamba's ranges: A = -(1..N), small step sizes after softplus
        x["A"] = -torch.arange(1, n + 1, dtype=torch.float32).repeat(dm, 1)
        x["delta"] = 0.5 * x["delta"] - 4.0
        x["delta_bias"] = 0.5 * x["delta_bias"]
    return {k: v.to(device=device, dtype=dtype) for k, v in x.items()}


def _run(fn, x, softplus=True, **kwargs):
    return fn(x["u"], x["delta"], x["A"], x["B"], x["C"], x["D"], x["z"], x["delta_bias"], softplus,
              x["initial_state"], True, **kwargs)


def _leaves(x, dtype=None):
    return {k: (None if v is None else v.detach().to(dtype or v.dtype).requires_grad_()) for k, v in x.items()}


def _check_against_loop(x, softplus=True, tol=1e-5, weights=(1.0, 1.0)):
    """Triton in float32 vs the float64 step loop: outputs, final state, every gradient."""
    ref_in, tri_in = _leaves(x), _leaves(x, torch.float32)
    y_ref, h_ref = _run(selective_scan_loop, ref_in, softplus)
    y, h = _run(selective_scan, tri_in, softplus)
    assert y.dtype == torch.float32 and h.dtype == torch.float32
    assert rel_err(y, y_ref) <= tol
    assert rel_err(h, h_ref) <= tol
    torch.manual_seed(1)
    gy, gh = torch.randn_like(y_ref) * weights[0], torch.randn_like(h_ref) * weights[1]
    ((y_ref * gy).sum() + (h_ref * gh).sum()).backward()
    ((y * gy.float()).sum() + (h * gh.float()).sum()).backward()
    for name in NAMES:
        if ref_in[name] is None:
            continue
        assert tri_in[name].grad is not None, name
        assert rel_err(tri_in[name].grad, ref_in[name].grad) <= tol, name


@pytest.mark.parametrize("groups,length", [(None, 19), (1, 5), (2, 16), (2, 19), (None, 16)])
def test_matches_loop(groups, length):
    """Ragged T (19 = 2 blocks of 8 + 3), T below one block, T a multiple of the block."""
    _check_against_loop(_inputs(length=length, groups=groups, seed=length))


@pytest.mark.parametrize("softplus", [False, True])
def test_without_optional_inputs(softplus):
    """D, z, delta_bias and initial_state all None (delta kept positive without softplus)."""
    x = _inputs(length=13, dm=6, n=5, groups=2, seed=3)
    x.update(D=None, z=None, delta_bias=None, initial_state=None)
    if not softplus:
        x["delta"] = x["delta"].abs()
    _check_against_loop(x, softplus=softplus)


def test_gradient_only_through_final_state():
    """The loss reads only the final state: dy is None in the backward."""
    x = _inputs(length=11, seed=4)
    ref_in, tri_in = _leaves(x), _leaves(x, torch.float32)
    _, h_ref = _run(selective_scan_loop, ref_in)
    _, h = _run(selective_scan, tri_in)
    torch.manual_seed(2)
    gh = torch.randn_like(h_ref)
    (h_ref * gh).sum().backward()
    (h * gh.float()).sum().backward()
    for name in NAMES:  # D and z do not reach the state: no reference gradient, ours must be 0
        ref = ref_in[name].grad
        assert rel_err(tri_in[name].grad, torch.zeros_like(ref_in[name]) if ref is None else ref) <= 1e-5, name


def test_gradient_only_through_output():
    _check_against_loop(_inputs(length=11, groups=2, seed=5), weights=(1.0, 0.0))


def test_large_steps_no_nan():
    """Δ far beyond softplus's linear threshold (decays underflow to 0): finite, correct."""
    x = _inputs(length=10, seed=6)
    x["delta"] = x["delta"] * 30.0
    _check_against_loop(x)


@pytest.mark.parametrize("segments", [2, 3])
@pytest.mark.parametrize("groups,length", [(None, 41), (2, 40), (1, 5)])
def test_time_segments_match_loop(monkeypatch, segments, groups, length):
    """A grid run in time segments side by side, each starting from the state folded from the
    segments before it (forward) and the adjoint folded from those after it (backward), against
    the float64 loop: outputs, final state and every gradient, with the loss through both, the
    output alone or the final state alone. Interpreter blocks are 8 tokens: 41 tokens are 6
    blocks (2 segments of 3 or 3 of 2), 40 tokens 5 (3 + 2, or 2 + 2 + 1), 5 tokens one. Every
    buffer starts as NaN: an unwritten element shows."""
    import importlib

    monkeypatch.setattr(launch, "POISON_OUTPUTS", True)
    monkeypatch.setattr(importlib.import_module("hybridzoo.kernels.triton.selective_scan"), "SEGMENTS", segments)
    x = _inputs(length=length, groups=groups, seed=length + segments)
    for weights in ((1.0, 1.0), (1.0, 0.0), (0.0, 1.0)):
        _check_against_loop(x, weights=weights)


@pytest.mark.parametrize("bwd_block_t,prefetch", [(2, False), (4, False), (4, True), (8, True), (8, False)])
@pytest.mark.parametrize("groups,length,segments", [(None, 19, 1), (2, 16, 1), (1, 5, 1), (2, 41, 3)])
def test_backward_blocks_shorter_than_the_forwards_match_loop(monkeypatch, bwd_block_t, prefetch, groups,
                                                              length, segments):
    """BWD_BLOCK_T below the forward's block (8 under the interpreter): the forward stores the
    state entering every ``bwd_block_t`` tokens, the state after the token before each later
    sub-block of its own blocks, and the backward restarts from each. Against the float64 loop,
    every buffer NaN first (an unwritten saved state shows), ragged T, a T under one block, and
    time segments (41 tokens: forward segments of 8-token blocks, backward ones of shorter).
    ``prefetch``: each block's inputs loaded during the block after it (BWD_PREFETCH forced),
    also at the forward's own block (8)."""
    import importlib

    scan = importlib.import_module("hybridzoo.kernels.triton.selective_scan")
    monkeypatch.setattr(launch, "POISON_OUTPUTS", True)
    monkeypatch.setattr(scan, "BWD_BLOCK_T", bwd_block_t)
    monkeypatch.setattr(scan, "BWD_PREFETCH", prefetch)
    monkeypatch.setattr(scan, "SEGMENTS", segments)
    x = _inputs(length=length, groups=groups, seed=length + bwd_block_t)
    for weights in ((1.0, 1.0), (1.0, 0.0)):
        _check_against_loop(x, weights=weights)
    f32 = {k: v.float() for k, v in x.items()}
    _, _, saved = selective_scan_saved(*[f32[k] for k in NAMES[:8]], True, f32["initial_state"])
    assert saved.shape == (2, -(-length // bwd_block_t), 12, 3)
    for i, t0 in enumerate(range(0, length, bwd_block_t)):  # the state entering token t0: the loop's final
        head = {k: v[:, :t0] if k in ("u", "delta", "z", "B", "C") else v for k, v in x.items()}  # over [0, t0)
        expected = x["initial_state"] if t0 == 0 else _run(selective_scan_loop, head)[1]
        assert rel_err(saved[:, i], expected) <= 1e-5, i


def test_backward_block_must_be_a_power_of_two(monkeypatch):
    import importlib

    scan = importlib.import_module("hybridzoo.kernels.triton.selective_scan")
    for bad in (1, 3, 6):
        monkeypatch.setattr(scan, "BWD_BLOCK_T", bad)
        with pytest.raises(ValueError, match="BWD_BLOCK_T must be a power of two"):
            scan._config(True)


def test_time_segments_without_optional_inputs(monkeypatch):
    """Segments with D, z, delta_bias and the initial state all None, no softplus."""
    import importlib

    monkeypatch.setattr(importlib.import_module("hybridzoo.kernels.triton.selective_scan"), "SEGMENTS", 3)
    x = _inputs(length=37, dm=6, n=5, groups=2, seed=31)
    x.update(D=None, z=None, delta_bias=None, initial_state=None)
    x["delta"] = x["delta"].abs()
    _check_against_loop(x, softplus=False)


def test_time_segments_without_a_graph(monkeypatch):
    """An inference forward (no per-block states stored) in 3 segments, against the float64 loop."""
    import importlib

    monkeypatch.setattr(importlib.import_module("hybridzoo.kernels.triton.selective_scan"), "SEGMENTS", 3)
    x = _inputs(length=45, groups=2, seed=7)
    with torch.no_grad():
        y, h = _run(selective_scan, {k: v.float() for k, v in x.items()})
    y_ref, h_ref = _run(selective_scan_loop, x)
    assert rel_err(y, y_ref) <= 1e-5 and rel_err(h, h_ref) <= 1e-5


def test_time_segments_split_the_blocks(monkeypatch):
    """Whole sequences by default (time segments measured slower on an H200); a forced count
    splits the time blocks into that many segments, fewer where the blocks do not fill them."""
    import importlib

    scan = importlib.import_module("hybridzoo.kernels.triton.selective_scan")
    assert scan._segments(512) == (1, 512)
    monkeypatch.setattr(scan, "SEGMENTS", 3)
    assert scan._segments(512) == (3, 171)  # 171 + 171 + 170 blocks
    monkeypatch.setattr(scan, "SEGMENTS", 4)
    assert scan._segments(10) == (4, 3)  # 3 + 3 + 3 + 1 blocks
    assert scan._segments(3) == (3, 1)
    monkeypatch.setattr(scan, "SEGMENTS", 5)
    assert scan._segments(8) == (4, 2)  # 5 segments of 2 blocks would leave one empty


def test_state_carrying():
    """Two calls with the final state carried equal one call."""
    x = _inputs(length=21, seed=7, dtype=torch.float32)
    y, h = _run(selective_scan, x)
    first = {k: (v[:, :9] if k in ("u", "delta", "z", "B", "C") else v) for k, v in x.items()}
    second = {k: (v[:, 9:] if k in ("u", "delta", "z", "B", "C") else v) for k, v in x.items()}
    y1, h1 = _run(selective_scan, first)
    second["initial_state"] = h1
    y2, h2 = _run(selective_scan, second)
    assert rel_err(torch.cat([y1, y2], dim=1), y) <= 1e-6
    assert rel_err(h2, h) <= 1e-6


def test_poisoned_outputs(monkeypatch):
    """Every buffer the kernels should overwrite starts as NaN: none may survive."""
    monkeypatch.setattr(launch, "POISON_OUTPUTS", True)
    _check_against_loop(_inputs(length=19, dm=11, groups=None, seed=8))  # dm=11: ragged channel block


def test_dispatch_and_errors():
    x = _inputs(length=7, dtype=torch.float32)
    y, h = _run(lambda *a: selective_scan_op(*a, backend="triton"), x)
    y_ref, h_ref = _run(reference_scan, x)
    assert rel_err(y, y_ref) <= 1e-5 and rel_err(h, h_ref) <= 1e-5
    with pytest.raises(ValueError, match="backend='reference'"):
        _run(selective_scan, _inputs(length=4))  # float64
    bad = _inputs(length=4, dtype=torch.float32)
    bad["A"] = bad["A"][:, :2]
    with pytest.raises(ValueError, match="B must be"):
        _run(selective_scan, bad)
    # T = 0: empty output, the initial state passes through
    empty = _inputs(length=0, dtype=torch.float32)
    y0, h0 = _run(selective_scan, empty)
    assert y0.shape == (2, 0, 12) and torch.equal(h0, empty["initial_state"])


@pytest.mark.parametrize("groups,with_state", [(None, True), (2, False)])
def test_saved_forward_and_its_grads_match_the_float64_loop(groups, with_state):
    """selective_scan_saved then selective_scan_grads (a kept output's backward, no second
    forward) give the op's output, final state and every gradient, against the float64 loop;
    through the dispatching ops too. Ragged T (19 = 2 blocks of 8 + 3)."""
    from hybridzoo.kernels import selective_scan_grads as grads_op, selective_scan_saved as saved_op

    x = _inputs(length=19, groups=groups, seed=11)
    if not with_state:
        x["initial_state"] = None
    ref_in = _leaves(x)
    y_ref, h_ref = _run(selective_scan_loop, ref_in)
    torch.manual_seed(3)
    gy, gh = torch.randn_like(y_ref), torch.randn_like(h_ref)
    ((y_ref * gy).sum() + (h_ref * gh).sum()).backward()
    f32 = {k: None if v is None else v.float() for k, v in x.items()}
    args = [f32[k] for k in NAMES[:8]]
    for saved_fn, grads_fn in ((selective_scan_saved, selective_scan_grads),
                               (lambda *a: saved_op(*a, backend="triton"),
                                lambda *a, **k: grads_op(*a, **k, backend="triton"))):
        y, h, saved = saved_fn(*args, True, f32["initial_state"])
        assert saved.shape == (2, 3, 12, 3) and saved.dtype == torch.float32  # one state a block of 8
        assert rel_err(y, y_ref) <= 1e-5 and rel_err(h, h_ref) <= 1e-5
        kwargs = {"delta_softplus": True}
        grads = grads_fn(*args, f32["initial_state"], saved, gy.float(), gh.float(), **kwargs)
        assert len(grads) == len(NAMES)
        for name, g in zip(NAMES, grads):
            if ref_in[name] is None:
                assert g is None, name
                continue
            assert g.shape == x[name].shape, name
            assert rel_err(g, ref_in[name].grad) <= 1e-5, name


@pytest.mark.parametrize("groups", [None, 2])
def test_gate_and_b_c_columns_of_wider_tensors_are_read_in_place(groups):
    """z as Mamba-1 passes it (channels ``[Dm, 2·Dm)`` of a ``[B, T, 2·Dm + 3]`` tensor) and B, C
    as the columns of ``x_proj``'s output (``[B, T, 5 + 2·G·N]``). The op reads them in place (no
    copy), gives the float64 loop's output and every gradient, the wide tensors' other columns
    getting none, and bitwise the output and gradients of contiguous copies."""
    from hybridzoo.kernels.triton.selective_scan import _prepared

    x = _inputs(length=19, groups=groups, seed=31)
    batch, length, dm = x["u"].shape
    bc_shape, width = x["B"].shape, x["B"][0, 0].numel()
    torch.manual_seed(32)
    wide_z = torch.randn(batch, length, 2 * dm + 3, dtype=F64)
    wide_z[..., dm:2 * dm] = x["z"]
    dbl = torch.randn(batch, length, 5 + 2 * width, dtype=F64)
    dbl[..., 5:5 + width] = x["B"].reshape(batch, length, width)
    dbl[..., 5 + width:] = x["C"].reshape(batch, length, width)
    wide_z, dbl = wide_z.float().requires_grad_(), dbl.float().requires_grad_()
    z, B, C = wide_z[..., dm:2 * dm], dbl[..., 5:5 + width].reshape(bc_shape), dbl[..., 5 + width:].reshape(bc_shape)
    rest = _leaves({k: v for k, v in x.items() if k not in ("z", "B", "C")}, torch.float32)
    args = dict(rest, z=z, B=B, C=C)
    prepared = _prepared(*(args[k] for k in NAMES), "selective_scan")
    assert not z.is_contiguous() and not B.is_contiguous()
    assert (prepared[6].data_ptr(), prepared[3].data_ptr(), prepared[4].data_ptr()) == (
        z.data_ptr(), B.data_ptr(), C.data_ptr())
    ref_in = _leaves(x)
    y_ref, h_ref = _run(selective_scan_loop, ref_in)
    y, h = _run(selective_scan, args)
    assert rel_err(y, y_ref) <= 1e-5 and rel_err(h, h_ref) <= 1e-5
    torch.manual_seed(33)
    gy, gh = torch.randn_like(y_ref), torch.randn_like(h_ref)
    ((y_ref * gy).sum() + (h_ref * gh).sum()).backward()
    ((y * gy.float()).sum() + (h * gh.float()).sum()).backward()
    assert rel_err(wide_z.grad[..., dm:2 * dm], ref_in["z"].grad) <= 1e-5
    assert rel_err(dbl.grad[..., 5:5 + width].reshape(bc_shape), ref_in["B"].grad) <= 1e-5
    assert rel_err(dbl.grad[..., 5 + width:].reshape(bc_shape), ref_in["C"].grad) <= 1e-5
    assert not wide_z.grad[..., :dm].any() and not wide_z.grad[..., 2 * dm:].any() and not dbl.grad[..., :5].any()
    for name, leaf in rest.items():
        assert rel_err(leaf.grad, ref_in[name].grad) <= 1e-5, name
    # contiguous copies: bitwise the same output and gradients
    copies = {k: v.detach().contiguous().requires_grad_() for k, v in (("z", z), ("B", B), ("C", C))}
    dense = _leaves({k: v for k, v in rest.items()})
    y2, h2 = _run(selective_scan, dict(dense, **copies))
    assert torch.equal(y2, y) and torch.equal(h2, h)
    ((y2 * gy.float()).sum() + (h2 * gh.float()).sum()).backward()
    assert torch.equal(copies["z"].grad, wide_z.grad[..., dm:2 * dm])
    assert torch.equal(copies["B"].grad.reshape(batch, length, width), dbl.grad[..., 5:5 + width])
    assert torch.equal(copies["C"].grad.reshape(batch, length, width), dbl.grad[..., 5 + width:])
    for name in rest:
        assert torch.equal(dense[name].grad, rest[name].grad), name


def test_b_and_c_of_different_strides_are_copied_and_still_match():
    """B read in place but C not evenly spaced (tokens of a sequence far apart): both are copied
    (one stride serves both), and the op still gives the float64 loop's output."""
    from hybridzoo.kernels.triton.selective_scan import _prepared

    x = _inputs(length=9, seed=34)
    f32 = {k: v.float() for k, v in x.items()}
    wide = torch.randn(2, 9, 7)
    wide[..., 2:5] = f32["B"]
    B = wide[..., 2:5]
    C = f32["C"].transpose(0, 1).contiguous().transpose(0, 1)
    args = dict(f32, B=B, C=C)
    prepared = _prepared(*(args[k] for k in NAMES), "selective_scan")
    assert prepared[3].data_ptr() != B.data_ptr() and prepared[3].is_contiguous() and prepared[4].is_contiguous()
    y_ref, h_ref = _run(selective_scan_loop, x)
    y, h = _run(selective_scan, args)
    assert rel_err(y, y_ref) <= 1e-5 and rel_err(h, h_ref) <= 1e-5


def test_grads_write_dz_where_asked():
    """selective_scan_grads' ``dz_out``: z's gradient goes into the given slice of a wider tensor
    (bitwise the gradient it returns otherwise), the slice itself is returned, the tensor's other
    columns are left as they were, and every other gradient is unchanged. A buffer of another
    shape or dtype, one whose tokens are not evenly spaced, or one without z is refused."""
    x = {k: v.float() for k, v in _inputs(length=19, seed=35).items()}
    args = [x[k] for k in NAMES[:8]]
    y, h, saved = selective_scan_saved(*args, True, x["initial_state"])
    torch.manual_seed(36)
    gy, gh = torch.randn_like(y), torch.randn_like(h)
    plain = selective_scan_grads(*args, x["initial_state"], saved, gy, gh, True)
    dm = x["z"].shape[-1]
    wide = torch.full((2, 19, 2 * dm), 7.0)
    into = selective_scan_grads(*args, x["initial_state"], saved, gy, gh, True, dz_out=wide[..., dm:])
    assert into[6].data_ptr() == wide[..., dm:].data_ptr()
    assert torch.equal(wide[..., dm:], plain[6]) and bool((wide[..., :dm] == 7.0).all())
    for name, a, b in zip(NAMES, plain, into):
        assert torch.equal(a, b), name
    for bad in (torch.empty(2, 19, dm, dtype=torch.float64), torch.empty(2, 19, dm + 1),
                torch.empty(19, 2, dm).transpose(0, 1)):
        with pytest.raises(ValueError, match="dz_out"):
            selective_scan_grads(*args, x["initial_state"], saved, gy, gh, True, dz_out=bad)
    args[6] = None
    with pytest.raises(ValueError, match="dz_out"):
        selective_scan_grads(*args, x["initial_state"], saved, gy, gh, True, dz_out=wide[..., dm:])


def test_grads_refuse_saved_states_of_another_shape():
    x = {k: v.float() for k, v in _inputs(length=19).items()}
    args = [x[k] for k in NAMES[:8]]
    _, _, saved = selective_scan_saved(*args, True, x["initial_state"])
    with pytest.raises(ValueError, match="saved block states"):
        selective_scan_grads(*args, x["initial_state"], saved[:, :2], torch.ones_like(x["u"]), None, True)


def test_saved_forward_on_another_backend_keeps_nothing_and_its_grads_rerun_the_op():
    """The reference backend's saved is empty; its grads come from the op run again, float64."""
    from hybridzoo.kernels import selective_scan_grads as grads_op, selective_scan_saved as saved_op

    x = _inputs(length=9, seed=12)
    args = [x[k] for k in NAMES[:8]]
    y, h, saved = saved_op(*args, True, x["initial_state"], backend="reference")
    assert saved.numel() == 0 and not y.requires_grad
    ref_in = _leaves(x)
    y_ref, h_ref = _run(selective_scan_loop, ref_in)
    gy = torch.randn_like(y_ref)
    (y_ref * gy).sum().backward()
    grads = grads_op(*args, x["initial_state"], saved, gy, None, delta_softplus=True, backend="reference")
    for name, g in zip(NAMES, grads):
        assert rel_err(g, ref_in[name].grad) <= 1e-10, name


# ---------------------------------------------------------------- GPU, real shapes


def _poison(monkeypatch):
    monkeypatch.setattr(launch, "POISON_OUTPUTS", True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 1e-2), (torch.float32, 1e-4)])
def test_gpu_forward_full_shape(monkeypatch, dtype, tol):
    """B2 T16384 D2048 N16 (mamba_ssm's benchmark shape), z, D, softplus, initial state."""
    _poison(monkeypatch)
    x = _inputs(batch=2, length=16384, dm=2048, n=16, seed=10, dtype=dtype, device="cuda", mamba_init=True)
    x["A"] = x["A"].float()
    x["initial_state"] = x["initial_state"].float()
    with torch.no_grad():
        y, h = _run(selective_scan, x)
        assert y.dtype == dtype and h.dtype == torch.float32
        assert not y.isnan().any() and not h.isnan().any()
        y_ref, h_ref = _run(reference_scan, {k: v.float() for k, v in x.items()}, chunk_size=256)
    assert rel_err(y, y_ref) <= tol
    assert rel_err(h, h_ref) <= tol


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 1e-2), (torch.float32, 1e-4)])
@pytest.mark.parametrize("length,dm,groups", [(16384, 256, None), (4099, 512, 4)])
def test_gpu_gradients(monkeypatch, dtype, tol, length, dm, groups):
    """Every gradient at long T against autograd of the float32 reference (all channels, so
    dB and dC, sums over channels, are checked too)."""
    _poison(monkeypatch)
    x = _inputs(batch=2, length=length, dm=dm, n=16, groups=groups, seed=11, dtype=dtype, device="cuda",
                mamba_init=True)
    x["A"] = x["A"].float()
    x["initial_state"] = x["initial_state"].float()
    tri_in = _leaves(x)
    ref_in = _leaves(x, torch.float32)
    y, h = _run(selective_scan, tri_in)
    y_ref, h_ref = _run(reference_scan, ref_in, chunk_size=128)
    assert rel_err(y, y_ref) <= tol and rel_err(h, h_ref) <= tol
    torch.manual_seed(12)
    gy, gh = torch.randn_like(y_ref), torch.randn_like(h_ref)
    ((y.float() * gy).sum() + (h * gh).sum()).backward()
    ((y_ref * gy).sum() + (h_ref * gh).sum()).backward()
    for name in NAMES:
        grad = tri_in[name].grad
        assert grad is not None and grad.dtype == tri_in[name].dtype, name
        assert not grad.isnan().any(), name
        assert rel_err(grad, ref_in[name].grad) <= tol, name


@pytest.mark.gpu
@pytest.mark.parametrize("segments", [2, 5])
def test_gpu_forced_segments(monkeypatch, segments):
    """Time segments forced (they are off by default) at B2 T4099 D512 N16, 4 groups: forward,
    final state and every gradient in bf16 against the float32 reference, as above."""
    import importlib

    monkeypatch.setattr(importlib.import_module("hybridzoo.kernels.triton.selective_scan"), "SEGMENTS", segments)
    test_gpu_gradients(monkeypatch, torch.bfloat16, 1e-2, 4099, 512, 4)


@pytest.mark.gpu
@pytest.mark.parametrize("bwd_block_t,prefetch", [(4, False), (8, False), (8, True), (16, False), (16, True)])
def test_gpu_backward_blocks_shorter_than_the_forwards(monkeypatch, bwd_block_t, prefetch):
    """BWD_BLOCK_T at or below the forward's 16, with the backward's inputs loaded a block ahead
    (BWD_PREFETCH forced) or not, with autotuning as a user runs it, at B2 T4099 D512 N16, 4
    groups: forward, final state and every gradient in bf16 against the float32 reference."""
    import importlib

    scan = importlib.import_module("hybridzoo.kernels.triton.selective_scan")
    monkeypatch.setattr(scan, "BWD_BLOCK_T", bwd_block_t)
    monkeypatch.setattr(scan, "BWD_PREFETCH", prefetch)
    test_gpu_gradients(monkeypatch, torch.bfloat16, 1e-2, 4099, 512, 4)


@pytest.mark.gpu
def test_gpu_full_shape_backward_no_nan(monkeypatch):
    """The full benchmark shape through forward and backward in bf16: every gradient finite;
    the channel-local gradients of the first 128 channels against the reference run on them."""
    _poison(monkeypatch)
    x = _inputs(batch=2, length=16384, dm=2048, n=16, seed=13, dtype=torch.bfloat16, device="cuda", mamba_init=True)
    x["A"] = x["A"].float()
    x["initial_state"] = x["initial_state"].float()
    tri_in = _leaves(x)
    y, h = _run(selective_scan, tri_in)
    torch.manual_seed(14)
    gy, gh = torch.randn(y.shape, device="cuda"), torch.randn(h.shape, device="cuda")
    ((y.float() * gy).sum() + (h * gh).sum()).backward()
    for name in NAMES:
        assert torch.isfinite(tri_in[name].grad.float()).all(), name
    cut = 128
    sliced = {k: v.float() for k, v in x.items()}
    for k in ("u", "delta", "z"):
        sliced[k] = sliced[k][..., :cut]
    for k in ("A", "D", "delta_bias"):
        sliced[k] = sliced[k][:cut]
    sliced["initial_state"] = sliced["initial_state"][:, :cut]
    ref_in = _leaves(sliced)
    y_ref, h_ref = _run(reference_scan, ref_in, chunk_size=128)
    ((y_ref * gy[..., :cut]).sum() + (h_ref * gh[:, :cut]).sum()).backward()
    assert rel_err(y[..., :cut], y_ref) <= 1e-2
    for name, part in (("u", (Ellipsis, slice(0, cut))), ("delta", (Ellipsis, slice(0, cut))),
                       ("z", (Ellipsis, slice(0, cut))), ("A", slice(0, cut)), ("D", slice(0, cut)),
                       ("delta_bias", slice(0, cut)), ("initial_state", (slice(None), slice(0, cut)))):
        assert rel_err(tri_in[name].grad[part], ref_in[name].grad) <= 1e-2, name


@pytest.mark.gpu
@pytest.mark.parametrize("n", [16, 64])
@pytest.mark.parametrize("autotune", [False, True], ids=["each-setting", "autotuner"])
def test_gpu_every_launch_setting(monkeypatch, autotune, n):
    """Each forward and backward setting the autotuner may pick (i-th of each together), and the
    autotuner itself (its trials must not add to dB / dC twice), bf16, all gradients; at d_state
    16 and 64 (where the autotuner keeps the narrow tiles)."""
    import importlib

    scan = importlib.import_module("hybridzoo.kernels.triton.selective_scan")
    _poison(monkeypatch)
    configs_of = {scan._fwd: scan.FWD_CONFIGS, scan._bwd: scan.BWD_CONFIGS}
    for i in tuning_rounds(monkeypatch, configs_of, each=not autotune):
        x = _inputs(batch=2, length=999, dm=96, n=n, groups=2, seed=15, dtype=torch.bfloat16, device="cuda",
                    mamba_init=True)
        x["A"] = x["A"].float()
        x["initial_state"] = x["initial_state"].float()
        tri_in, ref_in = _leaves(x), _leaves(x, torch.float32)
        y, h = _run(selective_scan, tri_in)
        y_ref, h_ref = _run(reference_scan, ref_in, chunk_size=128)
        assert rel_err(y, y_ref) <= 1e-2 and rel_err(h, h_ref) <= 1e-2, i
        gy, gh = torch.randn_like(y_ref), torch.randn_like(h_ref)
        ((y.float() * gy).sum() + (h * gh).sum()).backward()
        ((y_ref * gy).sum() + (h_ref * gh).sum()).backward()
        for name in NAMES:
            assert rel_err(tri_in[name].grad, ref_in[name].grad) <= 1e-2, (name, i)


@pytest.mark.gpu
def test_gpu_auto_dispatch_picks_triton():
    x = _inputs(length=64, dm=64, n=16, dtype=torch.float32, device="cuda")
    y, h = _run(lambda *a: selective_scan_op(*a, backend="auto"), x)
    y_t, h_t = _run(selective_scan, x)
    assert torch.equal(y, y_t) and torch.equal(h, h_t)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_half_precision_inputs_match_the_float64_loop(dtype):
    """fp16 / bf16 inputs under the interpreter (A and the initial state stay float32, as in a
    Mamba layer): output in the input dtype, float32 final state, every gradient in its input's
    dtype; all within 1e-2 of the float64 step loop run on the same (rounded) inputs."""
    x = _inputs(length=19, dm=12, n=3, groups=2, seed=21, dtype=dtype, mamba_init=True)
    x["A"], x["initial_state"] = x["A"].float(), x["initial_state"].float()
    tri_in, ref_in = _leaves(x), _leaves(x, F64)
    y, h = _run(selective_scan, tri_in)
    y_ref, h_ref = _run(selective_scan_loop, ref_in)
    assert y.dtype == dtype and h.dtype == torch.float32
    assert not y.isnan().any() and rel_err(y, y_ref) <= 1e-2 and rel_err(h, h_ref) <= 1e-2
    torch.manual_seed(22)
    gy, gh = torch.randn_like(y_ref), torch.randn_like(h_ref)
    ((y.to(F64) * gy).sum() + (h.to(F64) * gh).sum()).backward()
    ((y_ref * gy).sum() + (h_ref * gh).sum()).backward()
    for name in NAMES:
        grad = tri_in[name].grad
        assert grad is not None and grad.dtype == tri_in[name].dtype and not grad.isnan().any(), name
        assert rel_err(grad, ref_in[name].grad) <= 1e-2, (name, rel_err(grad, ref_in[name].grad))


def test_launch_settings_keep_wide_states_in_registers(monkeypatch):
    """The selective scan's launch settings (no GPU needed): up to d_state 16 the measured fixed
    settings and the autotuner's first candidates of each kernel stand; for a wider state every
    fixed setting and every candidate the autotuner keeps puts at most 64 (forward) / 32
    (backward) tile elements on a thread, where the N = 16 settings would put 128 and more at
    N = 64 (they spilled kilobytes per thread on sm_90), and the candidates are never empty."""
    import importlib

    scan = importlib.import_module("hybridzoo.kernels.triton.selective_scan")
    monkeypatch.setattr(scan.launch, "interpret", lambda: False)  # the GPU settings, not the interpreter's
    pairs = lambda configs: [(c.kwargs["BLOCK_D"], c.num_warps) for c in configs]  # noqa: E731
    for n in (2, 4, 8, 16):
        assert scan._config(True, n) == dict(block_t=16, bwd_block_t=8, fwd_block_d=8, fwd_warps=1, fwd_stages=2,
                                             bwd_block_d=4, bwd_warps=1, bwd_prefetch=None)
        assert scan._config(False, n) == dict(block_t=32, fwd_block_d=16, fwd_warps=8, fwd_stages=1)
    for kind, configs, count in (("fwd", scan.FWD_CONFIGS, 5), ("bwd", scan.BWD_CONFIGS, 5)):
        kept = scan._fitting(configs, 16, 16, scan.TILE_PER_THREAD[kind])
        assert pairs(kept) == pairs(configs[:count])
    assert [c.maxnreg for c in scan.BWD_CONFIGS[:2]] == [None, scan.BWD_MAXNREG]
    for n in (32, 64, 128, 256, 1024):
        for training in (True, False):
            cfg = scan._config(training, n)
            for kind in ("fwd", "bwd") if training else ("fwd",):
                block_t = cfg["bwd_block_t" if kind == "bwd" else "block_t"]
                load = scan._per_thread(block_t, cfg[f"{kind}_block_d"], n, cfg[f"{kind}_warps"])
                configs = scan.FWD_CONFIGS if kind == "fwd" else scan.BWD_CONFIGS
                least = min(scan._per_thread(block_t, c.kwargs["BLOCK_D"], n, c.num_warps) for c in configs)
                assert load <= scan.TILE_PER_THREAD[kind][1] or load == least, (n, training, kind, load)
        for kind, configs in (("fwd", scan.FWD_CONFIGS), ("bwd", scan.BWD_CONFIGS)):
            prune = scan._prune(kind)
            kept = prune(configs, {}, BLOCK_T=16, BLOCK_N=n)
            assert kept, (n, kind)
            loads = [scan._per_thread(16, c.kwargs["BLOCK_D"], n, c.num_warps) for c in kept]
            assert all(x <= scan.TILE_PER_THREAD[kind][1] for x in loads) or len(kept) == 1, (n, kind, loads)
    assert scan._per_thread(16, 4, 64, 1) == 128  # the N = 16 backward setting at N = 64
    assert pairs(scan._prune("bwd")(scan.BWD_CONFIGS, {}, BLOCK_T=16, BLOCK_N=64)) == [(2, 8), (4, 8)]
    # 8-token blocks: the capped candidate is the uncapped one (167 registers), tuned once
    at8 = scan._prune("bwd")(scan.BWD_CONFIGS, {}, BLOCK_T=8, BLOCK_N=16)
    assert pairs(at8) == [(4, 1), (8, 2), (16, 4), (32, 8)] and not any(c.maxnreg for c in at8)
    assert len(scan._prune("bwd")(scan.BWD_CONFIGS, {}, BLOCK_T=16, BLOCK_N=16)) == 5


def test_backward_register_cap_and_prefetch_follow_the_grid(monkeypatch):
    """With autotuning off, the backward's settings follow its grid (on an H200's 132 SMs; the
    launch is captured, not run: no GPU needed). In 8-token blocks (the default) it loads each
    block's inputs a block ahead where the grid fills less than BWD_PREFETCH_WAVES waves of 12
    programs per SM (B2 D1536: 768 programs, B2 D2048: 1024), not where it fills more (B8 D1536:
    3072), never for a wider state or another tile, and as BWD_PREFETCH forces it; no register cap.
    In 16-token blocks (BWD_BLOCK_T = 16) the 4-wide 1-warp tile runs capped at BWD_MAXNREG
    registers where the grid fills at least BWD_CAP_WAVES waves of 8 programs per SM, uncapped
    below, never for a wider state or another setting, and as given where the settings name a cap
    (0: none); it never prefetches unless forced."""
    import importlib

    scan = importlib.import_module("hybridzoo.kernels.triton.selective_scan")
    monkeypatch.setattr(scan.launch, "interpret", lambda: False)
    monkeypatch.setattr(scan.launch, "sm_count", lambda device: 132)
    launches = []
    monkeypatch.setattr(scan.launch, "run",
                        lambda kernel, grid, *args, fixed, **consts: launches.append(dict(fixed, **consts)))

    def launch(batch, dm, n=16, cfg=None):
        if cfg is not None:
            monkeypatch.setattr(scan, "_config", lambda training, block_n=16: cfg)
        bt = scan._config(True, n)["bwd_block_t"]
        u = torch.zeros(batch, 16, dm)
        A, B = torch.zeros(dm, n), torch.zeros(batch, 16, 1, n)
        ckpt = torch.zeros(batch, 16 // bt, dm, n)
        scan._backward(u, u, A, B, B, None, None, None, True, ckpt, u, None, None)
        return launches[-1].get("maxnreg"), launches[-1]["PREFETCH"], launches[-1]["BLOCK_T"]

    assert launch(2, 1536) == (None, True, 8) and launch(2, 2048) == (None, True, 8)
    assert launch(8, 1536) == (None, False, 8)
    assert launch(2, 1536, n=64) == (None, False, 8)  # another tile at N = 64
    monkeypatch.setattr(scan, "BWD_PREFETCH", True)
    assert launch(8, 1536) == (None, True, 8)
    monkeypatch.setattr(scan, "BWD_PREFETCH", False)
    assert launch(2, 1536) == (None, False, 8)
    monkeypatch.setattr(scan, "BWD_PREFETCH", None)
    monkeypatch.setattr(scan, "BWD_BLOCK_T", 16)
    assert launch(8, 1536) == (scan.BWD_MAXNREG, False, 16) and launch(2, 2048) == (None, False, 16)
    assert launch(8, 1536, n=64)[0] is None
    base = dict(block_t=16, bwd_block_t=16, fwd_block_d=8, fwd_warps=1, fwd_stages=2, bwd_block_d=4, bwd_warps=1,
                bwd_prefetch=None)
    assert launch(8, 1536, cfg=dict(base, bwd_block_d=8, bwd_warps=2))[0] is None
    assert launch(8, 1536, cfg=dict(base, bwd_maxnreg=0))[0] is None
    assert launch(2, 2048, cfg=dict(base, bwd_maxnreg=168))[0] == 168
    assert launch(2, 1536, cfg=dict(base, bwd_block_t=8, bwd_block_d=8, bwd_warps=2))[1] is False


@pytest.mark.parametrize("dt_given", [True, False], ids=["dt-given", "dt-in-loop"])
@pytest.mark.parametrize("softplus,bias", [(True, True), (True, False), (False, True)])
def test_step_sizes_computed_once_or_in_the_loop_match_loop(monkeypatch, dt_given, softplus, bias):
    """The training forward and the backward read Δ from a buffer computed before them
    (FWD_DT_GIVEN, BWD_DT_GIVEN: the default) or compute it in their loops, with and without the
    softplus and delta_bias; both against the float64 loop, outputs poisoned (an unwritten element
    fails), with block-ahead loads too."""
    import importlib

    scan = importlib.import_module("hybridzoo.kernels.triton.selective_scan")
    monkeypatch.setattr(scan, "BWD_DT_GIVEN", dt_given)
    monkeypatch.setattr(scan, "FWD_DT_GIVEN", dt_given)
    monkeypatch.setattr(scan, "BWD_PREFETCH", True)
    monkeypatch.setattr(launch, "POISON_OUTPUTS", True)
    x = _inputs(length=21, groups=2, seed=7)
    if not bias:
        x["delta_bias"] = None
    if not softplus:
        x["delta"] = x["delta"].abs()
        x["delta_bias"] = x["delta_bias"].abs()
    _check_against_loop(x, softplus=softplus)


def test_step_size_kernel_is_the_softplus_of_delta_plus_bias(monkeypatch):
    """``_dt_kernel`` in float32 against torch's softplus in float64 (identity above 20, as torch's
    default threshold), with and without the bias, ragged rows and channels, and delta as given
    without the softplus; the buffer is poisoned first."""
    import importlib

    scan = importlib.import_module("hybridzoo.kernels.triton.selective_scan")
    monkeypatch.setattr(launch, "POISON_OUTPUTS", True)
    torch.manual_seed(0)
    rows, dm = 37, 150
    delta = torch.randn(rows, dm, dtype=F64) * 8
    delta[0, :5] = torch.tensor([25.0, 19.5, -30.0, 0.0, 1e-9])
    bias = torch.randn(dm, dtype=F64)
    delta, bias = delta.float().double(), bias.float().double()  # the float32 inputs, exactly
    for softplus in (True, False):
        for b in (bias, None):
            out = launch.empty((rows, dm), torch.float32, delta.device)
            launch.run(scan._dt_kernel, (triton.cdiv(rows, 8), triton.cdiv(dm, 64)), delta.float(),
                       (delta if b is None else b).float(), out, rows, dm, HAS_BIAS=b is not None,
                       SOFTPLUS=softplus, BLOCK_R=8, BLOCK_D=64, fixed=dict(num_warps=4))
            raw = delta + (0 if b is None else b)
            expected = torch.nn.functional.softplus(raw) if softplus else raw
            assert out.dtype == torch.float32 and out.isfinite().all()
            assert torch.allclose(out.double(), expected, rtol=2e-6, atol=0), (softplus, b is None)


def test_step_size_kernel_runs_where_the_scan_needs_a_softplus_or_a_bias(monkeypatch):
    """With BWD_DT_GIVEN, Δ is computed before the backward exactly where delta needs the
    softplus or the bias (and the backward is told so); plain delta is read as it is. The same
    for the training forward with FWD_DT_GIVEN; an inference forward computes Δ in its loop."""
    import importlib

    scan = importlib.import_module("hybridzoo.kernels.triton.selective_scan")
    launches = []
    monkeypatch.setattr(scan.launch, "run",
                        lambda kernel, grid, *args, fixed, **consts: launches.append((kernel, consts)))
    u = torch.zeros(2, 16, 8)
    A, B = torch.zeros(8, 4), torch.zeros(2, 16, 1, 4)
    ckpt = torch.zeros(2, 16 // scan._config(True, 4)["bwd_block_t"], 8, 4)
    for softplus, bias, given in ((True, None, True), (False, torch.zeros(8), True), (False, None, False)):
        launches.clear()
        scan._backward(u, u, A, B, B, None, None, bias, softplus, ckpt, u, None, None)
        kernels = [k for k, _ in launches]
        assert (scan._dt_kernel in kernels) == given and launches[-1][1]["DT_GIVEN"] is given
    monkeypatch.setattr(scan, "BWD_DT_GIVEN", False)
    launches.clear()
    scan._backward(u, u, A, B, B, None, None, None, True, ckpt, u, None, None)
    assert [k for k, _ in launches] == [scan._bwd] and launches[-1][1]["DT_GIVEN"] is False
    # the forward: in training (states kept for the backward) as FWD_DT_GIVEN says, never in inference
    monkeypatch.setattr(scan, "FWD_DT_GIVEN", True)
    for store, given in ((True, True), (False, False)):
        launches.clear()
        scan._forward(u, u, A, B, B, None, None, None, True, None, store)
        assert ([k for k, _ in launches] == [scan._dt_kernel, scan._fwd]) == given
        assert launches[-1][1]["DT_GIVEN"] is given
    monkeypatch.setattr(scan, "FWD_DT_GIVEN", False)
    launches.clear()
    scan._forward(u, u, A, B, B, None, None, None, True, None, True)
    assert [k for k, _ in launches] == [scan._fwd] and launches[-1][1]["DT_GIVEN"] is False
