"""What ``hybridzoo fit`` prints while it runs and when it ends.

- :class:`StepProgressBar`: the Rich progress bar on a terminal (``step N/max_steps``, loss,
  smoothed tokens/s; no ``v_num``).
- :class:`LogLines`: when the output is not a terminal (a cluster's log file), a plain line
  every N optimizer steps: step, loss, smoothed tokens/s, elapsed time, ETA.
- :class:`ParamSummary`: Lightning's model summary without its FLOPs column and
  ``Total FLOPs: 0`` line (Lightning counts FLOPs only with an ``example_input_array``).
- :func:`fit_summary`: the lines printed at the end of fit.
"""

from __future__ import annotations

import math
import sys
import time
from typing import Any, TextIO

from lightning.pytorch.callbacks import ProgressBar, RichModelSummary, RichProgressBar

DEFAULT_EVERY = 50  # steps between log lines at most (10% of the run when that is fewer)


class StepProgressBar(RichProgressBar):
    """Rich progress bar that shows ``step N/max_steps`` when training is bounded by steps
    (Lightning's own shows ``Epoch 0/-2`` when ``max_epochs`` is -1), and no ``v_num``."""

    def _get_train_description(self, current_epoch: int) -> str:
        trainer = self.trainer
        if trainer.max_epochs is not None and trainer.max_epochs >= 0:
            return super()._get_train_description(current_epoch)
        description = f"Epoch {current_epoch}"
        if trainer.max_steps and trainer.max_steps > 0:
            description += f" (max_steps {trainer.max_steps})"
        return description

    def get_metrics(self, trainer, pl_module) -> dict[str, Any]:
        items = super().get_metrics(trainer, pl_module)
        items.pop("v_num", None)  # the logger's version folder number: not a metric
        return items


def total_steps(trainer) -> float:
    """The optimizer steps the run will end at (``inf`` when unknown)."""
    if trainer.max_steps is not None and trainer.max_steps > 0:
        return trainer.max_steps
    try:
        return float(trainer.estimated_stepping_batches)
    except Exception:  # no data length known yet (an iterable dataset, ...)
        return math.inf


def log_interval(total: float) -> int:
    """Steps between two log lines: 10% of a run of ``total`` steps, at most ``DEFAULT_EVERY``."""
    if not math.isfinite(total):
        return DEFAULT_EVERY
    return max(1, min(DEFAULT_EVERY, math.ceil(total / 10)))


def duration(seconds: float) -> str:
    """``seconds`` as ``45s``, ``3m05s`` or ``2h03m``."""
    seconds = max(0, int(round(seconds)))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


class LogLines(ProgressBar):
    """A progress 'bar' of plain lines for output that is not a terminal, e.g.::

        step 120/300 (40%)  loss 2.3456  tok/s 10,706  elapsed 1m05s  ETA 1m38s
        step 200/300  held-out loss 2.1234

    Args:
        every_n_steps: optimizer steps between two lines; None = 10% of the run, at most 50.
        stream: where to print (default: ``sys.stdout`` at the time of printing).

    The loss is the last step's; tokens/s is the smoothed rate of the :class:`TokensPerSecond`
    callback (when the trainer has one); elapsed and ETA count this invocation's steps (a resumed
    run's ETA covers the steps still to run), validation time included.
    """

    def __init__(self, every_n_steps: int | None = None, stream: TextIO | None = None):
        super().__init__()
        if every_n_steps is not None and every_n_steps < 1:
            raise ValueError(f"progress every_n_steps must be >= 1 (or null for automatic), got {every_n_steps}")
        self.every_n_steps = every_n_steps
        self.stream = stream
        self._enabled = True
        self._start_step = 0
        self._start_time = 0.0
        self._total: float = math.inf
        self._every = DEFAULT_EVERY
        self._last_step: int | None = None

    # ---- ProgressBar interface --------------------------------------------------------------
    def disable(self) -> None:
        self._enabled = False

    def enable(self) -> None:
        self._enabled = True

    @property
    def is_enabled(self) -> bool:
        return self._enabled

    def print(self, *args: Any, **kwargs: Any) -> None:
        print(*args, **{"file": self.stream or sys.stdout, "flush": True, **kwargs})

    # ---- hooks ------------------------------------------------------------------------------
    def on_sanity_check_start(self, trainer, pl_module) -> None:
        self._total = total_steps(trainer)

    def on_train_start(self, trainer, pl_module) -> None:
        self._start_step = self._last_step = trainer.global_step
        self._start_time = time.perf_counter()
        self._total = total_steps(trainer)
        self._every = self.every_n_steps or log_interval(self._total)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if not self._enabled or step == self._last_step:  # gradient accumulation: no new step
            return
        self._last_step = step
        if step % self._every == 0 or step >= self._total:
            self.print(self.train_line(trainer, outputs))

    def on_validation_end(self, trainer, pl_module) -> None:
        history = getattr(pl_module, "val_history", None)
        if not self._enabled or not history or history[-1][0] != trainer.global_step:
            return
        self.print(f"step {trainer.global_step}{self._of_total()}  held-out loss {history[-1][1]:.4f}")

    # ---- the line -----------------------------------------------------------------------------
    def _of_total(self) -> str:
        return f"/{int(self._total)}" if math.isfinite(self._total) else ""

    def train_line(self, trainer, outputs) -> str:
        step = trainer.global_step
        parts = [f"step {step}{self._of_total()}"
                 + (f" ({100 * step / self._total:.0f}%)" if math.isfinite(self._total) else "")]
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if loss is not None:
            parts.append(f"loss {float(loss):.4f}")
        meter = next((c for c in trainer.callbacks if hasattr(c, "smoothed_rate")), None)
        rate = meter.smoothed_rate() if meter is not None else None
        if rate:
            parts.append(f"tok/s {rate:,.0f}")
        elapsed = time.perf_counter() - self._start_time
        parts.append(f"elapsed {duration(elapsed)}")
        done = step - self._start_step
        if done > 0 and math.isfinite(self._total):
            parts.append(f"ETA {duration(elapsed / done * max(0, self._total - step))}")
        return "  ".join(parts)


class ParamSummary(RichModelSummary):
    """Lightning's Rich model summary (names, types, parameters, mode) without the FLOPs column
    and the ``Total FLOPs`` line: Lightning counts FLOPs only for a model with an
    ``example_input_array`` and prints 0 otherwise."""

    @staticmethod
    def summarize(summary_data, total_parameters, trainable_parameters, model_size, total_training_modes,
                  total_flops, **summarize_kwargs) -> None:
        from lightning.pytorch.utilities.model_summary.model_summary import (
            get_formatted_model_size,
            get_human_readable_count,
        )
        from rich.console import Console
        from rich.table import Table

        columns = [(name, values) for name, values in summary_data if name != "FLOPs"]
        table = Table(header_style=summarize_kwargs.get("header_style", "bold magenta"))
        for index, (name, _) in enumerate(columns):
            table.add_column(name, justify="right" if name.startswith(("Params", "In ", "Out ")) else "left",
                             style="dim" if index == 0 else None)
        for row in zip(*(values for _, values in columns)):
            table.add_row(*row)
        console = Console()  # not Rich's global console, which a progress bar may have pointed elsewhere
        console.print(table)
        grid = Table.grid(expand=True)
        grid.add_column()
        rows = [("Trainable params", get_human_readable_count(int(trainable_parameters))),
                ("Non-trainable params", get_human_readable_count(int(total_parameters - trainable_parameters))),
                ("Total params", get_human_readable_count(int(total_parameters))),
                ("Total estimated model params size (MB)", get_formatted_model_size(model_size)),
                ("Modules in train mode", total_training_modes["train"]),
                ("Modules in eval mode", total_training_modes["eval"])]
        for name, value in rows:
            grid.add_row(f"[bold]{name}[/]: {value}")
        console.print(grid)


def fit_summary(start_step: int, end_step: int, seconds: float, history: list[tuple[int, float]],
                max_steps: int | None = None) -> list[str]:
    """The lines ``hybridzoo fit`` prints at its end: the steps this invocation ran (and the
    total when it resumed a run), its wall time, and the held-out loss history (which a resumed
    run restores from its checkpoint), or that no validation ran."""
    ran = end_step - start_step
    line = f"hybridzoo fit: {ran} step{'s' if ran != 1 else ''} in {seconds:.0f} s"
    if start_step:
        line += f", resumed at step {start_step}: {end_step} steps in total"
        if ran == 0 and max_steps and max_steps > 0 and end_step >= max_steps:
            line += f" (max_steps {max_steps} was already reached: raise --trainer.max_steps to train on)"
    lines = [line]
    if not history:
        lines.append("held-out loss: no validation ran")
        return lines
    (first_step, first), (last_step, last) = history[0], history[-1]
    if len(history) == 1:
        text = f"held-out loss: {first:.4f} (step {first_step})"
    else:
        text = (f"held-out loss: {first:.4f} (step {first_step}) -> {last:.4f} (step {last_step}), "
                f"{len(history)} validations")
    if last_step < end_step:
        text += f"; no validation ran after step {last_step}"
    lines.append(text)
    return lines
