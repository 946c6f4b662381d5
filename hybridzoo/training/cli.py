"""``hybridzoo fit / validate / test``: a LightningCLI around :class:`LanguageModel`.

    hybridzoo fit --config tiny-hybrid                       # a packaged recipe name ...
    hybridzoo fit --config my.yaml --config more.yaml        # ... or paths, several allowed
    hybridzoo fit --config tiny-hybrid --trainer.max_steps 50 --data.init_args.seq_len 128
    hybridzoo fit --config tiny-hybrid --ckpt_path last      # resume the newest checkpoint
    hybridzoo fit --config tiny-hybrid --print_config

What this adds to a plain LightningCLI:

- ``--config NAME`` accepts packaged recipe names (``hybridzoo recipes`` lists them).
- The data module is chosen by ``data.class_path`` (``TextDataModule``, the default, or
  ``MQARDataModule``); its ``vocab_size`` is linked into ``model.config.vocab_size``.
- Defaults: precision ``bf16-mixed`` when CUDA is available, else ``32-true``;
  ``gradient_clip_val`` 1.0; ``seed_everything`` 0; a Rich progress bar; ``train/tokens_per_s``.
- ``export.dirpath``: the :class:`ExportCallback` writes ``model.safetensors`` + ``config.json``
  (+ tokenizer files, ``training.json``) at each checkpoint and at the end of fit, by default
  into ``<trainer.default_root_dir>/export``.
- ``--ckpt_path last`` finds the newest ``*.ckpt`` under ``trainer.default_root_dir`` (Lightning
  alone looks only in the new run's own version folder, where there is none yet).
- A new run (no ``--ckpt_path``) into a ``trainer.default_root_dir`` that already holds an export
  or checkpoints is refused before anything is written, unless ``--overwrite true``.
- Progress: the Rich bar on a terminal, else (a log file) a plain line every
  ``--progress.every_n_steps`` steps (default 10% of the run, at most 50); ``--progress.plain``
  forces either.
- At the end of fit: the steps this invocation ran (and the total after a resume), its wall time,
  the held-out loss history (kept in the checkpoints across restarts) and where the export is.
- Bad input (an unknown key or mixer, a missing data path, ...) ends with one clear error
  line and exit status 2, before anything is written.
"""

from __future__ import annotations

import logging
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Optional

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelSummary, ProgressBar
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

from hybridzoo.cli_errors import user_error_exit, user_errors
from hybridzoo.training.callbacks import ExportCallback, TokensPerSecond, check_export_dir
from hybridzoo.training.data import TextDataModule  # imported: short class_path names resolve
from hybridzoo.training.module import LanguageModel
from hybridzoo.training.progress import LogLines, ParamSummary, StepProgressBar, fit_summary

# Lightning notices that say nothing about the user's run
_QUIET = (
    r".*LightningCLI's args parameter is intended.*",
    r".*`tensorboardX` has been removed as a dependency.*",
    r".*isinstance\(treespec, LeafSpec\)` is deprecated.*",
    r".*is smaller than the logging interval.*",
    r".*does not have many workers which may be a bottleneck.*",
    r".*Checkpoint directory .* exists and is not empty.*",
    r".*The dirpath has changed from .* won't be reloaded.*",  # resuming into a new version folder
)


class OneLineErrorParser(LightningArgumentParser):
    """LightningCLI's parser, whose parse errors are one line (the message, then where the options
    are listed) instead of the full usage text before it: ``argparse.ArgumentParser.error`` is the
    method argparse documents for overriding. Errors that jsonargparse handles itself
    (``exit_on_error=False``, its debug mode) go to the parent class unchanged."""

    def error(self, message: str, ex: Exception | None = None):
        if not self.exit_on_error or os.environ.get("JSONARGPARSE_DEBUG"):
            return super().error(message, ex)
        parser = getattr(ex, "subcommand_parser", None) or self
        prog = parser.prog.replace(" [options]", "")
        flat = _shorter(" ".join(line.strip() for line in str(message).splitlines() if line.strip()))
        sys.stderr.write(f"{prog}: error: {flat} (see {prog} --help)\n")
        self.exit(2)


def _shorter(message: str) -> str:
    """jsonargparse's message for a bad ``data.init_args`` value lists every subtype of the data
    argument's Union; keep the part about the class that was given."""
    import re

    found = re.search(r"Problem with given class_path '([^']+)': (.*?)( - Expected a <class 'NoneType'>.*)?$",
                      message)
    return f"{found.group(2)} (in {found.group(1)})" if found else message


class HybridLightningCLI(LightningCLI):
    """LightningCLI with ``LanguageModel``, a data module chosen by ``data.class_path`` and the
    hybridzoo defaults (see the module docstring). ``args``: the argument list after the
    program name, e.g. ``["fit", "--config", "recipe.yaml"]``."""

    def __init__(self, args: list[str] | None = None, run: bool = True):
        self.started = time.perf_counter()
        super().__init__(
            LanguageModel,
            L.LightningDataModule,
            subclass_mode_data=True,
            seed_everything_default=0,
            auto_configure_optimizers=False,
            save_config_kwargs={"overwrite": True},
            parser_kwargs={"default_env": False, "prog": "hybridzoo"},
            parser_class=OneLineErrorParser,
            args=args,
            run=run,
        )

    # ---- parser ---------------------------------------------------------------------------
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_lightning_class_args(ExportCallback, "export")
        parser.add_argument("--overwrite", type=bool, default=False,
                            help="fit: start a new run even where trainer.default_root_dir already holds an "
                                 "export or checkpoints (the export is replaced)")
        parser.add_argument("--progress.plain", type=Optional[bool], default=None,
                            help="plain log lines instead of the progress bar; null = when stdout is not a terminal")
        parser.add_argument("--progress.every_n_steps", type=Optional[int], default=None,
                            help="steps between plain log lines; null = 10%% of the run, at most 50")
        parser.set_defaults({
            "trainer.precision": "bf16-mixed" if torch.cuda.is_available() else "32-true",
            "trainer.gradient_clip_val": 1.0,
            "data": {"class_path": f"{TextDataModule.__module__}.{TextDataModule.__qualname__}"},
        })
        parser.link_arguments("data", "model.config.vocab_size", compute_fn=_data_vocab_size,
                              apply_on="instantiate")

    # ---- instantiation --------------------------------------------------------------------
    def before_instantiate_classes(self) -> None:
        config = self.config.get(str(self.subcommand), self.config)
        if config.get("ckpt_path") == "last":
            root = Path(config.trainer.default_root_dir or ".")
            found = find_last_checkpoint(root)
            if found is None:
                what = "starting from scratch" if self.subcommand == "fit" else "using the initial weights"
                print(f"hybridzoo {self.subcommand}: --ckpt_path last: no checkpoint under {root}; {what}",
                      file=sys.stderr)
            config.ckpt_path = str(found) if found else None

    def instantiate_trainer(self, **kwargs) -> L.Trainer:
        trainer_config = self._get(self.config_init, "trainer", default={})
        progress = self._get(self.config_init, "progress", default=None) or {}
        callbacks = trainer_config.get("callbacks") or []
        callbacks = list(callbacks) if isinstance(callbacks, (list, tuple)) else [callbacks]
        if not any(isinstance(c, TokensPerSecond) for c in callbacks):
            callbacks.append(TokensPerSecond())
        if trainer_config.get("enable_progress_bar") is not False and not any(
                isinstance(c, ProgressBar) for c in callbacks):
            plain = progress.get("plain")
            if plain is None:
                plain = not sys.stdout.isatty()  # a log file: the Rich bar would print only at the end
            callbacks.append(LogLines(progress.get("every_n_steps")) if plain else StepProgressBar())
        if trainer_config.get("enable_model_summary") is not False and not any(
                isinstance(c, ModelSummary) for c in callbacks):
            callbacks.append(ParamSummary())
        return super().instantiate_trainer(**{"callbacks": callbacks, **kwargs})

    def after_instantiate_classes(self) -> None:
        config = self.config.get(str(self.subcommand), self.config)
        export = self.export_callback()
        if self.subcommand == "fit":
            if export is not None:  # a folder of other files, which the export would replace
                check_export_dir(export.export_dir(self.trainer))
            if not config.get("ckpt_path") and not config.get("overwrite"):
                refuse_to_overwrite(self.trainer, export)
        if export is not None:
            data = config.get("data")
            export.data_config = _plain(data) if data is not None else None

    def export_callback(self) -> ExportCallback | None:
        trainer = getattr(self, "trainer", None)
        return next((c for c in (trainer.callbacks if trainer else []) if isinstance(c, ExportCallback)), None)

    # ---- after fit ------------------------------------------------------------------------
    def after_fit(self) -> None:
        if not self.trainer.is_global_zero:
            return
        lines = fit_summary(getattr(self.model, "start_step", 0), self.trainer.global_step,
                            time.perf_counter() - self.started, getattr(self.model, "val_history", []),
                            self.trainer.max_steps)
        print("\n" + "\n".join(lines))
        export = self.export_callback()
        if export is not None and export.last_export is not None:
            print(f"export: {export.last_export}  (hybridzoo eval {export.last_export}; "
                  f"hybridzoo generate {export.last_export} --prompt ...)")


class RunExistsError(ValueError):
    """``hybridzoo fit`` would start a new run over an existing run's export or checkpoints."""


def refuse_to_overwrite(trainer: L.Trainer, export: ExportCallback | None) -> None:
    """Raise :class:`RunExistsError` when a new run (no ``--ckpt_path``, no ``--overwrite``) would
    write where a run already left an export or Lightning checkpoints: the export directory, the
    ``*.ckpt`` files under ``trainer.default_root_dir`` (four folders deep, where Lightning's
    loggers put them) or in a ModelCheckpoint's own ``dirpath``."""
    root = Path(trainer.default_root_dir)
    found = []
    if export is not None:
        directory = export.export_dir(trainer)
        if directory.is_dir() and any(directory.iterdir()):
            found.append(f"an export in {directory}")
    places = [root] + [Path(cb.dirpath) for cb in trainer.checkpoint_callbacks if getattr(cb, "dirpath", None)]
    checkpoints = {p for place in places for depth in range(5) for p in place.glob("*/" * depth + "*.ckpt")}
    if checkpoints:
        found.append(f"{len(checkpoints)} checkpoint{'s' if len(checkpoints) > 1 else ''}")
    if found:
        raise RunExistsError(f"{root} already holds a run ({' and '.join(found)}); a new run would overwrite it: "
                             f"resume it with --ckpt_path last, start over with --overwrite true, or train "
                             f"elsewhere with --trainer.default_root_dir DIR")


def find_last_checkpoint(root: Path) -> Path | None:
    """The newest ``*.ckpt`` file under ``root`` (by modification time), or None."""
    candidates = [p for p in Path(root).rglob("*.ckpt") if p.is_file()] if Path(root).is_dir() else []
    return max(candidates, key=lambda p: p.stat().st_mtime_ns, default=None)


def _data_vocab_size(datamodule) -> int:
    vocab = getattr(datamodule, "vocab_size", None)
    if not isinstance(vocab, int) or vocab <= 0:
        raise ValueError(f"{type(datamodule).__name__}.vocab_size is {vocab!r}: the data module must know "
                         f"its vocabulary size before setup() so that the model can be built")
    return vocab


def _plain(value):
    """A jsonargparse Namespace (or anything nested in one) as plain dicts and lists."""
    if hasattr(value, "as_dict"):
        value = value.as_dict()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items() if not k.startswith("__")}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    return value


def resolve_configs(argv: list[str]) -> list[str]:
    """Replace each ``--config NAME`` / ``-c NAME`` / ``--config=NAME`` whose value is a
    packaged recipe name (not a file) by the recipe's path; a config file that is not valid YAML
    is a ``ValueError`` naming the file and the line (jsonargparse names neither file nor path)."""
    from hybridzoo.zoo.recipes import recipe_path

    def resolve(value: str) -> str:
        if any(ch in value for ch in "{}:\n") and not Path(value).exists():
            return value  # an inline YAML/JSON config, left to jsonargparse
        path = recipe_path(value)
        check_yaml_file(path)
        return str(path)

    out, i = [], 0
    while i < len(argv):
        arg = argv[i]
        if arg in ("--config", "-c") and i + 1 < len(argv):
            out += [arg, resolve(argv[i + 1])]
            i += 2
            continue
        if arg.startswith("--config="):
            arg = "--config=" + resolve(arg[len("--config="):])
        out.append(arg)
        i += 1
    return out


def check_yaml_file(path: str | Path) -> None:
    """Raise ``ValueError`` naming ``path``, the line and the column when the file is not valid
    UTF-8 YAML."""
    import yaml

    try:
        yaml.safe_load(Path(path).read_bytes().decode("utf-8"))  # as jsonargparse reads it
    except yaml.MarkedYAMLError as error:
        mark = error.problem_mark or error.context_mark
        where = f", line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        context = ""
        if error.context and error.context_mark is not None:
            context = (f"{error.context} started at line {error.context_mark.line + 1}, column "
                       f"{error.context_mark.column + 1}: ")
        raise ValueError(f"{path}{where}: not valid YAML ({context}{error.problem})") from None
    except (yaml.YAMLError, UnicodeDecodeError) as error:  # e.g. bytes that are not UTF-8 text
        raise ValueError(f"{path}: not valid YAML ({' '.join(str(error).split())})") from None


def keep_negative_values(argv: list[str]) -> list[str]:
    """``--name -1e-3`` as ``--name=-1e-3``: argparse takes an argument that starts with ``-`` and
    is not a plain negative number (``-1e-3``, ``-inf``) for an option, so that the option would
    lack its value. Any argument that Python reads as a number is kept as the value of the option
    before it."""
    out, i = [], 0
    while i < len(argv):
        arg = argv[i]
        if (arg.startswith("--") and "=" not in arg and i + 1 < len(argv)
                and argv[i + 1].startswith("-") and _is_number(argv[i + 1])):
            out.append(f"{arg}={argv[i + 1]}")
            i += 2
            continue
        out.append(arg)
        i += 1
    return out


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


class _NoTips(logging.Filter):
    NOTICES = ("💡 Tip", "Trainer already configured with model summary callbacks")

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.NOTICES)


def quiet_lightning() -> None:
    """Silence Lightning notices that say nothing about the user's run (advertising tips,
    the optional TensorBoard, ...)."""
    for pattern in _QUIET:
        warnings.filterwarnings("ignore", message=pattern)
    logger = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    if not any(isinstance(f, _NoTips) for f in logger.filters):
        logger.addFilter(_NoTips())


def main(argv: list[str]) -> int:
    """Run ``fit`` / ``validate`` / ``test`` (``argv[0]``) with the rest of ``argv``."""
    quiet_lightning()
    os.environ.setdefault("JSONARGPARSE_DEPRECATION_WARNINGS", "off")  # Lightning's use, not the user's
    command = argv[0] if argv else "fit"
    errors = user_errors()
    try:
        # an unknown recipe: FileNotFoundError; a config that is not YAML: ValueError
        HybridLightningCLI(args=keep_negative_values(resolve_configs(list(argv))))
    except errors as error:
        return user_error_exit(command, error, errors)
    except SystemExit as error:  # jsonargparse: --help, --print_config, parse errors
        return error.code if isinstance(error.code, int) else (0 if error.code is None else 2)
    return 0
