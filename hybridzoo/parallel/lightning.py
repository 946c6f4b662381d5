"""Context parallelism in Lightning training: ``--trainer.callbacks hybridzoo.parallel.lightning.ContextParallelCallback``.

With ``W`` processes (``--trainer.strategy ddp --trainer.devices W``) and ``size = C`` ranks per
sequence, the world splits into ``W / C`` context-parallel groups of consecutive ranks; DDP keeps
averaging gradients over the whole world, so the groups are the data-parallel replicas. Per
training batch the callback

1. broadcasts the batch of the group's first rank to the group (each group trains on one batch;
   the other ranks' loader draws are unused),
2. replaces ``input_ids`` and ``labels`` by this rank's contiguous slice ``[B, T / C]``,
3. runs the step inside :func:`~hybridzoo.parallel.context.context_parallel` (the model then returns
   this rank's share of the loss; the shares sum to the sequence's mean loss), and
4. after the backward multiplies every gradient by ``C``: DDP averaged the ranks' partial gradients
   over ``W`` ranks, and a replica's gradient is the sum over its ``C`` ranks, averaged over the
   ``W / C`` replicas.

``train/loss`` as logged by the module is the rank's share; the callback logs the group's sum as
``train/loss_cp`` and keeps it in :attr:`ContextParallelCallback.losses`. Validation runs
unsharded.

With the :class:`~hybridzoo.training.seco.SeCO` callback as well, each rank runs SeCO over its own
slice (``seco_step`` sees the active context; :mod:`hybridzoo.training.seco_ranks`): the ranks hand the
states and K/V on in stage 1 and their gradients back in stage 2, one rank after another, so the
step is exact but not faster than single-process SeCO; what it saves is memory (a rank holds its
slice's boundary states and the K/V up to its slice's end). SpaCO (``spaco_budget``) is refused
with context parallelism.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback

from hybridzoo.parallel.comm import ContextParallelError, split_evenly
from hybridzoo.parallel.context import context_parallel


class ContextParallelCallback(Callback):
    """Shard each training batch's sequence over groups of ``size`` ranks (None = all ranks).

    Args:
        size: ranks per context-parallel group, a divisor of the world size.
        method: ``"scan"`` or ``"sequential"`` state passing (see :mod:`hybridzoo.parallel`).
    """

    def __init__(self, size: int | None = None, method: str = "scan"):
        self.size, self.method = size, method
        self.group = None
        self.losses: list[float] = []
        self._stack: contextlib.ExitStack | None = None

    def setup(self, trainer, pl_module, stage: str) -> None:
        if stage != "fit":
            return
        if not dist.is_available() or not dist.is_initialized():
            raise ContextParallelError("ContextParallelCallback needs a distributed strategy "
                                       "(--trainer.strategy ddp --trainer.devices N)")
        world, rank = dist.get_world_size(), dist.get_rank()
        size = self.size or world
        if size < 1 or world % size:
            raise ContextParallelError(f"ContextParallelCallback: size {size} does not divide the "
                                       f"world size {world}")
        self.size = size
        for start in range(0, world, size):  # every rank creates every group, in the same order
            group = dist.new_group(list(range(start, start + size)))
            if start <= rank < start + size:
                self.group, self.leader = group, start

    def on_train_start(self, trainer, pl_module) -> None:
        seco = getattr(pl_module, "seco", None)
        if seco is not None and getattr(seco, "spaco_budget", None) is not None:
            raise ContextParallelError("ContextParallelCallback together with SeCO's SpaCO "
                                       "(spaco_budget) is not supported: use exact SeCO "
                                       "(spaco_budget: null) or no context parallelism")

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        rank = dist.get_rank(self.group)
        for key in ("input_ids", "labels"):
            whole = batch[key].contiguous()
            dist.broadcast(whole, self.leader, group=self.group)
            n = split_evenly(whole.shape[1], self.size, "ContextParallelCallback")
            batch[key] = whole[:, rank * n:(rank + 1) * n]
        self._stack = contextlib.ExitStack()
        self._stack.enter_context(context_parallel(self.group, method=self.method))

    def _leave(self) -> None:
        if self._stack is not None:
            self._stack.close()
            self._stack = None

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        self._leave()  # the backward needs no context: the sharded ops keep their group

    def on_after_backward(self, trainer, pl_module) -> None:
        with torch.no_grad():
            for param in pl_module.parameters():
                if param.grad is not None:
                    param.grad.mul_(self.size)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._leave()
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        total = loss.detach().clone().to(torch.float64)
        dist.all_reduce(total, group=self.group)
        self.losses.append(float(total))
        pl_module.log("train/loss_cp", total.to(loss.dtype), batch_size=batch["input_ids"].shape[0])
