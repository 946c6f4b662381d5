"""Safetensors checkpoints: ``model.safetensors`` + ``config.json``. No pickles anywhere."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import torch

WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"


class CheckpointError(ValueError):
    """A checkpoint directory is missing a file, is corrupted, or does not match its config."""


def file_mode() -> int:
    """The permissions a newly created file gets under the current umask (0644 under 022)."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def write_atomically(directory: Path, writers: dict[str, Callable[[Path], object]]) -> None:
    """Write the files ``directory / name``: ``writers[name](path)`` writes one to ``path``, a
    temporary name (``name.tmp``); once all are written, each is renamed to its final name, so an
    interrupted write never leaves a half-written file under a final name. A write or rename that
    fails removes the temporary files and re-raises: files not yet renamed keep their old content.
    Every file gets the permissions of a normally created one (:func:`file_mode`)."""
    written = []
    try:
        for name, write in writers.items():
            tmp = directory / (name + ".tmp")
            written.append((tmp, directory / name))
            write(tmp)
            tmp.chmod(file_mode())
        for tmp, path in written:
            tmp.replace(path)
    except BaseException:
        for tmp, _ in written:
            tmp.unlink(missing_ok=True)
        raise


def _siblings(directory: Path) -> tuple[Path, Path]:
    """The two temporary siblings of a directory written by :func:`replace_directory`: the new
    content being written (``.NAME.partial``) and the old one being removed (``.NAME.old``)."""
    return directory.parent / f".{directory.name}.partial", directory.parent / f".{directory.name}.old"


def recover_directory(directory: Path) -> None:
    """Finish or undo a :func:`replace_directory` that was killed: a ``.NAME.old`` beside a
    complete ``NAME`` is deleted; a ``.NAME.old`` without ``NAME`` (killed between the two
    renames) is renamed back to ``NAME``; a ``.NAME.partial`` is deleted."""
    partial, old = _siblings(Path(directory))
    if old.exists():
        if directory.exists():
            shutil.rmtree(old)
        else:
            old.rename(directory)
    if partial.exists():
        shutil.rmtree(partial)


def replace_directory(directory: Path, writers: dict[str, Callable[[Path], object]]) -> None:
    """Write ``directory`` as one unit: each ``writers[name](path)`` writes ``path`` inside a
    temporary sibling folder (``.NAME.partial``); once all are written, an existing ``directory``
    is renamed aside (``.NAME.old``), the new folder renamed into place, and the old one deleted.
    A kill at any point leaves the old or the new folder complete (between the two renames, the
    old one as ``.NAME.old``, which the next call, :func:`recover_directory`, puts back); the next
    call also deletes the temporary folders a kill left. A write that fails deletes the new
    folder and re-raises, leaving ``directory`` as it was. Files get :func:`file_mode`."""
    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    recover_directory(directory)
    partial, old = _siblings(directory)
    try:
        partial.mkdir()
        for name, write in writers.items():
            write(partial / name)
            (partial / name).chmod(file_mode())
        if directory.exists():
            directory.rename(old)
            try:
                partial.rename(directory)
            except BaseException:
                old.rename(directory)
                raise
        else:
            partial.rename(directory)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    shutil.rmtree(old, ignore_errors=True)


def link_or_copy(source: Path, target: Path) -> None:
    """``target`` as a hard link to ``source`` (no copy: the file is not rewritten), else a copy."""
    try:
        os.link(source, target)
    except OSError:
        shutil.copyfile(source, target)


def checkpoint_dir(path: str | Path) -> Path:
    """The checkpoint directory that ``path`` names: ``path`` itself, or its folder when ``path``
    is the ``model.safetensors`` or ``config.json`` file inside it. Another file is an error."""
    path = Path(path)
    if path.is_file():
        if path.name in (WEIGHTS_NAME, CONFIG_NAME):
            return path.parent
        raise CheckpointError(f"{path} is a file; a checkpoint is the directory that holds {CONFIG_NAME} "
                              f"and {WEIGHTS_NAME} (pass that directory, e.g. {path.parent})")
    return path


def pretrained_writers(model) -> dict[str, Callable[[Path], object]]:
    """``{file name: writer(path)}`` of a checkpoint of ``model``: ``model.safetensors`` (a tied
    LM head stored once) and ``config.json`` (strict JSON)."""
    from safetensors.torch import save_file

    tensors = {name: t.detach().contiguous() for name, t in model.state_dict().items()}
    if model.config.tie_embeddings:
        tensors.pop("lm_head.weight", None)
    return {
        WEIGHTS_NAME: lambda path: save_file(tensors, str(path), metadata={"format": "pt", "library": "hybridzoo"}),
        CONFIG_NAME: lambda path: path.write_text(model.config.to_json() + "\n"),
    }


def save_pretrained(model, directory: str | Path) -> Path:
    """Write ``config.json`` and ``model.safetensors`` (a tied LM head is stored once).

    Files are written to temporary names and renamed, so an interrupted save never leaves a
    half-written file under the final names; other files in ``directory`` are left alone.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    write_atomically(directory, pretrained_writers(model))
    return directory


def load_pretrained(cls, directory: str | Path, device=None, dtype: torch.dtype | None = None,
                    dtype_cast: bool = False):
    """Build ``cls(config)`` from ``config.json`` and load ``model.safetensors`` strictly.

    ``directory`` may also be the ``model.safetensors`` or ``config.json`` file inside it.
    The model is float32, or ``dtype`` when given; floating-point tensors load into it whatever
    float dtype they were saved in (a bf16 / fp16 file widens exactly into float32; a float32
    file loaded with ``dtype=torch.bfloat16`` is rounded, as asked). A tensor whose dtype is
    of another kind than the model's (an int32 tensor where a float weight is expected, ...) is
    an error naming it, unless ``dtype_cast=True``, which casts it.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from hybridzoo.zoo.config import ConfigError, HybridConfig

    directory = checkpoint_dir(directory)
    if not directory.is_dir():
        _, old = _siblings(directory)
        hint = (f"; an interrupted export left the previous one in {old}: rename it to {directory}"
                if old.is_dir() else "")
        raise CheckpointError(f"checkpoint directory {directory} does not exist{hint}")
    config_path, weights_path = directory / CONFIG_NAME, directory / WEIGHTS_NAME
    for path in (config_path, weights_path):
        if not path.is_file():
            present = sorted(p.name for p in directory.iterdir())
            raise CheckpointError(f"{path} is missing (the directory holds {present}); "
                                  f"a checkpoint needs {CONFIG_NAME} and {WEIGHTS_NAME}")
    try:
        config = HybridConfig.from_json(config_path)
    except (ConfigError, json.JSONDecodeError) as error:
        raise CheckpointError(f"{config_path}: {error}") from error
    try:
        tensors = load_file(str(weights_path), device="cpu")
    except (SafetensorError, OSError, ValueError) as error:
        raise CheckpointError(f"{weights_path} is not a readable safetensors file "
                              f"(truncated or corrupted?): {error}") from error

    # built on meta, then every tensor comes from the file: this works because no module of
    # hybridzoo keeps a buffer outside its state_dict (tests/zoo/test_checkpoint.py checks it)
    try:
        with torch.device("meta"):
            model = cls(config)
    except (ValueError, ZeroDivisionError) as error:  # sizes a mixer refuses (heads, widths, ...)
        raise CheckpointError(f"{config_path}: {error}") from error
    expected = model.state_dict()
    if config.tie_embeddings:
        expected.pop("lm_head.weight", None)
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise CheckpointError(f"{weights_path} does not match {config_path}: "
                              f"missing keys {missing[:10]}{' …' if len(missing) > 10 else ''}, "
                              f"unexpected keys {unexpected[:10]}{' …' if len(unexpected) > 10 else ''}")
    for name, tensor in tensors.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise CheckpointError(f"{weights_path}: tensor {name!r} has shape {tuple(tensor.shape)}, "
                                  f"{config_path} implies {tuple(expected[name].shape)}")
        stored, wanted = tensor.dtype, expected[name].dtype
        if stored != wanted and not dtype_cast and not (stored.is_floating_point and wanted.is_floating_point):
            raise CheckpointError(f"{weights_path}: tensor {name!r} is stored as {_dtype_name(stored)}, the model "
                                  f"expects {_dtype_name(wanted)} (a file written for another model or by another tool?); "
                                  f"pass dtype_cast=True to from_pretrained to cast it anyway")
    model = model.to_empty(device="cpu")
    if dtype is not None:  # before loading: a float64 file loaded with dtype=torch.float64 stays exact
        model = model.to(dtype=dtype)
    model.load_state_dict(tensors, strict=False, assign=False)
    if config.tie_embeddings:
        model.lm_head.weight = model.embed.weight
    if device is not None:
        model = model.to(device=device)
    return model.eval()


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
