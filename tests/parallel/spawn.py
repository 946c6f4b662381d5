"""Run a function on P CPU processes joined by a gloo process group (for the context-parallel tests)."""

from __future__ import annotations

import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank: int, size: int, init_file: str, fn, args) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=size)
    try:
        fn(rank, size, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_ranks(size: int, fn, *args) -> None:
    """``fn(rank, size, *args)`` on ``size`` spawned processes; an exception in any re-raises here.
    ``fn`` must be a module-level function (spawn pickles it by name)."""
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        mp.spawn(_entry, args=(size, init_file, fn, args), nprocs=size, join=True)
