"""hybridzoo.kernels.varlen (the packed-documents helpers) and the dispatcher's VARLEN_OPS gate."""

from __future__ import annotations

import pytest
import torch

from hybridzoo.kernels import BackendUnavailable, attention, chunk_delta_rule, chunk_linear_attn
from hybridzoo.kernels import _dispatch
from hybridzoo.kernels.varlen import (
    check_cu_seqlens,
    cu_seqlens_from_position_ids,
    prepare_chunk_indices,
    seq_idx_from_cu_seqlens,
)


def test_check_cu_seqlens_accepts_and_converts():
    cu = torch.tensor([0, 2, 7], dtype=torch.int64)
    out = check_cu_seqlens(cu, 7)
    assert out.dtype == torch.int32 and out.tolist() == [0, 2, 7]
    cu32 = torch.tensor([0, 7], dtype=torch.int32)
    assert check_cu_seqlens(cu32, 7) is cu32  # nothing to convert: no copy


@pytest.mark.parametrize("cu,total,message", [
    ([0, 2, 7], 8, "must end at the packed length 8"),
    ([1, 2, 7], 7, "must start at 0"),
    ([0, 3, 3, 7], 7, "document 1 has length 0"),
    ([0, 5, 3, 7], 7, "document 1 has length -2"),
    ([0], 0, r"N >= 1 documents"),
])
def test_check_cu_seqlens_refuses_with_a_clear_error(cu, total, message):
    with pytest.raises(ValueError, match=message):
        check_cu_seqlens(torch.tensor(cu, dtype=torch.int32), total)


def test_check_cu_seqlens_refuses_dtype_shape_and_type():
    with pytest.raises(ValueError, match="int32"):
        check_cu_seqlens(torch.tensor([0.0, 3.0]), 3)
    with pytest.raises(ValueError, match="1-D"):
        check_cu_seqlens(torch.tensor([[0, 3]], dtype=torch.int32), 3)
    with pytest.raises(ValueError, match="torch.Tensor"):
        check_cu_seqlens([0, 3], 3)


def test_check_cu_seqlens_checks_again_after_an_in_place_change():
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    check_cu_seqlens(cu, 5)
    cu[1] = 0  # the remembered validation must not hide the new, empty first document
    with pytest.raises(ValueError, match="document 0 has length 0"):
        check_cu_seqlens(cu, 5)
    with pytest.raises(ValueError, match="end at the packed length 6"):
        check_cu_seqlens(torch.tensor([0, 2, 5], dtype=torch.int32), 6)


def test_seq_idx():
    cu = torch.tensor([0, 1, 4, 6], dtype=torch.int32)
    idx = seq_idx_from_cu_seqlens(cu, 6)
    assert idx.dtype == torch.int32 and idx.tolist() == [0, 1, 1, 1, 2, 2]


def test_cu_seqlens_from_position_ids():
    pos = torch.tensor([[0, 1, 2, 0, 0, 1, 2, 3]])
    cu = cu_seqlens_from_position_ids(pos)
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 3, 4, 8]
    assert cu_seqlens_from_position_ids(torch.arange(5)).tolist() == [0, 5]


@pytest.mark.parametrize("pos,message", [
    ([[1, 2, 3]], "position 0 holds 1"),
    ([[0, 1, 3]], "position 2 holds 3"),
    ([[0, 1], [0, 1]], r"one packed row \[1, T\]"),
])
def test_cu_seqlens_from_position_ids_refuses(pos, message):
    with pytest.raises(ValueError, match=message):
        cu_seqlens_from_position_ids(torch.tensor(pos))


def test_prepare_chunk_indices_walks_each_document_in_its_own_grid():
    lengths = [1, 4, 5, 11, 2]
    cu = torch.tensor([0, 1, 5, 10, 21, 23], dtype=torch.int32)
    idx = prepare_chunk_indices(cu, 4)
    assert idx.dtype == torch.int32 and idx.shape[1] == 2
    expected = [(n, c) for n, length in enumerate(lengths) for c in range(-(-length // 4))]
    assert [tuple(r) for r in idx.tolist()] == expected
    # every token lies in exactly one chunk, and no chunk crosses a boundary
    covered = []
    for n, c in idx.tolist():
        start = int(cu[n]) + 4 * c
        covered += list(range(start, min(int(cu[n + 1]), start + 4)))
    assert covered == list(range(23))


@pytest.mark.gpu  # importing fla takes seconds on a CPU
def test_prepare_chunk_indices_matches_fla():
    fla_utils = pytest.importorskip("fla.ops.utils.index")
    cu = torch.tensor([0, 1, 5, 10, 21, 23, 90], dtype=torch.int32)
    for chunk in (1, 4, 16, 64):
        ours = prepare_chunk_indices(cu, chunk)
        theirs = fla_utils.prepare_chunk_indices(cu.long(), chunk)
        assert ours.tolist() == theirs.tolist()


def test_every_backend_declares_its_varlen_ops():
    from hybridzoo.kernels import reference
    from hybridzoo.kernels.backends import torch_sdpa

    assert reference.VARLEN_OPS == set(reference.OPS)
    assert torch_sdpa.VARLEN_OPS == {"attention"}
    assert set(_dispatch.varlen_backends("causal_conv1d")) >= {"reference"}


def test_a_backend_without_varlen_for_the_op_is_refused(monkeypatch):
    import hybridzoo.kernels.triton as triton_backend

    monkeypatch.setattr(triton_backend, "VARLEN_OPS", set())
    cu = torch.tensor([0, 2, 4], dtype=torch.int32)
    q = torch.randn(1, 4, 1, 4)
    with pytest.raises(BackendUnavailable, match=r"backend 'triton' has no packed-documents \(cu_seqlens\) path "
                                                 r"for chunk_delta_rule; pass backend='reference'"):
        chunk_delta_rule(q, q, q, None, q[..., 0], cu_seqlens=cu, backend="triton")
    # the same backend, unpacked, is still resolved (no cu_seqlens: no gate)
    assert _dispatch.resolve("chunk_delta_rule", "triton", q.device) is not None


def test_auto_refuses_rather_than_falls_back_silently(monkeypatch):
    import hybridzoo.kernels.triton as triton_backend

    monkeypatch.setattr(triton_backend, "VARLEN_OPS", set())
    monkeypatch.setattr(_dispatch, "_auto_backend", lambda op, device: "triton")
    with pytest.raises(BackendUnavailable, match=r"backend='auto' picked 'triton' for chunk_linear_attn"):
        _dispatch.resolve("chunk_linear_attn", "auto", torch.device("cpu"), varlen=True)
    monkeypatch.setattr(triton_backend, "VARLEN_OPS", {"chunk_linear_attn"})
    assert _dispatch.resolve("chunk_linear_attn", "auto", torch.device("cpu"), varlen=True) is not None


def test_backends_get_cu_seqlens_only_on_packed_calls(monkeypatch):
    """A backend function that predates packing is called exactly as before when unpacked."""
    from hybridzoo.kernels import reference

    seen = []

    def fake(q, k, v, log_a=None, **kwargs):
        seen.append(kwargs.get("cu_seqlens", "absent"))
        return v, None

    monkeypatch.setattr(reference, "chunk_linear_attn", fake)
    q = torch.randn(1, 4, 1, 2)
    chunk_linear_attn(q, q, q, backend="reference")
    chunk_linear_attn(q, q, q, cu_seqlens=torch.tensor([0, 1, 4]), backend="reference")
    assert seen[0] == "absent"
    assert seen[1].dtype == torch.int32 and seen[1].tolist() == [0, 1, 4]


def test_attention_on_the_reference_masks_documents():
    q = torch.randn(1, 5, 1, 4, dtype=torch.float64)
    o, _ = attention(q, q, q, cu_seqlens=torch.tensor([0, 2, 5]), backend="reference")
    o2, _ = attention(q[:, 2:], q[:, 2:], q[:, 2:], backend="reference")
    assert (o[:, 2:] - o2).abs().max() < 1e-12


def test_a_converted_cu_seqlens_is_validated_once(monkeypatch):
    """The int32 copy of an int64 cu_seqlens is remembered too: the reference's own check (and
    every later layer's) reads no values again."""
    from hybridzoo.kernels import varlen

    cu = torch.tensor([0, 2, 5], dtype=torch.int64)
    first = check_cu_seqlens(cu, 5)
    assert check_cu_seqlens(cu, 5) is first
    calls = []
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: calls.append(1) or [])
    assert check_cu_seqlens(first, 5) is first and check_cu_seqlens(cu, 5) is first
    assert calls == []
    monkeypatch.undo()
    assert varlen.check_cu_seqlens(torch.tensor([0, 5]), 5).tolist() == [0, 5]
