"""``HybridConfig``: the whole description of a hybrid model, as a dataclass.

Serialises to JSON / YAML (``to_dict`` / ``from_dict``) and validates itself with clear
errors. The layer sequence is a pattern of mixer kinds, e.g. ``"gdn gdn gdn attn"``,
repeated (and cut) to ``n_layers``; each mixer kind has one settings block (``cfg.gdn``,
``cfg.attn``, ...) shared by all layers of that kind.
"""

from __future__ import annotations

import dataclasses
import json
import math
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
            repeated and cut to ``n_layers``. Kinds: mamba1, mamba2, gla, retnet, gdn, attn.
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
        except json.JSONDecodeError as error:
            raise ConfigError(f"{path} is not valid JSON: {error}") from error
        except UnicodeDecodeError as error:
            raise ConfigError(f"{path} is not UTF-8 text (JSON): {error}") from error
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
    for f in dataclasses.fields(cls):  # JSON / YAML give lists where the dataclass keeps tuples
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        value = data.get(f.name)
        if isinstance(default, tuple) and isinstance(value, (list, tuple)):
            # a float in a tuple of floats may be written "inf" (strict JSON has no infinity)
            data[f.name] = tuple(_number(v, f"{where}.{f.name}") if isinstance(d, float) and isinstance(v, str) else v
                                 for d, v in zip(default, value)) + tuple(value[len(default):])
        elif isinstance(default, float) and isinstance(value, str):
            # PyYAML reads "1e-5" (no dot) as a string: accept it as the float it means
            data[f.name] = _number(value, f"{where}.{f.name}")
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
