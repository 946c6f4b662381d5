"""One MQAR training step, run eagerly or replayed from a CUDA graph.

The MQAR models are tiny (d_model 64, 2 blocks): a step is a few hundred kernels of microseconds
each, so its time is the host's launches, and with several runs sharing one GPU, the time each
process's launches leave the GPU idle. Captured once as a CUDA graph (batch gather, forward under
bf16 autocast, loss, backward, gradient clipping and AdamW), a step is one launch.

The graph is checked before it is used: the step after the warm-up steps is run eagerly twice
from a snapshot of the weights and optimizer state, the snapshot is restored, the graph is captured
and replayed for the same batch, and the two losses and every parameter are compared (``check``):
the replay may differ from the eager step by ``tolerance`` or by ten times what the two eager
steps differ (kernels that sum with atomics vary in the last bits from run to run, more so with
other runs on the GPU). A capture that fails (an op that waits on the host) or a check that fails
falls back to eager steps and says why (``fallback``); nothing of the run is lost.

With ``scored_only`` the LM head and the loss run at the scored positions alone (MQAR scores the
token after each query key: 16 of 256): the same loss and gradients, since the other positions
contribute nothing, for a sixteenth of the ``[B, T, vocab]`` logits' work.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from hybridzoo.zoo.cross_entropy import IGNORE_INDEX
from hybridzoo.zoo.model import lm_loss, shift_labels


def make_optimizer(groups, lr: float, betas, device: str, graph: bool) -> torch.optim.Optimizer:
    """AdamW over ``groups``; for a captured step, ``capturable`` with the learning rate a device
    tensor (the schedule fills it in place between replays)."""
    if not graph:
        return torch.optim.AdamW(groups, lr=lr, betas=betas)
    return torch.optim.AdamW(groups, lr=torch.tensor(lr, device=device), betas=betas, capturable=True)


def autocast(dtype: torch.dtype | None, cache_enabled: bool = True):
    """The MQAR runs' autocast: CUDA autocast to ``dtype``, or none where ``dtype`` is None."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast("cuda", dtype=dtype, cache_enabled=cache_enabled)


class TrainStep:
    """``step(index [batch] int64 on the device) -> loss`` (0-dim float32 tensor, not synchronised).

    ``train_ids`` / ``train_labels`` ``[N, T]`` int64 on the device; ``clip`` the gradient norm
    bound; ``autocast_dtype`` the autocast dtype on CUDA (None: none); ``graph`` whether to
    capture. ``warmup`` eager steps (real training steps; Triton's autotuning happens in them) come
    before the checked step and the capture.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, train_ids: torch.Tensor,
                 train_labels: torch.Tensor, clip: float, autocast_dtype: torch.dtype | None = None,
                 graph: bool = False, warmup: int = 3, tolerance: float = 1e-3, scored_only: bool = False):
        if graph and not train_ids.is_cuda:
            raise ValueError("TrainStep: a CUDA graph needs the model and data on a CUDA device")
        if warmup < 1:
            raise ValueError("TrainStep: warmup must be >= 1 (the optimizer's state exists before the capture)")
        # scored_only: the head and the loss at the scored positions only (MQAR scores 1 token in 16);
        # the same loss and gradients as over every position, where the others contribute nothing.
        # Each row's scored positions, found once for the whole training set: a fixed count per
        # row (the most of any row; a row with fewer pads with ignored positions).
        self.positions = self.picked = None
        if scored_only:
            targets = shift_labels(train_labels)
            scored = targets != IGNORE_INDEX
            width = max(1, int(scored.sum(1).max()))
            self.positions = torch.topk(scored.to(torch.float32), width, dim=1, sorted=False).indices
            self.picked = targets.gather(1, self.positions)
        self.model, self.optimizer, self.clip = model, optimizer, clip
        self.ids, self.labels = train_ids, train_labels
        self.autocast_dtype, self.graph, self.warmup, self.tolerance = autocast_dtype, graph, warmup, tolerance
        if hasattr(model, "check_ids"):
            model.check_ids(train_ids)  # once, whole: each step's batch is a gather of these rows
        self.calls = 0
        self.captured: torch.cuda.CUDAGraph | None = None
        self.static_index: torch.Tensor | None = None
        self.static_loss: torch.Tensor | None = None
        self.check: dict[str, Any] | None = None
        self.fallback: str | None = None

    def _autocast(self):
        # no weight-cast cache: a captured step must cast the weights it reads at each replay
        return autocast(self.autocast_dtype, cache_enabled=not self.graph)

    def _eager(self, index: torch.Tensor) -> torch.Tensor:
        x, y = self.ids[index], self.labels[index]
        # the ids were range-checked once, whole (HybridLM.check_ids): no host sync per step
        checked = self.model.ids_checked() if hasattr(self.model, "ids_checked") else contextlib.nullcontext()
        with self._autocast(), checked:
            if self.positions is None:
                logits, _ = self.model(x)
                targets = shift_labels(y)
            else:
                hidden, _ = self.model(x, return_hidden=True)
                where = self.positions[index]
                logits = self.model.lm_head(hidden.gather(1, where[..., None].expand(-1, -1, hidden.shape[-1])))
                targets = self.picked[index]
        loss = lm_loss(logits, targets)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.optimizer.step()
        return loss.detach()

    def __call__(self, index: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.captured is not None:
            self.static_index.copy_(index)
            self.captured.replay()
            return self.static_loss
        if not self.graph or self.fallback is not None:
            return self._eager(index)
        if self.calls <= self.warmup:  # on a side stream, as CUDA graph capture asks of the warm-up
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                loss = self._eager(index)
            torch.cuda.current_stream().wait_stream(side)
            return loss
        return self._capture_and_check(index)

    # ---- capture ------------------------------------------------------------------------------
    def _state(self) -> list[torch.Tensor]:
        tensors = [p.data for p in self.model.parameters()]
        for state in self.optimizer.state.values():
            tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
        return tensors

    def _restore(self, saved: list[torch.Tensor]) -> None:
        for tensor, value in zip(self._state(), saved):
            tensor.copy_(value)

    def _param_diff(self, expected: list[torch.Tensor]) -> tuple[float, str]:
        """The largest difference of a parameter from ``expected`` (parameters first), relative
        to that parameter's largest magnitude, and its name."""
        worst, where = 0.0, ""
        for (name, p), value in zip(self.model.named_parameters(), expected):
            diff = float((p.detach() - value).abs().max() / value.abs().max().clamp_min(1e-12))
            if diff > worst:
                worst, where = diff, name
        return worst, where

    def _capture_and_check(self, index: torch.Tensor) -> torch.Tensor:
        snapshot = [t.clone() for t in self._state()]
        # the same eager step twice: kernels that sum with atomics differ from run to run in
        # the last bits, and the replay is held to that difference (or ``tolerance``)
        self._eager(index)
        second = [p.detach().clone() for p in self.model.parameters()]
        self._restore(snapshot)
        eager_loss = self._eager(index).clone()
        eager_state = [t.clone() for t in self._state()]  # parameters first, then the optimizer's state
        noise, _ = self._param_diff(second)
        self._restore(snapshot)
        self.optimizer.zero_grad(set_to_none=True)
        self.static_index = index.clone()
        graph = torch.cuda.CUDAGraph()
        try:
            torch.cuda.synchronize()
            # thread_local: other runs of the process (--streams) may launch work meanwhile
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                self.static_loss = self._eager(self.static_index)
        except Exception as error:  # an op that cannot be captured: eager from here on
            self.fallback = f"capture failed: {type(error).__name__}: {str(error).splitlines()[0][:200]}"
            torch.cuda.synchronize()
            for tensor, saved in zip(self._state(), snapshot):
                tensor.copy_(saved)
            self.optimizer.zero_grad(set_to_none=True)
            return self._eager(index)
        graph.replay()
        worst, where = self._param_diff(eager_state)
        loss_diff = abs(float(self.static_loss) - float(eager_loss)) / max(abs(float(eager_loss)), 1e-12)
        bound = max(self.tolerance, 10 * noise)
        self.check = {"step": self.calls, "loss_rel_diff": loss_diff, "param_rel_diff": worst,
                      "param": where, "eager_rel_diff": noise,
                      "ok": loss_diff <= self.tolerance and worst <= bound}
        if self.check["ok"]:
            self.captured = graph
            return self.static_loss
        # the replay did not reproduce the eager step: drop the graph, keep the eager step's result
        self.fallback = f"check failed: {self.check}"
        for tensor, expected in zip(self._state(), eager_state):
            tensor.copy_(expected)
        self.optimizer.zero_grad(set_to_none=True)
        self.static_loss = None
        return eager_loss
