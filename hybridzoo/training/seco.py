"""The ``SeCO`` Lightning callback: exact chunked training steps for very long sequences.

In a recipe, like any callback::

    trainer:
      callbacks:
        - class_path: hybridzoo.training.seco.SeCO
          init_args: {chunk_size: 16384, kv_offload: false, spaco_budget: null, check: true}

A step that runs longer than ``progress_every_s`` (30 s) reports its stage and chunk every 30 s.

The engine is :func:`~hybridzoo.training.seco_engine.seco_step` (plain PyTorch, re-exported here);
this callback only connects it to Lightning's *automatic* optimization, so gradient accumulation,
gradient clipping, precision plugins, LR schedulers and DDP behave as without SeCO:

* ``setup`` installs the callback on the module as ``pl_module.seco``; the module's
  ``training_step`` then returns ``pl_module.seco.training_loss(self.model, batch)`` instead of
  the full-sequence loss (the one hook line :class:`~hybridzoo.training.module.LanguageModel`
  needs).
* ``training_loss`` runs the startup check once (on the first batch, in the training precision),
  then ``seco_step(..., defer_last=True)``: stage 1 and the reverse sweep up to the last chunk
  happen inside ``training_step`` without touching ``.grad`` (Lightning zeroes gradients between
  ``training_step`` and ``backward``); it returns a scalar equal to the batch's loss whose
  backward — Lightning's one ``backward`` call — completes the last chunk and adds every other
  chunk's share. Under DDP the reducer is armed only for that backward, so gradients are
  all-reduced once per batch (and, with ``accumulate_grad_batches``, once per optimizer step, as
  usual).

Limits: the loss is the LM loss of ``batch["labels"]`` (or ``targets``) only; fp16 with loss
scaling works but the inner chunks' gradients are unscaled (prefer bf16); ``torch.compile`` of
the model is not validated.
"""

from __future__ import annotations

import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info

from hybridzoo.training.seco_engine import (
    LOSS_SLICE,
    ProgressLog,
    SeCOCheckError,
    SeCOError,
    SeCOOffloadError,
    SeCOResult,
    _unwrap,
    check_chunked_forward,
    check_options,
    host_ram_bytes,
    offload_bytes,
    seco_step,
)

__all__ = ["SeCO", "seco_step", "check_chunked_forward", "SeCOResult", "SeCOError", "SeCOCheckError",
           "SeCOOffloadError", "ProgressLog", "host_ram_bytes", "offload_bytes"]

HOOK_LINE = 'loss = self.seco.training_loss(self.model, batch) if getattr(self, "seco", None) is not None else ...'


class SeCO(Callback):
    """Make every training step an exact SeCO step (see the module docstring).

    Args:
        chunk_size: tokens per chunk; activation memory is set by it, not by the sequence length.
        kv_offload: keep K/V stores and chunk-boundary states in pinned host memory (refused up
            front beyond 40% of host RAM).
        spaco_budget: None = exact; an int t = SpaCO, an unbiased estimate that recomputes each
            chunk with probability ``min(1, t / k)`` (see :mod:`hybridzoo.training.seco_engine`).
        check: before the first step, verify on the actual model and batch that the chunked
            forward equals the full forward; refuse to train (:class:`SeCOCheckError`) otherwise.
        check_tokens: tokens the check runs on (default ``min(T, 4 · chunk_size)``).
        check_tolerance: relative error allowed by the check (default by dtype).
        block_size: prefix positions read per block (default ``chunk_size``).
        loss_slice: tokens of logits computed at a time for a chunk's loss (default 4096; None =
            the whole chunk): memory only, the gradient is the same.
        seed: seed of SpaCO's chunk draws (default: the global RNG).
        progress_every_s: a step running longer than this many seconds reports its progress
            (stage, chunk, seconds; rank 0, Lightning's info log) at most this often, and once
            more after its last chunk's forward (its backward is Lightning's); None = never.
            Steps shorter than it print nothing.
    """

    def __init__(self, chunk_size: int = 4096, kv_offload: bool = False, spaco_budget: int | None = None,
                 check: bool = True, check_tokens: int | None = None, check_tolerance: float | None = None,
                 block_size: int | None = None, seed: int | None = None,
                 loss_slice: int | None = LOSS_SLICE, progress_every_s: float | None = 30.0):
        check_options(chunk_size, spaco_budget, block_size, loss_slice=loss_slice, error=ValueError)
        if progress_every_s is not None and not progress_every_s > 0:
            raise ValueError(f"SeCO: progress_every_s must be > 0 seconds or None (never), got {progress_every_s!r}")
        self.chunk_size, self.kv_offload, self.spaco_budget = chunk_size, kv_offload, spaco_budget
        self.check, self.check_tokens, self.check_tolerance = check, check_tokens, check_tolerance
        self.block_size, self.loss_slice = block_size, loss_slice
        self.generator = torch.Generator().manual_seed(seed) if seed is not None else None
        self.progress = None if progress_every_s is None else ProgressLog(progress_every_s, rank_zero_info)
        self.checked = False
        self.calls = 0
        self.last_result: SeCOResult | None = None
        self._calls_at_batch_start = 0

    # ---- installed on the module --------------------------------------------------------
    def setup(self, trainer, pl_module, stage: str) -> None:
        _unwrap(getattr(pl_module, "model", None))  # SeCOError unless .model is a HybridLM
        if not pl_module.automatic_optimization:
            raise SeCOError("SeCO integrates with Lightning's automatic optimization; with manual "
                            "optimization call hybridzoo.training.seco.seco_step yourself")
        pl_module.seco = self

    def teardown(self, trainer, pl_module, stage: str) -> None:
        if getattr(pl_module, "seco", None) is self:
            del pl_module.seco

    def training_loss(self, model, batch: dict) -> torch.Tensor:
        """The scalar a ``training_step`` returns under SeCO: equal to the batch's mean loss;
        its backward gives the exact (SpaCO: unbiased) gradient of the whole batch."""
        if self.check and not self.checked:
            check_chunked_forward(model, batch, self.chunk_size, tokens=self.check_tokens,
                                  tolerance=self.check_tolerance, kv_offload=self.kv_offload,
                                  block_size=self.block_size)
            self.checked = True
        result = seco_step(model, batch, self.chunk_size, kv_offload=self.kv_offload,
                           spaco_budget=self.spaco_budget, generator=self.generator,
                           defer_last=True, block_size=self.block_size, loss_slice=self.loss_slice,
                           progress=self.progress)
        self.calls += 1
        self.last_result = result
        return result.deferred

    # ---- guards ----------------------------------------------------------------------------
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._calls_at_batch_start = self.calls
        self._step_at_batch_start = trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.calls == self._calls_at_batch_start:
            raise SeCOError(
                f"SeCO: {type(pl_module).__name__}.training_step did not call SeCO, so this step "
                f"was a plain full-sequence step. Make training_step use "
                f"`{HOOK_LINE}` (LanguageModel does).")
        if trainer.global_step != self._step_at_batch_start:
            # the optimizer stepped: these gradients are dead (Lightning zeroes them before the
            # next backward); freeing them now keeps SeCO's next step from setting aside a copy
            for param in pl_module.parameters():
                param.grad = None
