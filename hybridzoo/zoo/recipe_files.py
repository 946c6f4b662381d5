"""Recipe files: a packaged recipe name or a YAML path, and its ``model.config`` section read
into a :class:`HybridConfig`.

A recipe is either the name of a file packaged in :mod:`hybridzoo.recipes` (``tiny-hybrid``)
or a path to a YAML file (LightningCLI format). Only its model section is read here::

    model:
      config:            # HybridConfig fields
        d_model: 256
        layers: gdn gdn gdn attn
        ...
    data: ...            # used by ``hybridzoo fit``
    trainer: ...

This module needs only :mod:`hybridzoo.zoo.config`: ``HybridLM.from_recipe`` reads recipes
through it, and :mod:`hybridzoo.zoo.recipes` (which builds models to count their parameters)
re-exports it.
"""

from __future__ import annotations

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
