"""Triton chunk_delta_rule on packed documents (``cu_seqlens``) against the float64 reference's
packed form (each document alone, joined): outputs, per-document final states and every gradient
(q, k, v, log_a, beta, the per-document initial states, and through the final states).

Each document has its own chunk grid inside the kernels (no padding), so the documents are of
length 1, exactly a chunk, a chunk + 1 and several chunks (its last one partial), packed so that
documents start in the middle of the chunk grid a padded layout would have. On CPU the kernels
run under TRITON_INTERPRET=1 (tests/conftest.py) with NaN-poisoned output buffers; the tests
marked gpu run at real shapes (T 8192, log-normal document lengths of median ~600)::

    python -m pytest -q -m gpu tests/kernels/triton/test_delta_rule_varlen.py
"""

from __future__ import annotations

import math

import pytest
import torch

from hybridzoo.kernels import chunk_delta_rule as chunk_delta_rule_api
from hybridzoo.kernels.reference.delta_rule import chunk_delta_rule as reference
from hybridzoo.kernels.triton import VARLEN_OPS, launch
from hybridzoo.kernels.triton import delta_rule as triton_delta_rule
from hybridzoo.utils import rel_err

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NAMES = ("q", "k", "v", "log_a", "beta", "initial_state")


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    monkeypatch.setattr(launch, "POISON_OUTPUTS", True)


def cu_of(lengths) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)


def make_packed(lengths, Hk=1, H=2, K=16, V=24, decay=True, state=True, dtype=torch.float32, seed=0):
    """Random inputs ``[1, total, ...]`` of documents of ``lengths``: L2-normalised keys, β in
    (0, 1), log decays in [-0.5, 0) with ``-inf`` (a reset) at the first token of the second
    document, initial states ``[N, H, K, V]``."""
    g = torch.Generator().manual_seed(seed)
    T, N = sum(lengths), len(lengths)
    q = torch.randn(1, T, Hk, K, generator=g)
    k = torch.nn.functional.normalize(torch.randn(1, T, Hk, K, generator=g), dim=-1)
    v = torch.randn(1, T, H, V, generator=g)
    log_a = -0.5 * torch.rand(1, T, H, generator=g) if decay else None
    if log_a is not None and N > 1:
        log_a[0, lengths[0], 0] = float("-inf")
    beta = torch.rand(1, T, H, generator=g)
    s0 = torch.randn(N, H, K, V, generator=g) if state else None
    cast = {"q": dtype, "k": dtype, "v": dtype, "beta": dtype}
    return {name: (None if x is None else x.to(DEVICE, cast.get(name, torch.float32)))
            for name, x in zip(NAMES, (q, k, v, log_a, beta, s0))}


def run(fn, inputs, cu, *, dtype=None, chunk_size=16, grad_o=None, grad_s=None):
    """Forward + backward of ``fn`` on leaf copies of ``inputs`` (cast to ``dtype`` when given):
    ``(o, final_states, {name: grad})`` of ``<o, dO> + <final_states, dS>``."""
    leaves = {n: (None if x is None else x.detach().to(dtype or x.dtype).requires_grad_())
              for n, x in inputs.items()}
    o, s = fn(leaves["q"], leaves["k"], leaves["v"], leaves["log_a"], leaves["beta"],
              initial_state=leaves["initial_state"], output_final_state=True, chunk_size=chunk_size,
              cu_seqlens=cu)
    ((o.double() * grad_o).sum() + (s.double() * grad_s).sum()).backward()
    grads = {n: (torch.zeros_like(x) if x.grad is None else x.grad) for n, x in leaves.items() if x is not None}
    return o, s, grads


def check(inputs, lengths, *, chunk_size=16, tol=1e-5, grad_tol=None):
    """The Triton op against the float64 reference (same values, both packed) on the outputs,
    the final states and every gradient; returns the relative errors."""
    grad_tol = tol if grad_tol is None else grad_tol
    cu = cu_of(lengths)
    torch.manual_seed(1)
    _, T, H, V = inputs["v"].shape
    K = inputs["q"].shape[-1]
    grad_o = torch.randn(1, T, H, V, dtype=torch.float64, device=DEVICE)
    grad_s = torch.randn(len(lengths), H, K, V, dtype=torch.float64, device=DEVICE)
    o, s, grads = run(triton_delta_rule.chunk_delta_rule, inputs, cu, chunk_size=chunk_size,
                      grad_o=grad_o, grad_s=grad_s)
    o_ref, s_ref, grads_ref = run(reference, inputs, cu, dtype=torch.float64, chunk_size=64,
                                  grad_o=grad_o, grad_s=grad_s)
    assert o.dtype == inputs["v"].dtype and o.shape == o_ref.shape
    assert s.dtype == torch.float32 and s.shape == (len(lengths), H, K, V)
    errors = {"o": rel_err(o, o_ref), "final_state": rel_err(s, s_ref)}
    for name in grads_ref:
        assert grads[name].dtype == inputs[name].dtype and grads[name].shape == grads_ref[name].shape, name
        errors["d" + name] = rel_err(grads[name], grads_ref[name])
    bad = {n: e for n, e in errors.items() if not e <= (tol if n in ("o", "final_state") else grad_tol)}
    assert not bad, f"errors above tolerance: {bad} (all: {errors})"
    return errors


# ----------------------------------------------------------------------------- interpreter / CPU

# chunk 16: a 1-token document, exactly a chunk, a chunk + 1, three chunks (the last of 1 token);
# the documents start at tokens 0, 1, 17 and 34, never on a multiple of 16
LENGTHS = [1, 16, 17, 33]


@pytest.mark.parametrize("decay", [True, False], ids=["decay", "no-decay"])
def test_packed_matches_reference(decay):
    """Grouped heads (Hk 1 serves H 2), per-document initial states, a reset at a document's
    first token (decay): every output and gradient within 1e-5 of float64."""
    check(make_packed(LENGTHS, decay=decay, seed=int(decay)), LENGTHS)


def test_packed_whole_state_kernels_no_initial_state(monkeypatch):
    """The whole-state sequential kernels (SPLIT_STATE off) on packed documents, no initial
    state (zeros for every document), the documents in another order, two key heads."""
    from hybridzoo.kernels.triton import delta_rule_common

    monkeypatch.setattr(delta_rule_common, "SPLIT_STATE", False)
    lengths = [17, 1, 16]
    check(make_packed(lengths, Hk=2, H=2, K=16, V=16, state=False, seed=5), lengths)


def test_packed_is_not_the_unpacked_row():
    """The packed call differs from the same tokens run as one sequence (the documents' states
    really are separated), and equals the reference through the public dispatcher
    (``chunk_delta_rule`` is in the triton backend's VARLEN_OPS)."""
    assert "chunk_delta_rule" in VARLEN_OPS
    lengths = [3, 2]
    x = make_packed(lengths, H=1, K=16, V=16, decay=False, seed=7)  # (no reset at document 1's start)
    args = [x[n] for n in NAMES[:3]] + [None, x["beta"]]
    o, s = chunk_delta_rule_api(*args, initial_state=x["initial_state"], output_final_state=True,
                                cu_seqlens=cu_of(lengths), backend="triton", chunk_size=16)
    o_ref, s_ref = reference(*(a if a is None else a.double() for a in args), initial_state=x["initial_state"].double(),
                             output_final_state=True, cu_seqlens=cu_of(lengths))
    assert rel_err(o, o_ref) <= 1e-5 and rel_err(s, s_ref) <= 1e-5
    whole, _ = reference(*(a if a is None else a.double() for a in args), initial_state=x["initial_state"][:1].double())
    assert rel_err(o, whole) > 1e-2


def test_packed_errors():
    """Bad packed calls fail with one clear ValueError before any kernel runs."""
    x = make_packed([3, 2], H=2, K=16, V=16)
    args = [x[n] for n in NAMES[:5]]
    with pytest.raises(ValueError, match="batch dimension must be 1"):
        triton_delta_rule.chunk_delta_rule(*(a.expand(2, *a.shape[1:]) for a in args), cu_seqlens=cu_of([3, 2]))
    with pytest.raises(ValueError, match="one per document"):
        triton_delta_rule.chunk_delta_rule(*args, initial_state=x["initial_state"][:1], cu_seqlens=cu_of([3, 2]))
    with pytest.raises(ValueError, match="must end at the packed length 5"):
        triton_delta_rule.chunk_delta_rule(*args, cu_seqlens=cu_of([3, 3]))
    with pytest.raises(ValueError, match="strictly increasing"):
        triton_delta_rule.chunk_delta_rule(*args, cu_seqlens=torch.tensor([0, 0, 5], dtype=torch.int32))


def test_packed_in_bounds():
    """Every unmasked address of every kernel, forward and backward, inside the launch's tensors
    (:mod:`.bounds`), the last document ending in a partial chunk at the end of the row."""
    import os

    from tests.kernels.triton.bounds import bounds_checked

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("address checks need TRITON_INTERPRET=1 (set by the test suite's conftest)")
    lengths = [17, 2]
    x = {n: (None if t is None else t.detach().requires_grad_()) for n, t in
         make_packed(lengths, K=16, V=16, dtype=torch.float16, seed=3).items()}
    with bounds_checked() as report:
        o, s = triton_delta_rule.chunk_delta_rule(*(x[n] for n in NAMES[:5]), initial_state=x["initial_state"],
                                                  output_final_state=True, chunk_size=16, cu_seqlens=cu_of(lengths))
        (o.float().square().sum() + s.square().sum()).backward()
    assert all(x[n].grad is not None for n in NAMES)
    assert report.launches > 0 and report.violations == [], report.violations


def test_chunk_grid():
    """Each document's own chunk grid: (document, chunk) of every chunk and each document's first."""
    cu, indices, offsets = triton_delta_rule.chunk_grid(cu_of(LENGTHS), 16)
    assert indices.tolist() == [[0, 0], [1, 0], [2, 0], [2, 1], [3, 0], [3, 1], [3, 2]]
    assert offsets.tolist() == [0, 1, 2, 4, 7] and cu.dtype == indices.dtype == offsets.dtype == torch.int32


def test_chunk_grid_is_remembered_until_cu_seqlens_changes():
    """The grid of one cu_seqlens tensor is built once (it reads the chunk count on the host, a
    device sync on CUDA), and built again after the tensor is modified in place."""
    cu = cu_of([3, 20])
    first = triton_delta_rule.chunk_grid(cu, 16)
    assert triton_delta_rule.chunk_grid(cu, 16) is first
    assert triton_delta_rule.chunk_grid(cu, 32) is not first
    cu[1] = 5  # documents of 5 and 18 tokens
    again = triton_delta_rule.chunk_grid(cu, 16)
    assert again is not first and again[1].tolist() == [[0, 0], [1, 0], [1, 1]]


# ----------------------------------------------------------------------------- GPU, real shapes


def lognormal_lengths(total: int, median: float, seed: int) -> list[int]:
    """Document lengths drawn log-normal (``median``, sigma 1), at least 1, the last one cut so
    that they add up to ``total``."""
    g = torch.Generator().manual_seed(seed)
    lengths = []
    while sum(lengths) < total:
        n = max(1, int(median * math.exp(torch.randn(1, generator=g).item())))
        lengths.append(min(n, total - sum(lengths)))
    return lengths


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("Hk, H, K, V", [(16, 16, 128, 128), (6, 6, 128, 256), (2, 4, 64, 64)],
                         ids=["qwen35-0.8b", "gated-deltanet-340m", "grouped-64"])
def test_gpu_packed_real_shapes(Hk, H, K, V, dtype):
    """T 8192 packed from log-normal document lengths (median ~600; a 1-token, a 64-token and a
    65-token document added at the front), chunk 64, with per-document initial states: outputs,
    final states and every gradient vs the float64 reference (fp32 <= 1e-4, bf16 <= 1e-2)."""
    T = 8192
    lengths = [1, 64, 65]
    lengths += lognormal_lengths(T - sum(lengths), 600, seed=K + V + H)
    inputs = make_packed(lengths, Hk=Hk, H=H, K=K, V=V, dtype=dtype, seed=H)
    inputs["log_a"] = inputs["log_a"] * 0.1  # slow decays: each document's state carries far
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    errors = check(inputs, lengths, chunk_size=64, tol=tol)
    print(f"\n{dtype} H{H} K{K} V{V}, {len(lengths)} documents: "
          + ", ".join(f"{n} {e:.1e}" for n, e in errors.items()))
