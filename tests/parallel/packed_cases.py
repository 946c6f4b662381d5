"""Packed documents under context parallelism (run inside ranks): a six-mixer HybridLM (full and
sliding-window attention), sharded with each rank's slice of the position_ids, equals the
single-process packed model (logits, loss, every gradient; float64, 1e-10)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from hybridzoo import HybridLM
from hybridzoo.parallel.comm import ContextParallelError
from hybridzoo.parallel.context import context_parallel, shard_sequence
from tests.parallel.model_cases import TOL, _rel, six_mixer_config
# 24 tokens on 3 ranks (edges 8 and 16): the document [7, 16) crosses edge 8 with one token on
# rank 0 (fewer than the conv's tail of 2; rank 1's queries attend to it), fills rank 1 (its map is
# the document's transition) and ends exactly at edge 16, where a 1-token document starts.
LENGTHS = [7, 9, 1, 7]


def check_packed_model(rank: int, size: int, method: str) -> None:
    for window in (None, 3):
        _check(rank, size, method, window)
    # cu_seqlens under context parallelism are refused (each rank passes its slice of position_ids)
    model = HybridLM(six_mixer_config(None, layers="gla attn", n_layers=2)).double()
    with context_parallel(method=method), pytest.raises(ContextParallelError, match="slice of position_ids"):
        model(torch.zeros(1, 4, dtype=torch.long), cu_seqlens=torch.tensor([0, 4], dtype=torch.int32))


def _check(rank: int, size: int, method: str, window) -> None:
    torch.manual_seed(0)
    model = HybridLM(six_mixer_config(window)).double()
    T = sum(LENGTHS)
    ids = torch.randint(0, 32, (1, T), generator=torch.Generator().manual_seed(3))
    labels = ids.clone()
    labels[0, 2] = -100
    position_ids = torch.cat([torch.arange(n) for n in LENGTHS])[None]
    logits_ref, _, loss_ref = model(ids, labels=labels, position_ids=position_ids)
    ref = torch.autograd.grad(loss_ref, list(model.parameters()))
    with context_parallel(method=method):
        logits, _, loss = model(shard_sequence(ids), labels=shard_sequence(labels),
                                position_ids=shard_sequence(position_ids))
    grads = torch.autograd.grad(loss, list(model.parameters()))
    Tl = T // size
    assert _rel(logits, logits_ref[:, rank * Tl:(rank + 1) * Tl]) < TOL, (window, rank, "logits")
    total = loss.detach().clone()
    dist.all_reduce(total)
    assert abs(float(total - loss_ref)) < TOL * float(loss_ref), (float(total), float(loss_ref))
    for (name, _), got, want in zip(model.named_parameters(), grads, ref):
        got = got.clone()
        dist.all_reduce(got)
        assert _rel(got, want) < TOL, (window, method, rank, name, _rel(got, want))
