"""Callbacks of ``hybridzoo fit``: the safetensors export and a tokens/s meter."""

from __future__ import annotations

import inspect
import json
import shutil
import time
from functools import partial
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback

from hybridzoo.zoo.checkpoint import write_atomically

TRAINING_NAME = "training.json"


class ExportCallback(Callback):
    """Export the model as ``model.safetensors`` + ``config.json`` (``HybridLM.save_pretrained``),
    the data module's tokenizer files and ``training.json`` (data module class and arguments,
    step, validation losses: what ``hybridzoo eval`` needs) at every checkpoint save and at the
    end of fit.

    Args:
        dirpath: the export directory; None = ``<trainer.default_root_dir>/export`` (a fixed
            place, e.g. ``runs/tiny-hybrid/export``, whatever the logger's version folder).

    Only global rank 0 writes; each file is written under a temporary name and renamed, so an
    interrupted export never leaves a half-written file under a final name.
    """

    def __init__(self, dirpath: str | Path | None = None):
        self.dirpath = dirpath
        self.data_config: dict[str, Any] | None = None  # set by the CLI: the data section as parsed
        self.last_export: Path | None = None
        self._exported_step: int | None = None

    def export_dir(self, trainer: L.Trainer) -> Path:
        return Path(self.dirpath) if self.dirpath is not None else Path(trainer.default_root_dir) / "export"

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        self.export(trainer, pl_module)

    def on_fit_end(self, trainer, pl_module) -> None:
        self.export(trainer, pl_module, weights=self._exported_step != trainer.global_step)

    def export(self, trainer: L.Trainer, pl_module: L.LightningModule, weights: bool = True) -> Path | None:
        """Write the export now (rank 0 only); ``weights=False`` rewrites only training.json."""
        if not trainer.is_global_zero or trainer.sanity_checking:
            return None
        directory = self.export_dir(trainer)
        datamodule = getattr(trainer, "datamodule", None)
        files = {}
        if weights or self.last_export != directory:  # else both are there already
            pl_module.model.save_pretrained(directory)
            files = {path.name: partial(shutil.copyfile, path) for path in tokenizer_files(datamodule)}
        info = {
            "data": self.data_config or data_spec(datamodule),
            "global_step": trainer.global_step,
            "val_history": [{"step": step, "loss": loss} for step, loss in getattr(pl_module, "val_history", [])],
        }
        files[TRAINING_NAME] = lambda path: path.write_text(json.dumps(info, indent=2, default=str) + "\n")
        write_atomically(directory, files)
        self.last_export, self._exported_step = directory, trainer.global_step
        return directory


class TokensPerSecond(Callback):
    """Log ``train/tokens_per_s``: input tokens of all ranks per second of wall time, measured
    between consecutive training batches (data loading, forward, backward and optimizer)."""

    def __init__(self):
        self._last: float | None = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self._last is None:
            self._last = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        now = time.perf_counter()
        elapsed, self._last = now - self._last, now
        tokens = batch["input_ids"].numel() * trainer.world_size
        if elapsed > 0:
            rate, batch_size = tokens / elapsed, batch["input_ids"].shape[0]
            pl_module.log("train/tokens_per_s", rate, on_step=True, on_epoch=False, batch_size=batch_size)
            pl_module.log("tok/s", rate, prog_bar=True, logger=False, on_step=True, on_epoch=False,
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
