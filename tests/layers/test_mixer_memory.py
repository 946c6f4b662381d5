"""What the Mamba mixers keep for the backward, and that keeping less changes no gradient.

Budgets are mamba_ssm's fused training paths, written from the shapes (bytes per token, bf16
autocast, 2 bytes per bf16 element, 4 per float32):

* Mamba-2, ``mamba_split_conv1d_scan_combined`` (out_proj inside, norm output recomputed):
  in_proj's bf16 input ``2·d_model`` + its output ``zxbcdt`` ``2·(2·d_inner + 2GN + H)`` + the SSD
  output ``out_x`` ``2·d_inner`` + the norm's float32 ``rstd`` ``4·G``.
* Mamba-1, ``mamba_inner_fn`` (checkpoint_lvl 1: conv output and Δ recomputed): in_proj's input
  ``2·d_model`` + ``xz`` ``2·2·d_inner`` + ``x_dbl`` ``2·(R + 2N)`` + contiguous B, C ``2·2N`` + the
  scan output ``2·d_inner`` (out_proj's input) + the scan's float32 chunk states, ``2N`` per channel
  every 2048 tokens.

Measured (hybridzoo.memory.saved_tensors) as the growth of the saved bytes from T to 2T, divided by
the added tokens, so that weight casts and carried states (no per-token size) drop out.
"""

from __future__ import annotations

import pytest
import torch

import hybridzoo.layers.recompute as recompute_module
from hybridzoo.layers.mamba1 import Mamba1, Mamba1Config
from hybridzoo.layers.mamba2 import Mamba2, Mamba2Config
from hybridzoo.layers.recompute import recomputed, wants_recompute
from hybridzoo.layers.norms import GatedRMSNorm, RMSNorm
from hybridzoo.layers.state import RecurrentState
from hybridzoo.memory import saved_bytes_per_token as saved_bytes_per_token_of, saved_tensors
from hybridzoo.utils import rel_err

BATCH, LENGTH, D_MODEL = 1, 8, 16


def build(kind: str, backend: str, keep_scan_states: bool = True):
    if kind == "mamba2":
        return Mamba2(D_MODEL, Mamba2Config(d_state=8, head_dim=8, n_groups=2, chunk_size=16), backend=backend)
    return Mamba1(D_MODEL, Mamba1Config(d_state=4, keep_scan_states=keep_scan_states), backend=backend)


def mamba_ssm_budget(mixer) -> float:
    """Bytes per token mamba_ssm's fused path keeps at this mixer's shape (bf16 autocast)."""
    d_model, d_inner, N = mixer.d_model, mixer.d_inner, mixer.d_state
    if isinstance(mixer, Mamba2):
        G, H = mixer.n_groups, mixer.n_heads
        return 2 * d_model + 2 * (2 * d_inner + 2 * G * N + H) + 2 * d_inner + 4 * G
    R = mixer.dt_rank
    return (2 * d_model + 2 * 2 * d_inner + 2 * (R + 2 * N) + 2 * 2 * N + 2 * d_inner
            + 4 * 2 * N * d_inner / 2048)


def saved_bytes_per_token(mixer) -> float:
    torch.manual_seed(0)
    inputs = {T: torch.randn(BATCH, T, D_MODEL, requires_grad=True) for T in (LENGTH, 2 * LENGTH)}

    def run(length):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return mixer(inputs[length])

    # the given input is left out like a parameter: only what the layer adds counts
    return saved_bytes_per_token_of(run, LENGTH, BATCH, parameters=[*mixer.parameters(), *inputs.values()])


def kept_scan_state_bytes(mixer, backend: str) -> float:
    """Bytes per token a recomputed Mamba-1 mixer keeps so that its backward skips the scan's
    forward (``Mamba1Config.keep_scan_states``): with the Triton backend one float32 state ``[d_inner, N]`` per
    time block of the scan's backward (BWD_BLOCK_T tokens, at most 8 under the interpreter); none otherwise."""
    import importlib

    triton_scan = importlib.import_module("hybridzoo.kernels.triton.selective_scan")

    if not isinstance(mixer, Mamba1) or backend != "triton" or not mixer.config.keep_scan_states:
        return 0.0
    return 4 * mixer.d_inner * mixer.d_state / triton_scan._config(training=True)["bwd_block_t"]


@pytest.mark.parametrize("keep_scan_states", [True, False])
@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("kind", ["mamba1", "mamba2"])
def test_saved_bytes_per_token_within_mamba_ssm_budget(kind, backend, keep_scan_states):
    """The layer input x is fp32 here (counted apart, as a parameter-like given): the budget counts
    in_proj's bf16 copy of it, as mamba_ssm's does. Mamba-1 on the Triton backend may keep its
    scan's block states on top (:func:`kept_scan_state_bytes`); without them it is within
    mamba_ssm's budget itself."""
    torch.manual_seed(0)
    mixer = build(kind, backend, keep_scan_states)
    measured = saved_bytes_per_token(mixer)
    budget = mamba_ssm_budget(mixer) + kept_scan_state_bytes(mixer, backend)
    assert measured <= budget, f"{kind} ({backend}): {measured} bytes per token saved, budget {budget}"
    # and not far below what must be kept (in_proj's input and output, out_proj's input): the
    # measurement sees the tensors at all
    floor = 2 * D_MODEL + 2 * mixer.in_proj.out_features + 2 * mixer.d_inner
    assert measured >= floor, (measured, floor)


def grads(mixer, x, state, lean: bool, monkeypatch):
    """Output, final state and the gradients of x, every parameter and the initial state."""
    calls = []

    def counted(body, *tensors, **options):
        calls.append(body)
        return recomputed(body, *tensors, **options)

    monkeypatch.setattr(recompute_module, "wants_recompute", wants_recompute if lean else (lambda *t: False))
    monkeypatch.setattr(recompute_module, "recomputed", counted)
    mixer.zero_grad()
    x = x.detach().clone().requires_grad_(True)
    state = RecurrentState(kind=state.kind, recurrent=state.recurrent.detach().clone().requires_grad_(True),
                           conv=state.conv.detach().clone().requires_grad_(True), offset=state.offset)
    y, final = mixer(x, state)
    torch.manual_seed(1)
    loss = ((y * torch.randn_like(y)).sum() + (final.recurrent * torch.randn_like(final.recurrent)).sum()
            + (final.conv * torch.randn_like(final.conv)).sum())
    loss.backward()
    assert bool(calls) == lean, "the recomputing path was (not) taken"
    named = {"x": x.grad, "state.recurrent": state.recurrent.grad, "state.conv": state.conv.grad}
    named.update({name: p.grad for name, p in mixer.named_parameters()})
    return y.detach(), named


@pytest.mark.parametrize("kind, keep_scan_states", [("mamba1", True), ("mamba1", False), ("mamba2", True)])
def test_recomputing_path_has_the_plain_gradients_float64(kind, keep_scan_states, monkeypatch):
    """Mamba-1 whether it keeps its scan's saved states or recomputes them."""
    torch.manual_seed(0)
    mixer = build(kind, "reference", keep_scan_states).double()
    x = torch.randn(BATCH, 21, D_MODEL, dtype=torch.float64)
    shapes = mixer.expected_state(BATCH, torch.float64)
    state = RecurrentState(kind=kind, recurrent=torch.randn(shapes["recurrent"][0], dtype=torch.float64),
                           conv=torch.randn(shapes["conv"][0], dtype=torch.float64), offset=3)
    y_plain, plain = grads(mixer, x, state, False, monkeypatch)
    y_lean, lean = grads(mixer, x, state, True, monkeypatch)
    assert rel_err(y_lean, y_plain) <= 1e-10
    assert set(lean) == set(plain)
    for name in plain:
        assert plain[name] is not None and lean[name] is not None, name
        assert rel_err(lean[name], plain[name]) <= 1e-10, name


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["mamba1", "mamba2"])
def test_recomputing_path_under_autocast_on_the_triton_kernels(kind, monkeypatch):
    """The backward's recomputation re-enters the forward's bf16 autocast: same gradients."""
    torch.manual_seed(0)
    mixer = build(kind, "triton")
    x = torch.randn(1, 6, D_MODEL)
    shapes = mixer.expected_state(1, torch.bfloat16)
    state = RecurrentState(kind=kind, recurrent=torch.randn(shapes["recurrent"][0]),
                           conv=torch.randn(shapes["conv"][0]).to(torch.bfloat16), offset=0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, plain = grads(mixer, x, state, False, monkeypatch)
        _, lean = grads(mixer, x, state, True, monkeypatch)
    for name in plain:
        assert rel_err(lean[name], plain[name]) <= 1e-6, name


def test_saved_tensors_counts_a_storage_once_and_names_its_saver():
    a = torch.randn(4, 8, requires_grad=True)
    b = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)

    def forward():
        c = a.to(torch.float64)          # a float64 copy, saved by the mul below
        return (c * b).sum() + (c[:2] * b[:2]).sum()

    rows = saved_tensors(forward, parameters=[a])
    activations = [r for r in rows if not r.parameter]
    assert sorted(r.nbytes for r in activations) == [4 * 8 * 8, 4 * 8 * 8]  # c and b once each (the views too)
    assert all("MulBackward0" in r.owners for r in activations)


@pytest.mark.parametrize("zero_centered", [False, True])
def test_rms_norm_keeps_only_its_input(zero_centered, monkeypatch):
    """The blocks' RMSNorm keeps its float32 input (``4·d`` bytes per token, what mamba_ssm's fused
    add-norm keeps with its float32 residual, less its 4-byte rstd) and recomputes the rest, with
    the plain gradients in float64."""
    norm = RMSNorm(D_MODEL, zero_centered=zero_centered)
    with torch.no_grad():
        norm.weight.normal_()

    def saved(length):
        x = torch.randn(BATCH, length, D_MODEL, requires_grad=True)

        def forward():
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return norm(x * 1.0)  # x * 1.0: an activation, not the given leaf

        return sum(r.nbytes for r in saved_tensors(forward, list(norm.parameters())) if not r.parameter)

    assert (saved(2 * LENGTH) - saved(LENGTH)) / (BATCH * LENGTH) <= 4 * D_MODEL + 4  # x and a float32 rstd
    norm.double()
    x = torch.randn(BATCH, LENGTH, D_MODEL, dtype=torch.float64)
    w = (1.0 + norm.weight if zero_centered else norm.weight).detach().clone().requires_grad_(True)
    xl, xf = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    probe = torch.linspace(-1, 1, D_MODEL, dtype=torch.float64)
    (norm(xl) * probe).sum().backward()
    ((xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + norm.eps) * w) * probe).sum().backward()  # the formula
    assert rel_err(xl.grad, xf.grad) <= 1e-10 and rel_err(norm.weight.grad, w.grad) <= 1e-10


@pytest.mark.parametrize("norm_before_gate", [True, False])
def test_gated_rms_norm_keeps_only_its_inputs(norm_before_gate, monkeypatch):
    """The gated norm after GLA / RetNet / Gated DeltaNet keeps its bf16 inputs x and z (``2·2·d``
    bytes per token under autocast, as fla's fused gated norm) where it kept five float32 tensors,
    and has the plain gradients in float64."""
    norm = GatedRMSNorm(D_MODEL, group_size=D_MODEL // 2, norm_before_gate=norm_before_gate)
    with torch.no_grad():
        norm.weight.normal_()

    def saved(length):
        x = torch.randn(BATCH, length, D_MODEL, requires_grad=True)
        z = torch.randn(BATCH, length, D_MODEL, requires_grad=True)

        def forward():
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return norm(x.bfloat16() * 1.0, z.bfloat16() * 1.0)  # bf16 activations, as a kernel's output

        return sum(r.nbytes for r in saved_tensors(forward, list(norm.parameters())) if not r.parameter)

    assert (saved(2 * LENGTH) - saved(LENGTH)) / (BATCH * LENGTH) <= 2 * 2 * D_MODEL
    norm.double()
    x, z = torch.randn(2, BATCH, LENGTH, D_MODEL, dtype=torch.float64)
    results = {}
    for lean in (False, True):
        monkeypatch.setattr(recompute_module, "wants_recompute", wants_recompute if lean else (lambda *t: False))
        norm.zero_grad()
        xl, zl = x.clone().requires_grad_(True), z.clone().requires_grad_(True)
        (norm(xl, zl) * torch.linspace(-1, 1, D_MODEL, dtype=torch.float64)).sum().backward()
        results[lean] = (xl.grad, zl.grad, norm.weight.grad.clone())
    for plain, lean in zip(results[False], results[True]):
        assert rel_err(lean, plain) <= 1e-10


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_chunk_linear_attn_grads_match_autograd_of_the_op(backend):
    """The backward without a forward (what Mamba-2's kept scan output uses) against autograd
    through the op itself: two value heads per key head, a scalar decay, an initial state, a
    ragged chunk, gradients from both outputs."""
    from hybridzoo.kernels import chunk_linear_attn, chunk_linear_attn_grads

    torch.manual_seed(0)
    q, k = torch.randn(2, 1, 20, 1, 8).unbind(0)
    v = torch.randn(1, 20, 2, 8)
    log_a = -torch.rand(1, 20, 2)
    h0 = torch.randn(1, 2, 8, 8)
    do, dfinal = torch.randn(1, 20, 2, 8), torch.randn(1, 2, 8, 8)
    inputs = [t.clone().requires_grad_(True) for t in (q, k, v, log_a, h0)]
    o, final = chunk_linear_attn(*inputs[:4], scale=0.5, initial_state=inputs[4], output_final_state=True,
                                 chunk_size=16, backend=backend)
    expected = torch.autograd.grad([o, final], inputs, [do, dfinal])
    got = chunk_linear_attn_grads(q, k, v, log_a, h0, do, dfinal, scale=0.5, chunk_size=16, backend=backend)
    for name, g, e in zip(("q", "k", "v", "log_a", "initial_state"), got, expected):
        assert g.dtype == e.dtype and rel_err(g, e) <= 1e-6, name


def test_gated_deltanet_keeps_no_float32_copy_of_q_and_k(monkeypatch):
    """Gated DeltaNet normalises q and k in float32 and hands them to the kernel in bf16: the
    backward keeps q and k as given, not their float32 copies (recomputed), with the plain
    gradients in float64."""
    from hybridzoo.layers.gated_deltanet import GatedDeltaNet, GatedDeltaNetConfig

    config = GatedDeltaNetConfig(num_k_heads=2, num_v_heads=2, head_k_dim=16, head_v_dim=16, chunk_size=16)
    mixer = GatedDeltaNet(D_MODEL, config, backend="reference")
    x = torch.randn(BATCH, LENGTH, D_MODEL, requires_grad=True)

    def forward():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return mixer(x * 1.0)[0]

    qk_shape = (BATCH, LENGTH, 2, 16)
    kept = [r for r in saved_tensors(forward, list(mixer.parameters()))
            if not r.parameter and r.dtype == torch.float32 and tuple(r.shape) == qk_shape]
    assert kept == [], kept
    mixer.double()
    xd = torch.randn(BATCH, LENGTH, D_MODEL, dtype=torch.float64)
    results = {}
    for lean in (False, True):
        monkeypatch.setattr(recompute_module, "wants_recompute", wants_recompute if lean else (lambda *t: False))
        mixer.zero_grad()
        xl = xd.clone().requires_grad_(True)
        (mixer(xl)[0] * torch.linspace(-1, 1, D_MODEL, dtype=torch.float64)).sum().backward()
        results[lean] = [xl.grad] + [p.grad.clone() for p in mixer.parameters()]
    for plain, lean in zip(results[False], results[True]):
        assert rel_err(lean, plain) <= 1e-10
