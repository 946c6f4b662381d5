"""Recipes: LightningCLI YAML files whose ``model.config`` section is a HybridConfig.

Finding and reading recipe files is :mod:`hybridzoo.zoo.recipe_files` (re-exported here:
:func:`recipe_names`, :func:`recipe_path`, :func:`load_recipe`, :func:`load_recipe_config`).
This module adds what needs the model: packaged recipe names carry their nominal size
(``mamba-130m``, ``qwen35-0.8b``): :func:`nominal_parameters` reads it and
:func:`recipe_table` lists each recipe with its real parameter count, computed on the meta
device (nothing is allocated).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from hybridzoo.zoo.config import HybridConfig
from hybridzoo.zoo.recipe_files import load_recipe, load_recipe_config, recipe_names, recipe_path

__all__ = ["count_parameters", "layers_summary", "load_recipe", "load_recipe_config", "nominal_parameters",
           "recipe_names", "recipe_path", "recipe_table"]


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
