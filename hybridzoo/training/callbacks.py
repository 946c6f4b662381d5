"""Callbacks of ``hybridzoo fit``: the safetensors export and a tokens/s meter."""

from __future__ import annotations

import inspect
import json
import shutil
import time
from collections import deque
from functools import partial
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback

from hybridzoo.zoo.checkpoint import (
    CONFIG_NAME,
    WEIGHTS_NAME,
    link_or_copy,
    pretrained_writers,
    replace_directory,
)
from hybridzoo.zoo.config import finite_json

TRAINING_NAME = "training.json"


class ExportCallback(Callback):
    """Export the model as ``model.safetensors`` + ``config.json`` (``HybridLM.save_pretrained``),
    the data module's tokenizer files and ``training.json`` (data module class and arguments,
    step, validation losses: what ``hybridzoo eval`` needs) at every checkpoint save and at the
    end of fit.

    Args:
        dirpath: the export directory; None = ``<trainer.default_root_dir>/export`` (a fixed
            place, e.g. ``runs/tiny-hybrid/export``, whatever the logger's version folder).

    Only global rank 0 writes. An export is one unit: all its files are written into a
    temporary sibling folder, which then replaces the directory (:func:`replace_directory`), so
    a kill leaves the previous export or the new one, complete. It is written once per step:
    Lightning's ``save_last=True`` saves each checkpoint twice (the top-k file, then
    ``last.ckpt``), and the second save finds the export already written. When only
    ``training.json`` changed (fit ends at the step just exported, with a new validation), the
    other files are hard-linked from the previous export, not rewritten.
    """

    def __init__(self, dirpath: str | Path | None = None):
        self.dirpath = dirpath
        self.data_config: dict[str, Any] | None = None  # set by the CLI: the data section as parsed
        self.last_export: Path | None = None
        self._written: tuple[Path, int, str] | None = None  # (directory, step, training.json text)

    def export_dir(self, trainer: L.Trainer) -> Path:
        return Path(self.dirpath) if self.dirpath is not None else Path(trainer.default_root_dir) / "export"

    def on_fit_start(self, trainer, pl_module) -> None:
        if trainer.is_global_zero:
            check_export_dir(self.export_dir(trainer))  # before training, not at the first checkpoint

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        self.export(trainer, pl_module)

    def on_fit_end(self, trainer, pl_module) -> None:
        self.export(trainer, pl_module)

    def export(self, trainer: L.Trainer, pl_module: L.LightningModule) -> Path | None:
        """Write the export now (rank 0 only), unless this step's export, with the same
        ``training.json``, is already there."""
        if not trainer.is_global_zero or trainer.sanity_checking:
            return None
        directory = self.export_dir(trainer)
        datamodule = getattr(trainer, "datamodule", None)
        info = {
            "data": self.data_config or data_spec(datamodule),
            "global_step": trainer.global_step,
            "val_history": [{"step": step, "loss": loss} for step, loss in getattr(pl_module, "val_history", [])],
        }
        text = json.dumps(finite_json(info), indent=2, default=str, allow_nan=False) + "\n"
        step = trainer.global_step
        if self._written == (directory, step, text) and directory.is_dir():
            return directory  # the same export: Lightning saves a checkpoint twice with save_last=True
        check_export_dir(directory)
        if self._written is not None and self._written[:2] == (directory, step) and directory.is_dir():
            # the same weights: keep the files there (hard links), write the new training.json
            files = {p.name: partial(link_or_copy, p) for p in sorted(directory.iterdir())
                     if p.is_file() and p.name != TRAINING_NAME}
        else:
            files = dict(pretrained_writers(pl_module.model))
            files.update({path.name: partial(shutil.copyfile, path) for path in tokenizer_files(datamodule)})
        files[TRAINING_NAME] = lambda path: path.write_text(text)
        replace_directory(directory, files)
        self._written = (directory, step, text)
        self.last_export = directory
        return directory


def check_export_dir(directory: Path) -> None:
    """Refuse an export directory that holds something other than an export: an export replaces
    the whole folder, so it must be new, empty, or an export (``config.json``,
    ``model.safetensors`` or ``training.json``, and no subfolder)."""
    directory = Path(directory)
    if not directory.exists():
        return
    if not directory.is_dir():
        raise ValueError(f"export directory {directory} is a file; set --export.dirpath to a new or empty folder")
    entries = list(directory.iterdir())
    folders = sorted(p.name for p in entries if p.is_dir())
    names = {p.name for p in entries}
    if folders or (entries and not names & {WEIGHTS_NAME, CONFIG_NAME, TRAINING_NAME}):
        raise ValueError(f"export directory {directory} holds {sorted(names)[:5]}, not an export; an export "
                         f"replaces the whole folder: set --export.dirpath to a new or empty folder")


class TokensPerSecond(Callback):
    """Tokens per second: input tokens of all ranks per second of wall time, measured between
    consecutive training batches (data loading, forward, backward and optimizer), validation
    time left out.

    Logs ``train/tokens_per_s`` (each step's own rate) to the logger, and ``tok/s`` to the
    progress bar: the rate over the last ``window`` steps (their tokens over their time), which
    :meth:`smoothed_rate` also gives (for :class:`~hybridzoo.training.progress.LogLines`).
    """

    def __init__(self, window: int = 20):
        if window < 1:
            raise ValueError(f"TokensPerSecond: window must be >= 1, got {window}")
        self.window = window
        self._last: float | None = None
        self._recent: deque[tuple[int, float]] = deque(maxlen=window)  # (tokens, seconds) per step

    def smoothed_rate(self) -> float | None:
        """Tokens per second over the last ``window`` steps (None before the first step)."""
        seconds = sum(s for _, s in self._recent)
        return sum(t for t, _ in self._recent) / seconds if seconds > 0 else None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self._last is None:
            self._last = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        now = time.perf_counter()
        elapsed, self._last = now - self._last, now
        tokens = batch["input_ids"].numel() * trainer.world_size
        if elapsed > 0:
            self._recent.append((tokens, elapsed))
            batch_size = batch["input_ids"].shape[0]
            pl_module.log("train/tokens_per_s", tokens / elapsed, on_step=True, on_epoch=False, batch_size=batch_size)
            pl_module.log("tok/s", self.smoothed_rate(), prog_bar=True, logger=False, on_step=True, on_epoch=False,
                          batch_size=batch_size)

    def on_validation_start(self, trainer, pl_module) -> None:
        self._last = None  # do not count validation time as training time

    on_validation_end = on_validation_start


def tokenizer_files(datamodule) -> list[Path]:
    """The data module's tokenizer files (``[]`` for bytes or when it has none)."""
    method = getattr(datamodule, "tokenizer_files", None)
    return [Path(p) for p in method()] if callable(method) else []


def data_spec(datamodule) -> dict[str, Any] | None:
    """``{"class_path", "init_args"}`` of a data module, from its saved hyperparameters or else
    from the attributes named like its ``__init__`` arguments (JSON-serialisable values only)."""
    if datamodule is None:
        return None
    cls = type(datamodule)
    args = dict(getattr(datamodule, "hparams", {}) or {})
    if not args:
        for name in inspect.signature(cls.__init__).parameters:
            if name != "self" and hasattr(datamodule, name):
                args[name] = getattr(datamodule, name)
    init_args = {}
    for name, value in args.items():
        try:
            json.dumps(value)
        except TypeError:
            continue
        init_args[name] = value
    return {"class_path": f"{cls.__module__}.{cls.__qualname__}", "init_args": init_args}
