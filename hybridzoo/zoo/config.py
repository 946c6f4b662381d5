"""``HybridConfig``: the whole description of a hybrid model, as a dataclass.

Serialises to JSON / YAML (``to_dict`` / ``from_dict``) and validates itself with clear
errors. The layer sequence is a pattern of mixer kinds, e.g. ``"gdn gdn gdn attn"``,
repeated to ``n_layers`` (the last repetition is cut short when ``n_layers`` is not a multiple of
the pattern's length; a pattern longer than ``n_layers`` is an error, since some of its layers
would never be built); each mixer kind has one settings block (``cfg.gdn``,
``cfg.attn``, ...) shared by all layers of that kind.
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hybridzoo.layers import MIXERS

MIXER_CONFIGS: dict[str, type] = {kind: config_cls for kind, (_, config_cls) in MIXERS.items()}
# the dataclass fields below name the same config classes (kept explicit for readers and tools)
from hybridzoo.layers import (  # noqa: E402
    AttentionConfig,
    GatedDeltaNetConfig,
    GLAConfig,
    Mamba1Config,
    Mamba2Config,
    RetNetConfig,
)


class ConfigError(ValueError):
    """A HybridConfig (or the dict/YAML it is built from) is invalid."""


@dataclass
class HybridConfig:
    """A hybrid language model: embedding -> blocks -> norm -> LM head.

    Attributes:
        vocab_size: number of token ids (256 = the byte-level tokenizer).
        d_model: width of the residual stream.
        n_layers: number of blocks.
        layers: the mixer pattern, a string of kinds (``"gdn gdn gdn attn"``) or a list,
            repeated to ``n_layers`` (the last repetition cut short if ``n_layers`` is not a
            multiple of its length); at most ``n_layers`` kinds long. Kinds: mamba1, mamba2, gla,
            retnet, gdn, attn.
        d_mlp: hidden width of each block's SwiGLU MLP; 0 = no MLP (pure Mamba stacks);
            None = ``8/3 · d_model`` rounded up to a multiple of 64.
        norm_eps: epsilon of every RMSNorm of the model.
        norm_zero_centered: RMSNorm weights stored as ``w - 1`` (Qwen3-Next / Qwen3.5 style).
        tie_embeddings: the LM head reuses the embedding matrix.
        init_std: std of the normal initialisation of embeddings, MLPs and the LM head
            (mixers keep their own published initialisation).
        backend: kernel backend of every mixer (``"auto"``, ``"reference"``, ...).
        mamba1 … attn: settings of each mixer kind (used only by layers of that kind).
    """

    vocab_size: int = 256
    d_model: int = 256
    n_layers: int = 4
    layers: str | list[str] = "gdn gdn gdn attn"
    d_mlp: int | None = None
    norm_eps: float = 1e-6
    norm_zero_centered: bool = False
    tie_embeddings: bool = True
    init_std: float = 0.02
    backend: str = "auto"
    mamba1: Mamba1Config = field(default_factory=Mamba1Config)
    mamba2: Mamba2Config = field(default_factory=Mamba2Config)
    gla: GLAConfig = field(default_factory=GLAConfig)
    retnet: RetNetConfig = field(default_factory=RetNetConfig)
    gdn: GatedDeltaNetConfig = field(default_factory=GatedDeltaNetConfig)
    attn: AttentionConfig = field(default_factory=AttentionConfig)

    def __post_init__(self) -> None:
        for kind, cls in MIXER_CONFIGS.items():
            block = getattr(self, kind)
            if isinstance(block, dict):
                setattr(self, kind, _build(cls, block, f"{kind}"))
            elif not isinstance(block, cls):
                raise ConfigError(f"HybridConfig.{kind} must be a {cls.__name__} or a dict, "
                                  f"got {type(block).__name__}")
        self.validate()

    # ---- the layer sequence -------------------------------------------------------------
    @property
    def pattern(self) -> list[str]:
        return self.layers.split() if isinstance(self.layers, str) else list(self.layers)

    def layer_kinds(self) -> list[str]:
        """The mixer kind of each of the ``n_layers`` blocks."""
        pattern = self.pattern
        return [pattern[i % len(pattern)] for i in range(self.n_layers)]

    @property
    def mlp_width(self) -> int:
        if self.d_mlp is None:
            return 64 * -(-(8 * self.d_model // 3) // 64)
        return self.d_mlp

    def validate(self) -> None:
        for name in ("vocab_size", "d_model", "n_layers"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"HybridConfig.{name} must be a positive int, got {value!r}")
        if self.d_mlp is not None and (not isinstance(self.d_mlp, int) or self.d_mlp < 0):
            raise ConfigError(f"HybridConfig.d_mlp must be None or an int >= 0, got {self.d_mlp!r}")
        if not isinstance(self.layers, (str, list, tuple)) or not self.pattern:
            raise ConfigError(f"HybridConfig.layers must be a non-empty string or list of mixer kinds, "
                              f"got {self.layers!r}")
        unknown = [kind for kind in self.pattern if kind not in MIXER_CONFIGS]
        if unknown:
            raise ConfigError(f"HybridConfig.layers: unknown mixer kind(s) {unknown}; "
                              f"choose from {list(MIXER_CONFIGS)}")
        if len(self.pattern) > self.n_layers:
            pattern = self.pattern
            raise ConfigError(f"HybridConfig.layers has {len(pattern)} mixer kinds ({' '.join(pattern)}) but "
                              f"n_layers is {self.n_layers}: the last {len(pattern) - self.n_layers} "
                              f"({' '.join(pattern[self.n_layers:])}) would never be built. Set n_layers to "
                              f"{len(pattern)} (or a multiple of it), or give at most {self.n_layers} kinds in layers")
        if not self.norm_eps > 0:
            raise ConfigError(f"HybridConfig.norm_eps must be > 0, got {self.norm_eps!r}")

    # ---- serialisation --------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        if isinstance(self.layers, tuple):
            out["layers"] = list(self.layers)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any], **overrides: Any) -> "HybridConfig":
        """Build from a plain dict; ``overrides`` replace fields (a dict for a mixer block
        is merged into that block)."""
        if not isinstance(data, dict):
            raise ConfigError(f"HybridConfig: expected a mapping, got {type(data).__name__}")
        merged = dict(data)
        for key, value in overrides.items():
            if key in MIXER_CONFIGS and isinstance(value, dict) and isinstance(merged.get(key), dict):
                merged[key] = {**merged[key], **value}
            else:
                merged[key] = value
        return _build(cls, merged, "HybridConfig")

    def to_json(self, path: str | Path | None = None) -> str:
        """Strict JSON (no ``Infinity`` / ``NaN`` literals): a non-finite float is written as the
        string ``"inf"``, ``"-inf"`` or ``"nan"``, which :meth:`from_json` reads back as the float."""
        text = json.dumps(finite_json(self.to_dict()), indent=2, allow_nan=False)
        if path is not None:
            Path(path).write_text(text + "\n")
        return text

    @classmethod
    def from_json(cls, path: str | Path) -> "HybridConfig":
        """Read a file written by :meth:`to_json`. Files of older hybridzoo versions, which wrote
        infinity as the non-standard literal ``Infinity``, are read with a warning to re-save them;
        any other non-standard JSON (``NaN``, duplicate keys, comments, ...) is a ConfigError."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"no config file at {path}")
        literals = []

        def constant(name: str) -> float:
            if name == "NaN":
                raise ConfigError(f"{path} is not standard JSON: it holds the literal NaN "
                                  f"(write a non-finite number as the string \"nan\", \"inf\" or \"-inf\")")
            literals.append(name)
            return float(name.replace("Infinity", "inf"))

        def no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
            keys = [key for key, _ in pairs]
            repeated = sorted({key for key in keys if keys.count(key) > 1})
            if repeated:
                raise ConfigError(f"{path} is not valid: the key(s) {repeated} appear more than once in one object")
            return dict(pairs)

        try:
            data = json.loads(path.read_text(encoding="utf-8"), parse_constant=constant,
                              object_pairs_hook=no_duplicates)
        except ConfigError:
            raise
        except UnicodeDecodeError as error:
            raise ConfigError(f"{path} is not UTF-8 text (JSON): {error}") from error
        except (ValueError, RecursionError) as error:  # bad JSON, a 5000-digit int, deep nesting
            raise ConfigError(f"{path} is not valid JSON: {error}") from error
        if literals:
            warnings.warn(f"{path} holds the non-standard JSON literal {literals[0]} (written by an older "
                          f"hybridzoo); read as a float. Re-save the checkpoint (save_pretrained) to write "
                          f"strict JSON", UserWarning, stacklevel=2)
        return cls.from_dict(data)

    def to_yaml(self) -> str:
        import yaml

        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    @classmethod
    def from_yaml(cls, text: str) -> "HybridConfig":
        import yaml

        return cls.from_dict(yaml.safe_load(text))


def _build(cls: type, data: dict[str, Any], where: str):
    """``cls(**data)`` with a clear error for unknown keys."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping, got {type(data).__name__}")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown}; known keys: {sorted(names)}")
    data = dict(data)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):  # JSON / YAML give lists where the dataclass keeps tuples
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        value = data.get(f.name)
        if isinstance(default, tuple) and isinstance(value, (list, tuple)):
            # a float in a tuple of floats may be written "inf" (strict JSON has no infinity)
            data[f.name] = tuple(_number(v, f"{where}.{f.name}") if isinstance(d, float) and isinstance(v, str) else v
                                 for d, v in zip(default, value)) + tuple(value[len(default):])
        elif isinstance(value, str) and _has_type(0.5, hints[f.name]) and not _has_type("", hints[f.name]):
            # PyYAML reads "1e-5" (no dot) as a string, strict JSON writes infinity as "inf"
            data[f.name] = _number(value, f"{where}.{f.name}")
    for name, value in data.items():
        if not _has_type(value, hints[name]):
            raise ConfigError(f"{where}.{name} must be {_type_name(hints[name])}, got {value!r}")
    try:
        return cls(**data)
    except ConfigError:
        raise
    except (TypeError, ValueError) as error:
        raise ConfigError(f"{where}: {error}") from error


def _number(value: str, where: str) -> float:
    """A float written as a string: ``"1e-5"`` (PyYAML reads it so), ``"inf"``, ``"-inf"``, ``"nan"``."""
    try:
        return float(value)
    except ValueError:
        raise ConfigError(f"{where} must be a number, got {value!r}") from None


def finite_json(value: Any) -> Any:
    """``value`` with every non-finite float replaced by the string ``"inf"``, ``"-inf"`` or
    ``"nan"`` (strict JSON has no literal for them)."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # 'inf', '-inf', 'nan'
    if isinstance(value, dict):
        return {key: finite_json(v) for key, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_json(v) for v in value]
    return value


def _has_type(value: Any, annotation: Any) -> bool:
    """Whether ``value`` (as JSON / YAML give it) fits a field annotation of these dataclasses:
    int (not bool, below 2**31), float (an int too), bool, str, ``X | None``, ``list[str]``, ``tuple[float, float]``
    or a mixer config (or its dict). A string ``"true"`` for a bool, ``2.5`` heads or a list of
    lists of kinds is refused here rather than building a wrong model or failing deep inside."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        return any(_has_type(value, arg) for arg in args)
    if annotation is type(None):
        return value is None
    if annotation is bool:
        return isinstance(value, bool)
    if annotation is int:  # sizes, counts and seeds: below 2**31 (a larger one overflows torch)
        return isinstance(value, int) and not isinstance(value, bool) and abs(value) < 2**31
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation is str:
        return isinstance(value, str)
    if origin is list:
        return isinstance(value, (list, tuple)) and all(_has_type(v, args[0]) for v in value)
    if origin is tuple:
        return (isinstance(value, (list, tuple)) and len(value) == len(args)
                and all(_has_type(v, a) for v, a in zip(value, args)))
    if dataclasses.is_dataclass(annotation):
        return isinstance(value, (annotation, dict))
    return True  # an annotation these configs do not use: left to the dataclass


def _type_name(annotation: Any) -> str:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return " or ".join(_type_name(arg) for arg in typing.get_args(annotation))
    if annotation is type(None):
        return "null"
    if isinstance(annotation, type):
        return {"int": "an int below 2**31", "float": "a number", "bool": "true or false", "str": "a string"}.get(
            annotation.__name__, f"a {annotation.__name__} (a mapping)")
    if typing.get_origin(annotation) is list:
        return "a list of strings"
    return "a list of two numbers"  # tuple[float, float], the only other annotation of these configs
