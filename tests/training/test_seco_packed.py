"""SeCO with packed documents: the chunked step's loss and gradients equal full backprop of the
packed row (float64, 1e-10, every mixer kind, full and sliding-window attention), with boundaries
inside chunks and exactly at a chunk edge."""

from __future__ import annotations

import pytest
import torch

from hybridzoo.parallel.comm import ContextParallelError
from hybridzoo.training.seco_engine import SeCOError, check_chunked_forward, seco_step
from tests.training.test_seco import VOCAB, assert_close, full_backprop, hybrid, take_grads

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

# 23 tokens; with chunks of 7: boundaries at 1 and 9 (inside chunks), 7 (exactly at the first
# chunk edge), 16 (inside); the documents [9, 16) (exactly a chunk long) and [16, 23) straddle the
# edges 14 and 21 and carry their states across them
CU = [0, 1, 7, 9, 16, 23]


@pytest.mark.parametrize("chunk,path", [(3, "chunk_attention"), (7, "chunk_attention"),
                                        (7, "block_prefix"), (7, "kv_offload")])
def test_packed_seco_equals_full_backprop(chunk, path, monkeypatch):
    """``path``: the full-attention prefix through chunk_attention (CPU default), through
    block_prefix_attention (as on CUDA in float32), or with the stores offloaded."""
    if path == "block_prefix":
        monkeypatch.setattr("hybridzoo.layers.attention.chunk_attention_applies", lambda *args: False)
    model = hybrid(0)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (1, CU[-1]), generator=generator)
    labels = ids.clone()
    labels[0, 2] = -100
    cu = torch.tensor(CU, dtype=torch.int32)
    ref_loss = full_backprop(model, input_ids=ids, labels=labels, cu_seqlens=cu)
    ref = take_grads(model)
    result = seco_step(model, {"input_ids": ids, "labels": labels, "cu_seqlens": cu}, chunk,
                       kv_offload=path == "kv_offload")
    assert abs(float(result.loss - ref_loss)) <= 1e-12
    assert_close(take_grads(model), ref)
    # the startup check (chunked forward with carried states == one full forward) passes too
    errors = check_chunked_forward(model, {"input_ids": ids, "labels": labels, "cu_seqlens": cu}, chunk,
                                   tokens=CU[-1])
    assert max(errors) <= 1e-10


def test_packed_seco_with_position_ids_and_embeddings():
    """Two rows with restarting position_ids (rows packed into one), the input embeddings' gradient
    included; a document starts exactly at the chunk edge 6 and at the row edge 12."""
    model = hybrid(1)
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (2, 12), generator=generator)
    position_ids = torch.tensor([[0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5], [0, 1, 2, 0, 1, 2, 3, 4, 5, 6, 7, 8]])
    embeds = model.embed(ids).detach().requires_grad_()
    ref_loss = full_backprop(model, inputs_embeds=embeds, labels=ids, position_ids=position_ids)
    ref = take_grads(model, embeds)
    result = seco_step(model, {"inputs_embeds": embeds, "labels": ids, "position_ids": position_ids}, 6)
    assert abs(float(result.loss - ref_loss)) <= 1e-12
    assert_close(take_grads(model, embeds), ref)


def test_packed_seco_errors():
    model = hybrid(0)
    ids = torch.zeros(2, 6, dtype=torch.long)
    with pytest.raises(SeCOError, match="packed into one row"):
        seco_step(model, {"input_ids": ids, "labels": ids, "cu_seqlens": torch.tensor([0, 12])}, 3)
    with pytest.raises(SeCOError, match="not both"):
        seco_step(model, {"input_ids": ids, "labels": ids, "cu_seqlens": torch.tensor([0, 12]),
                          "position_ids": torch.zeros_like(ids)}, 3)


def test_context_parallel_combinations_with_documents_are_refused():
    """A mixer called with cu_seqlens under context parallelism (documents come through the model's
    position_ids), and SeCO with context parallelism and documents together."""
    from hybridzoo.layers.gla import GLA
    from hybridzoo.parallel import context

    mixer = GLA(16).double()
    x = torch.randn(1, 4, 16, dtype=torch.float64)
    model = hybrid(0)
    ids = torch.zeros(1, 6, dtype=torch.long)
    previous = context._ACTIVE
    context._ACTIVE = context.ContextParallel(group=None, method="scan", rank=0, size=1)
    try:
        with pytest.raises(ContextParallelError, match="packed documents come through the model"):
            mixer(x, cu_seqlens=torch.tensor([0, 2, 4], dtype=torch.int32))
        with pytest.raises(ContextParallelError, match="SeCO with context parallelism: packed documents"):
            seco_step(model, {"input_ids": ids, "labels": ids, "position_ids": torch.arange(6)[None]}, 3)
    finally:
        context._ACTIVE = previous
