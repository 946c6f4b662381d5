"""Safetensors checkpoints: ``model.safetensors`` + ``config.json``. No pickles anywhere."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch

WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"


class CheckpointError(ValueError):
    """A checkpoint directory is missing a file, is corrupted, or does not match its config."""


def write_atomically(directory: Path, writers: dict[str, Callable[[Path], object]]) -> None:
    """Write the files ``directory / name``: ``writers[name](path)`` writes one to ``path``, a
    temporary name (``name.tmp``); once all are written, each is renamed to its final name, so an
    interrupted write never leaves a half-written file under a final name. A write or rename that
    fails removes the temporary files and re-raises: files not yet renamed keep their old content."""
    written = []
    try:
        for name, write in writers.items():
            tmp = directory / (name + ".tmp")
            written.append((tmp, directory / name))
            write(tmp)
        for tmp, path in written:
            tmp.replace(path)
    except BaseException:
        for tmp, _ in written:
            tmp.unlink(missing_ok=True)
        raise


def save_pretrained(model, directory: str | Path) -> Path:
    """Write ``config.json`` and ``model.safetensors`` (a tied LM head is stored once).

    Files are written to temporary names and renamed, so an interrupted save never leaves a
    half-written checkpoint under the final names.
    """
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.detach().contiguous() for name, t in model.state_dict().items()}
    if model.config.tie_embeddings:
        tensors.pop("lm_head.weight", None)
    write_atomically(directory, {
        WEIGHTS_NAME: lambda path: save_file(tensors, str(path), metadata={"format": "pt", "library": "hybridzoo"}),
        CONFIG_NAME: lambda path: path.write_text(model.config.to_json() + "\n"),
    })
    return directory


def load_pretrained(cls, directory: str | Path, device=None, dtype: torch.dtype | None = None):
    """Build ``cls(config)`` from ``config.json`` and load ``model.safetensors`` strictly."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from hybridzoo.zoo.config import ConfigError, HybridConfig

    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"checkpoint directory {directory} does not exist")
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
    model = model.to_empty(device="cpu")
    model.load_state_dict(tensors, strict=False, assign=False)
    if config.tie_embeddings:
        model.lm_head.weight = model.embed.weight
    if dtype is not None or device is not None:
        model = model.to(device=device, dtype=dtype)
    return model.eval()
