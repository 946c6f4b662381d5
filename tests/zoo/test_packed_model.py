"""Packed documents through HybridLM (all six mixers): ``cu_seqlens`` / ``position_ids`` give what
each document run alone gives (logits, loss, every gradient; float64, 1e-10), and the loss never
predicts across a boundary."""

from __future__ import annotations

import pytest
import torch

from hybridzoo import HybridLM
from hybridzoo.utils import rel_err
from hybridzoo.zoo.model import lm_loss, shift_labels
from tests.zoo.tiny import KINDS, tiny_config

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

TOL = 1e-10
LENGTHS = [1, 8, 9, 3]  # chunk 8, window 5: one token, a chunk, chunk + 1 (longer than the window)
# (several chunks per document and full attention: tests/layers/test_packed_mixers.py)


def six_mixer_model(window=5) -> HybridLM:
    torch.manual_seed(0)
    config = tiny_config(KINDS, attn=dict(n_heads=4, n_kv_heads=2, window=window))
    return HybridLM(config).double()


def cu_of(lengths) -> torch.Tensor:
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)


def grads_of(model, loss):
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.autograd.grad(loss, params)


def test_packed_model_equals_separate():
    model = six_mixer_model()
    generator = torch.Generator().manual_seed(0)
    cu = cu_of(LENGTHS)
    ids = torch.randint(0, model.config.vocab_size, (1, int(cu[-1])), generator=generator)

    logits, state, loss = model(ids, labels=ids, cu_seqlens=cu)
    grads = grads_of(model, loss)

    # each document alone: the loss is the mean over every document's own next-token targets
    pieces, summed, count = [], 0.0, 0
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        doc_logits, _ = model(ids[:, a:b])
        pieces.append(doc_logits)
        targets = shift_labels(ids[:, a:b])
        summed = summed + lm_loss(doc_logits, targets, reduction="sum")
        count += b - a - 1
    reference = summed / count
    ref_grads = grads_of(model, reference)

    assert rel_err(logits, torch.cat(pieces, dim=1)) <= TOL
    assert rel_err(loss, reference) <= TOL
    for g, r in zip(grads, ref_grads, strict=True):
        assert rel_err(g, r) <= TOL
    assert len(state) == len(KINDS)
    assert state[0].recurrent.shape[0] == len(LENGTHS)  # per document


def test_position_ids_batch_equals_cu_seqlens():
    """Two rows with restarting position_ids == the rows packed into one row with cu_seqlens, and
    a row start is a boundary even where position_ids would not say so (row 2 starts at 0)."""
    model = six_mixer_model()
    generator = torch.Generator().manual_seed(1)
    rows = [[3, 4, 2], [6, 1, 2]]  # each row: its documents' lengths (9 tokens)
    position_ids = torch.cat([torch.cat([torch.arange(n) for n in row])[None] for row in rows])
    ids = torch.randint(0, model.config.vocab_size, position_ids.shape, generator=generator)

    logits, _, loss = model(ids, labels=ids, position_ids=position_ids)
    grads = grads_of(model, loss)
    cu = cu_of([n for row in rows for n in row])
    flat_logits, _, flat_loss = model(ids.reshape(1, -1), labels=ids.reshape(1, -1), cu_seqlens=cu)
    flat_grads = grads_of(model, flat_loss)
    assert logits.shape == (2, 9, model.config.vocab_size)
    assert rel_err(logits, flat_logits.reshape(logits.shape)) <= TOL
    assert rel_err(loss, flat_loss) <= TOL
    for g, r in zip(grads, flat_grads, strict=True):
        assert rel_err(g, r) <= TOL
    # and the second row alone == its documents alone (it does not read row 1)
    alone, _ = model(ids[1:], position_ids=position_ids[1:])
    assert rel_err(logits[1:], alone) <= TOL


def test_loss_masks_each_document_end():
    """With labels, the last token of each document has no target: the packed loss equals the
    mean over the targets inside documents, and differs from the unmasked shift."""
    model = six_mixer_model()
    cu = cu_of([4, 6, 5])
    ids = torch.randint(0, model.config.vocab_size, (1, 15), generator=torch.Generator().manual_seed(2))
    logits, _, loss = model(ids, labels=ids, cu_seqlens=cu)
    targets = shift_labels(ids)
    targets[0, [3, 9]] = -100  # the ends of documents 0 and 1 (the row's last token: already -100)
    assert rel_err(loss, lm_loss(logits, targets)) <= TOL
    assert rel_err(loss, lm_loss(logits, shift_labels(ids))) > 1e-6
    # targets given aligned are taken as given
    _, _, as_given = model(ids, targets=shift_labels(ids), cu_seqlens=cu)
    assert rel_err(as_given, lm_loss(logits, shift_labels(ids))) <= TOL


def test_packed_model_errors():
    model = six_mixer_model()
    ids = torch.zeros(2, 6, dtype=torch.long)
    with pytest.raises(ValueError, match="with cu_seqlens the documents are packed into one row"):
        model(ids, cu_seqlens=cu_of([6, 6]))
    with pytest.raises(ValueError, match="not both"):
        model(ids, cu_seqlens=cu_of([12]), position_ids=torch.zeros(2, 6, dtype=torch.long))
    with pytest.raises(ValueError, match="position_ids must restart at 0"):
        model(ids, position_ids=torch.arange(12).reshape(2, 6))  # row 2 starts at 6
    with pytest.raises(ValueError, match="position_ids must restart at 0"):
        model(ids, position_ids=torch.tensor([[0, 1, 3, 4, 0, 1]] * 2))  # a gap
