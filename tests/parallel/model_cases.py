"""A six-mixer HybridLM sharded over the ranks equals the single-process model (run inside ranks)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from hybridzoo import HybridConfig, HybridLM
from hybridzoo.parallel.context import context_parallel, shard_sequence

TOL = 1e-10
SIX = "mamba1 mamba2 gla retnet gdn attn"


def six_mixer_config(window: int | None, **overrides) -> HybridConfig:
    """Small dims, every mixer kind, chunk sizes shorter than a rank's slice."""
    settings = dict(
        vocab_size=32, d_model=16, n_layers=6, layers=SIX, d_mlp=32, tie_embeddings=False,
        mamba1={"d_state": 4, "d_conv": 3},
        mamba2={"d_state": 4, "head_dim": 8, "chunk_size": 4, "d_conv": 3},
        gla={"num_heads": 2, "chunk_size": 4, "use_short_conv": True, "conv_size": 3,
             "gate_low_rank_dim": 4},
        retnet={"num_heads": 2, "chunk_size": 4},
        gdn={"num_k_heads": 1, "num_v_heads": 2, "head_k_dim": 4, "head_v_dim": 8, "chunk_size": 4,
             "conv_size": 3},
        attn={"n_heads": 2, "n_kv_heads": 1, "window": window},
    )
    settings.update(overrides)
    return HybridConfig(**settings)


def _rel(a, b):
    a, b = a.detach(), b.detach()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def check_model(rank: int, size: int, T: int, method: str = "scan") -> None:
    for window in (None, 3):
        torch.manual_seed(0)
        model = HybridLM(six_mixer_config(window)).double()
        ids = torch.randint(0, 32, (2, T), generator=torch.Generator().manual_seed(5))
        labels = ids.clone()
        labels[0, T // 2] = -100
        logits_ref, _, loss_ref = model(ids, labels=labels)
        ref = torch.autograd.grad(loss_ref, list(model.parameters()))
        with context_parallel(method=method):
            logits, _, loss = model(shard_sequence(ids), labels=shard_sequence(labels))
        grads = torch.autograd.grad(loss, list(model.parameters()))
        Tl = T // size
        assert _rel(logits, logits_ref[:, rank * Tl:(rank + 1) * Tl]) < TOL, (window, rank, "logits")
        total = loss.detach().clone()
        dist.all_reduce(total)
        assert abs(float(total - loss_ref)) < TOL * float(loss_ref), (window, float(total), float(loss_ref))
        for (name, _), got, want in zip(model.named_parameters(), grads, ref):
            got = got.clone()
            dist.all_reduce(got)
            assert _rel(got, want) < TOL, (window, method, rank, name, _rel(got, want))
