"""Clear errors on bad input, and the bytes actually sent against the cost formulas (run inside ranks)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from hybridzoo import HybridLM, kernels
from hybridzoo.layers import Mixer
from hybridzoo.parallel import recurrent_ops
from hybridzoo.parallel.comm import ContextParallelError, count_sent
from hybridzoo.parallel.context import context_parallel, shard_sequence, sharded
from hybridzoo.parallel.costs import model_bytes_per_step
from tests.parallel.model_cases import six_mixer_config


class _Unsharded(Mixer):
    kind = "unsharded"

    def mix(self, x, state):
        return x, None


def check_errors(rank: int, size: int) -> None:
    with pytest.raises(ContextParallelError, match="does not split evenly"):
        shard_sequence(torch.zeros(1, 7))
    # ranks that disagree on the length: every rank gets the error (one all_gather of shapes)
    T = 4 + rank
    q = torch.randn(1, T, 1, 2)
    with pytest.raises(ContextParallelError, match="ranks disagree"):
        recurrent_ops.chunk_linear_attn(q, q, torch.randn(1, T, 1, 2))
    model = HybridLM(six_mixer_config(None)).double()
    with context_parallel():
        with pytest.raises(ContextParallelError, match="ranks disagree"):
            model(torch.zeros(1, 4 + rank, dtype=torch.long))
        with pytest.raises(ContextParallelError, match="no sharded path"):
            _Unsharded(4)(torch.zeros(1, 2, 4))
        with pytest.raises(ContextParallelError, match="no sharded path"):
            sharded(kernels.attention_step)
        with pytest.raises(ContextParallelError, match="starts from state=None"):
            _, state = model.blocks[0].mixer(torch.zeros(1, 4, 16, dtype=torch.float64))
            model.blocks[0].mixer(torch.zeros(1, 4, 16, dtype=torch.float64), state)
        with pytest.raises(ContextParallelError, match="already inside"):
            with context_parallel():
                pass


def _all_ranks(n: int) -> int:
    total = torch.tensor([n], dtype=torch.int64)
    dist.all_reduce(total)
    return int(total)


def check_costs(rank: int, size: int) -> None:
    B, T = 2, 8
    for method in ("sequential", "scan"):
        torch.manual_seed(0)
        model = HybridLM(six_mixer_config(3)).double()
        ids = torch.randint(0, 32, (B, T * size), generator=torch.Generator().manual_seed(1))
        with context_parallel(method=method):
            with count_sent() as fwd:
                _, _, loss = model(shard_sequence(ids), labels=shard_sequence(ids))
        with count_sent() as bwd:
            loss.backward()
        want_fwd, want_bwd = model_bytes_per_step(model, size, B, T, method)
        got_fwd, got_bwd = _all_ranks(fwd[0]), _all_ranks(bwd[0])
        assert (got_fwd, got_bwd) == (want_fwd, want_bwd), (method, got_fwd, want_fwd, got_bwd, want_bwd)
        assert want_bwd > 0
