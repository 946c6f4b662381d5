"""SeCO under context parallelism (run inside ranks): each rank chunks its own slice; the summed
shares of loss and gradient equal the single-process full-backprop run (float64), and the bytes
sent equal :func:`hybridzoo.parallel.costs.seco_bytes_per_step`."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from hybridzoo import HybridLM
from hybridzoo.parallel.comm import ContextParallelError
from hybridzoo.parallel.context import context_parallel, shard_sequence
from hybridzoo.parallel.costs import seco_bytes_per_step
from hybridzoo.training.seco_engine import seco_step
from hybridzoo.parallel.comm import count_sent
from tests.parallel.misc_cases import _all_ranks
from tests.parallel.model_cases import TOL, _rel, six_mixer_config


def _batch(size: int, local_len: int):
    T = size * local_len
    ids = torch.randint(0, 32, (2, T), generator=torch.Generator().manual_seed(5))
    labels = ids.clone()
    labels[0, T // 2] = -100
    labels[1, local_len] = -100          # a rank's first label (the previous rank's last target)
    return ids, labels


def _reference(model, ids, labels):
    _, _, loss = model(ids, labels=labels)
    return loss.detach(), torch.autograd.grad(loss, list(model.parameters()))


def _sharded_step(model, ids, labels, chunk_size: int, defer_last: bool, kv_offload: bool):
    """This rank's SeCO step on its slice; returns (group's summed loss, summed gradients)."""
    model.zero_grad(set_to_none=True)
    batch = {"input_ids": shard_sequence(ids), "labels": shard_sequence(labels)}
    with context_parallel():
        result = seco_step(model, batch, chunk_size, defer_last=defer_last, kv_offload=kv_offload)
    if defer_last:
        assert all(p.grad is None for p in model.parameters())
        result.deferred.backward()
    loss = result.loss.clone()
    dist.all_reduce(loss)
    grads = []
    for p in model.parameters():
        g = p.grad.clone()
        dist.all_reduce(g)
        grads.append(g)
    return loss, grads


def check_seco_exact(rank: int, size: int, local_len: int = 8) -> None:
    """Six mixers, full attention and sliding windows shorter and longer than a slice; chunks
    that divide the slice and a ragged one; the deferred (Lightning) and the eager form; the K/V
    stores in host memory (kv_offload; the same device on CPU, the path still runs). SpaCO is
    refused with a clear error."""
    ids, labels = _batch(size, local_len)
    torch.manual_seed(0)
    model = HybridLM(six_mixer_config(None)).double()
    with context_parallel(), pytest.raises(ContextParallelError, match="SpaCO"):
        seco_step(model, {"input_ids": shard_sequence(ids), "labels": shard_sequence(labels)}, 4,
                  spaco_budget=1)
    cases = ((None, 4, False, True), (3, 3, True, False), (local_len + 3, 4, True, False))
    for window, chunk_size, defer_last, kv_offload in cases:
        torch.manual_seed(0)
        model = HybridLM(six_mixer_config(window)).double()
        loss_ref, grads_ref = _reference(model, ids, labels)
        loss, grads = _sharded_step(model, ids, labels, chunk_size, defer_last, kv_offload)
        assert abs(float(loss - loss_ref)) < TOL * float(loss_ref), (window, float(loss), float(loss_ref))
        for (name, _), got, want in zip(model.named_parameters(), grads, grads_ref):
            assert _rel(got, want) < TOL, (window, chunk_size, rank, name, _rel(got, want))


def check_seco_costs(rank: int, size: int, local_len: int = 8) -> None:
    """The bytes the ranks send in one step equal the formula (stage 1 + stage 2)."""
    ids, labels = _batch(size, local_len)
    for window in (None, 3):
        torch.manual_seed(0)
        model = HybridLM(six_mixer_config(window)).double()
        batch = {"input_ids": shard_sequence(ids), "labels": shard_sequence(labels)}
        with context_parallel(), count_sent() as sent:
            seco_step(model, batch, 4)
        forward, backward = seco_bytes_per_step(model, size, ids.shape[0], local_len)
        assert _all_ranks(sent[0]) == forward + backward, (window, _all_ranks(sent[0]), forward, backward)
        assert backward > 0
