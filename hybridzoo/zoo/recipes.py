"""Recipes: LightningCLI YAML files whose ``model.config`` section is a HybridConfig.

A recipe is either the name of a file packaged in :mod:`hybridzoo.recipes` (``tiny-hybrid``)
or a path to a YAML file. ``HybridLM.from_recipe`` reads only its model section::

    model:
      config:            # HybridConfig fields
        d_model: 256
        layers: gdn gdn gdn attn
        ...
    data: ...            # used by ``hybridzoo fit``
    trainer: ...

Packaged recipe names carry their nominal size (``mamba-130m``, ``qwen35-0.8b``):
:func:`nominal_parameters` reads it and :func:`recipe_table` lists each recipe with its real
parameter count, computed on the meta device (nothing is allocated).
"""

from __future__ import annotations

import re
from importlib import resources
from pathlib import Path
from typing import Any

from hybridzoo.zoo.config import ConfigError, HybridConfig


def recipe_names() -> list[str]:
    """Names of the packaged recipes, sorted."""
    folder = resources.files("hybridzoo.recipes")
    return sorted(p.name[: -len(".yaml")] for p in folder.iterdir() if p.name.endswith(".yaml"))


def recipe_path(name_or_path: str | Path) -> Path:
    """The YAML file of a packaged recipe name, or the given path if it is a file."""
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") or path.exists():
        if not path.is_file():
            raise FileNotFoundError(f"no recipe file at {path}")
        return path
    packaged = resources.files("hybridzoo.recipes") / f"{name_or_path}.yaml"
    if not packaged.is_file():
        raise FileNotFoundError(f"unknown recipe {str(name_or_path)!r}: not a file, and not one of "
                                f"the packaged recipes {recipe_names()}")
    return Path(str(packaged))


def load_recipe(name_or_path: str | Path) -> dict[str, Any]:
    import yaml

    path = recipe_path(name_or_path)
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as error:
        raise ConfigError(f"{path} is not valid YAML: {error}") from error
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a recipe must be a mapping with a 'model' section")
    return data


def load_recipe_config(name_or_path: str | Path, **overrides: Any) -> HybridConfig:
    """The HybridConfig of a recipe's ``model.config`` section, with ``overrides`` applied."""
    data = load_recipe(name_or_path)
    model = data.get("model")
    if not isinstance(model, dict):
        raise ConfigError(f"recipe {name_or_path}: no 'model' section")
    if "init_args" in model:  # LightningCLI's class_path / init_args form
        model = model["init_args"]
    if not isinstance(model.get("config"), dict):
        raise ConfigError(f"recipe {name_or_path}: no 'model.config' section")
    try:
        return HybridConfig.from_dict(model["config"], **overrides)
    except ConfigError as error:
        raise ConfigError(f"recipe {name_or_path}: {error}") from error


_SIZE = re.compile(r"(?:^|[-_])(\d+(?:\.\d+)?)([kmbt])(?=$|[-_])", re.IGNORECASE)
_SCALE = {"k": 10**3, "m": 10**6, "b": 10**9, "t": 10**12}


def nominal_parameters(name: str | Path) -> int | None:
    """The parameter count written in a recipe name, or None if it has none.

    ``"mamba-130m"`` -> 130_000_000, ``"qwen35-0.8b"`` -> 800_000_000, ``"tiny-hybrid"`` -> None.
    The size is a ``-``/``_``-separated part of the name (the last one if several): a number
    with a ``k``/``m``/``b``/``t`` suffix. A path counts by its file name without suffix.
    """
    stem = Path(str(name)).name
    stem = stem.rsplit(".", 1)[0] if stem.endswith((".yaml", ".yml")) else stem
    matches = _SIZE.findall(stem)
    if not matches:
        return None
    number, unit = matches[-1]
    return round(float(number) * _SCALE[unit.lower()])


def count_parameters(config: HybridConfig) -> int:
    """Number of distinct parameters of ``HybridLM(config)`` (a tied LM head counted once),
    computed by building the model on the meta device: no memory is allocated."""
    import torch

    from hybridzoo.zoo.model import HybridLM

    with torch.device("meta"):
        model = HybridLM(config)
    return sum(p.numel() for p in model.parameters())  # parameters() yields a tied weight once


def layers_summary(config: HybridConfig) -> str:
    """The layer sequence in short: ``"gdn gdn gdn attn x6"``, ``"mamba1 x24"``,
    ``"mamba1 attn x2 + mamba1"`` when ``n_layers`` cuts the pattern."""
    pattern = config.pattern
    repeats, rest = divmod(config.n_layers, len(pattern))
    parts = [f"{' '.join(pattern)} x{repeats}"] if repeats else []
    if rest:
        parts.append(" ".join(pattern[:rest]))
    return " + ".join(parts)


def recipe_table() -> list[dict[str, Any]]:
    """One row per packaged recipe, sorted by name, for ``hybridzoo recipes``.

    Each row is ``{"name", "layers", "d_model", "n_layers", "parameters"}``: the recipe name,
    :func:`layers_summary` of its layer pattern, its width and depth, and its exact parameter
    count (all parameters, embeddings included, a tied LM head counted once), computed on the
    meta device so that even the large recipes cost no memory.
    """
    rows = []
    for name in recipe_names():
        config = load_recipe_config(name)
        rows.append({
            "name": name,
            "layers": layers_summary(config),
            "d_model": config.d_model,
            "n_layers": config.n_layers,
            "parameters": count_parameters(config),
        })
    return rows
