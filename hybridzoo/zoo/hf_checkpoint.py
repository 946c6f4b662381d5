"""Reading a local Hugging Face checkpoint directory into a :class:`HybridLM`: the mapping.

The entry points are ``HybridLM.from_hf`` and :mod:`hybridzoo.zoo.convert` (``from_hf``,
``convert_checkpoint``); both call :func:`load_hf` here with the model class to build, so this
module never imports :mod:`hybridzoo.zoo.model` (as :mod:`hybridzoo.zoo.checkpoint` does for
``from_pretrained``).

``load_hf(HybridLM, path)`` reads ``config.json`` and the ``*.safetensors`` files (a sharded checkpoint
through ``model.safetensors.index.json``) of one of these architectures (transformers 5.x names
and layouts; nothing is downloaded and transformers is not needed):

==================================== ================================================================
``architectures`` in config.json     HybridLM
==================================== ================================================================
``MambaForCausalLM``                 ``mamba1`` blocks, one RMSNorm per block, no MLP (``d_mlp=0``)
``Mamba2ForCausalLM``                ``mamba2`` blocks, one RMSNorm per block, no MLP (``d_mlp=0``)
``Qwen3NextForCausalLM``             ``gdn`` / ``attn`` blocks from ``layer_types``, SwiGLU MLPs,
                                     zero-centred RMSNorms ``(1 + w)``; dense MLPs only (see below)
``Qwen3_5ForCausalLM``               the same for Qwen3.5's text model (always dense)
``Qwen3_5ForConditionalGeneration``  the text model of a multimodal Qwen3.5 checkpoint: its
                                     ``text_config``, tensors under ``model.language_model.``;
                                     the vision tower (``model.visual.*``) is dropped
==================================== ================================================================

Mapping (HF -> ours): ``embed_tokens`` / ``backbone.embeddings`` -> ``embed``; per layer
``input_layernorm`` / ``norm`` -> ``mixer_norm``, ``post_attention_layernorm`` -> ``mlp_norm``,
``linear_attn`` -> a ``gdn`` mixer (:func:`hybridzoo.layers.gated_deltanet.convert_hf_weights`:
Qwen3-Next's fused ``in_proj_qkvz`` / ``in_proj_ba`` are de-interleaved), ``self_attn`` -> an
``attn`` mixer (gated attention, zero-centred q/k norms, partial rotary), ``mixer`` -> a
``mamba1`` / ``mamba2`` mixer (same names), ``mlp.{gate,up,down}_proj`` -> the SwiGLU;
``norm`` / ``norm_f`` -> ``norm``; ``lm_head`` (or the embedding when ``tie_word_embeddings``).
Depthwise conv weights ``[C, 1, W]`` become ``[C, W]``. Multi-token-prediction heads
(``mtp.*``) are dropped. Every other tensor must be used: a leftover or missing tensor is a
:class:`ConversionError` naming it.

Mixture of experts: **not supported.** HybridLM's blocks have dense SwiGLU MLPs only. A
Qwen3-Next layer ``i`` is MoE when ``num_experts > 0``, ``i`` is not in ``mlp_only_layers`` and
``(i + 1) % decoder_sparse_step == 0``; the defaults (``num_experts=512``,
``decoder_sparse_step=1``) make every layer MoE, and so are all released Qwen3-Next checkpoints
(e.g. Qwen3-Next-80B-A3B): such configurations, and Qwen3.5-MoE, raise :class:`ConversionError`.
Configurations with ``num_experts=0`` or every layer in ``mlp_only_layers`` convert exactly.

RoPE: the default rotary only (``rope_type`` ``"default"``; ``rope_theta`` and
``partial_rotary_factor`` from ``rope_parameters`` or the legacy top-level keys). Qwen3.5's
M-RoPE is plain RoPE for text tokens (equal temporal/height/width positions), which is what
HybridLM computes; image/video positions are out of scope.

Precision: parameters are cast to one dtype (default: that of the checkpoint's embedding
matrix); non-persistent buffers (rotary frequencies) stay float32. HF Mamba's
``residual_in_fp32`` is not reproduced (our residual stream is in the model dtype): identical in
float32, rounding-level differences in bfloat16.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from hybridzoo.layers import AttentionConfig, GatedDeltaNetConfig, Mamba1Config, Mamba2Config
from hybridzoo.layers.gated_deltanet import convert_hf_weights
from hybridzoo.zoo.config import ConfigError, HybridConfig

if TYPE_CHECKING:
    from hybridzoo.zoo.model import HybridLM

SUPPORTED_ARCHITECTURES = ("MambaForCausalLM", "Mamba2ForCausalLM", "Qwen3NextForCausalLM",
                           "Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration")
_BY_MODEL_TYPE = {"mamba": "MambaForCausalLM", "mamba2": "Mamba2ForCausalLM",
                  "qwen3_next": "Qwen3NextForCausalLM", "qwen3_5_text": "Qwen3_5ForCausalLM",
                  "qwen3_5": "Qwen3_5ForConditionalGeneration"}
_MOE_MESSAGE = ("mixture-of-experts MLPs are not supported: HybridLM's blocks have dense SwiGLU "
                "MLPs only")
_REFUSED = {"Qwen3_5MoeForCausalLM": _MOE_MESSAGE, "Qwen3_5MoeForConditionalGeneration": _MOE_MESSAGE,
            "qwen3_5_moe": _MOE_MESSAGE, "qwen3_5_moe_text": _MOE_MESSAGE}

# transformers 5.24's defaults for the keys read below (used when config.json omits one)
_MAMBA_DEFAULTS = dict(vocab_size=50280, hidden_size=768, state_size=16, num_hidden_layers=32,
                       layer_norm_epsilon=1e-5, expand=2, conv_kernel=4, use_bias=False,
                       use_conv_bias=True, hidden_act="silu", time_step_rank="auto",
                       tie_word_embeddings=True)
_MAMBA2_DEFAULTS = dict(num_heads=128, head_dim=64, vocab_size=32768, hidden_size=4096,
                        state_size=128, num_hidden_layers=64, layer_norm_epsilon=1e-5, expand=2,
                        conv_kernel=4, n_groups=8, use_bias=False, use_conv_bias=True,
                        hidden_act="silu", time_step_limit=(0.0, float("inf")), chunk_size=256,
                        tie_word_embeddings=False)
_QWEN_DEFAULTS = dict(hidden_act="silu", rms_norm_eps=1e-6, tie_word_embeddings=False,
                      attention_bias=False, head_dim=256, linear_conv_kernel_dim=4,
                      linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16,
                      linear_num_value_heads=32, num_attention_heads=16)
_QWEN3_NEXT_DEFAULTS = dict(_QWEN_DEFAULTS, vocab_size=151936, hidden_size=2048,
                            intermediate_size=5632, num_hidden_layers=48, num_key_value_heads=2,
                            decoder_sparse_step=1, num_experts=512, mlp_only_layers=[])
_QWEN3_5_DEFAULTS = dict(_QWEN_DEFAULTS, vocab_size=248320, hidden_size=4096,
                         intermediate_size=12288, num_hidden_layers=32, num_key_value_heads=4)
_LAYER_KINDS = {"linear_attention": "gdn", "full_attention": "attn"}


class ConversionError(ValueError):
    """A Hugging Face checkpoint cannot be converted: unsupported architecture or feature
    (e.g. mixture of experts), or files / tensors missing, extra or of the wrong shape."""


# ---- public API -----------------------------------------------------------------------------

def load_hf(model_class: type[HybridLM], path: str | Path, device: torch.device | str | None = None,
            dtype: torch.dtype | str | None = None) -> HybridLM:
    """``model_class(config)`` (``HybridLM`` or a subclass) with the weights of a local Hugging
    Face checkpoint directory, in eval mode. Arguments, result and errors: see
    :func:`hybridzoo.zoo.convert.from_hf`."""
    directory = Path(path)
    if not directory.is_dir():
        raise ConversionError(f"from_hf: {directory} is not a directory; give the local directory of a "
                              f"Hugging Face checkpoint (config.json + *.safetensors), not a hub id")
    hf_config = _read_config(directory / "config.json")
    architecture = _architecture(hf_config, directory)
    layout = _LAYOUTS[architecture](hf_config)
    dtype = _as_dtype(dtype)
    try:
        with _parameters_on_meta():
            model = model_class(layout.config)
    except (ConfigError, ValueError) as error:
        raise ConversionError(f"{directory}: {architecture} maps to an invalid HybridLM: {error}") from error
    with _Checkpoint(directory, device) as checkpoint:
        state = _convert_state(model, layout, checkpoint)
    dtype = dtype or state["embed.weight"].dtype
    state = {name: t.to(dtype) if t.is_floating_point() else t for name, t in state.items()}
    _load(model, state)
    if device is not None:
        model = model.to(device)
    return model.eval()


def hf_to_hybrid_config(hf_config: dict[str, Any]) -> HybridConfig:
    """The :class:`HybridConfig` of a Hugging Face ``config.json`` (as a dict), without weights.

    Multimodal Qwen3.5 configs read their ``text_config``. Raises :class:`ConversionError` like
    :func:`load_hf` for unsupported architectures and features.
    """
    architecture = _architecture(hf_config, "config")
    return _LAYOUTS[architecture](hf_config).config


# ---- configs --------------------------------------------------------------------------------

def _read_config(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConversionError(f"from_hf: {path} is missing; a Hugging Face checkpoint directory needs "
                              f"config.json and *.safetensors")

    def decode(obj: dict) -> Any:  # transformers writes inf / nan as {"__float__": "Infinity"}
        return float(obj["__float__"]) if set(obj) == {"__float__"} else obj

    try:
        return json.loads(path.read_text(), object_hook=decode)
    except json.JSONDecodeError as error:
        raise ConversionError(f"from_hf: {path} is not valid JSON: {error}") from error


def _architecture(hf_config: dict[str, Any], where: Any) -> str:
    """The supported architecture named by ``architectures`` (else ``model_type``)."""
    names = list(hf_config.get("architectures") or [])
    model_type = hf_config.get("model_type")
    for name in names:
        if name in SUPPORTED_ARCHITECTURES:
            return name
    for name in [*names, model_type]:
        if name in _REFUSED:
            raise ConversionError(f"{where}: {name}: {_REFUSED[name]}")
    if not names and model_type in _BY_MODEL_TYPE:
        return _BY_MODEL_TYPE[model_type]
    found = names or f"model_type {model_type!r}"
    raise ConversionError(f"{where}: cannot convert {found}; from_hf supports "
                          f"{', '.join(SUPPORTED_ARCHITECTURES)} (dense MLPs only)")


def _getter(hf_config: dict[str, Any], defaults: dict[str, Any]):
    """``get(key)``: the config value, else transformers' default."""
    def get(key: str) -> Any:
        value = hf_config.get(key)
        return defaults[key] if value is None else value
    return get


def _as_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    names = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
             "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16,
             "fp16": torch.float16, "half": torch.float16, "float64": torch.float64,
             "fp64": torch.float64, "double": torch.float64}
    if dtype is None:
        return None
    if isinstance(dtype, str):
        key = dtype.removeprefix("torch.")
        if key not in names:
            raise ConversionError(f"from_hf: unknown dtype {dtype!r}; use one of {sorted(names)}")
        return names[key]
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ConversionError(f"from_hf: dtype must be a floating torch.dtype or its name, got {dtype!r}")
    return dtype


@dataclass
class _Layout:
    """A HybridConfig and where each of its tensors lives in the HF checkpoint.

    Name templates take the layer index ``{i}`` and a prefix ``{p}``: the first of ``prefixes``
    that some checkpoint tensor starts with (a multimodal Qwen3.5 checkpoint keeps its text
    model under ``model.language_model.``); ``mixers`` maps a mixer kind to the template of
    that layer's mixer tensors; ``ignore`` are regexes of HF tensors deliberately dropped.
    """

    config: HybridConfig
    prefixes: tuple[str, ...]
    embed: tuple[str, ...]
    final_norm: str
    mixer_norm: str
    mixers: dict[str, str]
    mlp_norm: str | None = None
    mlp: str | None = None
    ignore: tuple[str, ...] = ()


def _mamba_layout(hf_config: dict[str, Any]) -> _Layout:
    get = _getter(hf_config, _MAMBA_DEFAULTS)
    _require_silu(get("hidden_act"), "MambaForCausalLM")
    d_model, expand = get("hidden_size"), get("expand")
    d_inner = hf_config.get("intermediate_size") or int(expand * d_model)
    if d_inner != expand * d_model or int(expand) != expand:
        raise ConversionError(f"MambaForCausalLM: intermediate_size {d_inner} != expand {expand} x "
                              f"hidden_size {d_model}; hybridzoo's Mamba1 needs an integer expand")
    mixer = Mamba1Config(d_state=get("state_size"), d_conv=get("conv_kernel"), expand=int(expand),
                         dt_rank=get("time_step_rank"), conv_bias=bool(get("use_conv_bias")),
                         bias=bool(get("use_bias")))
    return _mamba_family_layout("MambaForCausalLM", get, d_model, "mamba1", mixer)


def _mamba_family_layout(arch: str, get, d_model: int, kind: str, mixer) -> _Layout:
    """The layout both Mamba architectures share: ``backbone.`` weights, one mixer per layer, no MLP."""
    config = _hybrid_config(
        arch, vocab_size=get("vocab_size"), d_model=d_model,
        n_layers=get("num_hidden_layers"), layers=kind, d_mlp=0, norm_eps=get("layer_norm_epsilon"),
        tie_embeddings=bool(get("tie_word_embeddings")), **{kind: mixer})
    return _Layout(config, prefixes=("backbone.",), embed=("{p}embeddings.weight", "{p}embedding.weight"),
                   final_norm="{p}norm_f.weight", mixer_norm="{p}layers.{i}.norm.weight",
                   mixers={kind: "{p}layers.{i}.mixer."})


def _mamba2_layout(hf_config: dict[str, Any]) -> _Layout:
    get = _getter(hf_config, _MAMBA2_DEFAULTS)
    _require_silu(get("hidden_act"), "Mamba2ForCausalLM")
    d_model, expand, heads, head_dim = get("hidden_size"), get("expand"), get("num_heads"), get("head_dim")
    if int(expand) != expand or heads * head_dim != expand * d_model:
        raise ConversionError(f"Mamba2ForCausalLM: num_heads {heads} x head_dim {head_dim} must equal "
                              f"expand {expand} x hidden_size {d_model} (an integer expand)")
    mixer = Mamba2Config(d_state=get("state_size"), d_conv=get("conv_kernel"), expand=int(expand),
                         head_dim=head_dim, n_groups=get("n_groups"), chunk_size=get("chunk_size"),
                         time_step_limit=tuple(float(t) for t in get("time_step_limit")),
                         conv_bias=bool(get("use_conv_bias")), bias=bool(get("use_bias")),
                         norm_eps=get("layer_norm_epsilon"))
    return _mamba_family_layout("Mamba2ForCausalLM", get, d_model, "mamba2", mixer)


def _qwen_layout(architecture: str, text: dict[str, Any], defaults: dict[str, Any], tie: bool) -> _Layout:
    """Qwen3-Next and Qwen3.5 (text): GDN / gated attention layers, dense SwiGLU MLPs."""
    get = _getter(text, defaults)
    _require_silu(get("hidden_act"), architecture)
    n_layers = get("num_hidden_layers")
    layer_types = text.get("layer_types")
    if layer_types is None:  # transformers: every full_attention_interval-th layer is attention
        interval = text.get("full_attention_interval") or 4
        layer_types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                       for i in range(n_layers)]
    unknown = sorted(set(layer_types) - set(_LAYER_KINDS))
    if unknown or len(layer_types) != n_layers:
        raise ConversionError(f"{architecture}: layer_types must be {n_layers} entries among "
                              f"{sorted(_LAYER_KINDS)}, got {layer_types}")
    theta, partial = _rope(text, architecture)
    norm_eps = get("rms_norm_eps")
    attn = AttentionConfig(
        n_heads=get("num_attention_heads"), n_kv_heads=get("num_key_value_heads"), head_dim=get("head_dim"),
        qk_norm=True, norm_zero_centered=True, output_gate=True, partial_rotary_factor=partial,
        rope_base=theta, bias=bool(get("attention_bias")), norm_eps=norm_eps)
    gdn = GatedDeltaNetConfig(
        num_k_heads=get("linear_num_key_heads"), num_v_heads=get("linear_num_value_heads"),
        head_k_dim=get("linear_key_head_dim"), head_v_dim=get("linear_value_head_dim"),
        conv_size=get("linear_conv_kernel_dim"), norm_eps=norm_eps)
    config = _hybrid_config(
        architecture, vocab_size=get("vocab_size"), d_model=get("hidden_size"), n_layers=n_layers,
        layers=[_LAYER_KINDS[t] for t in layer_types], d_mlp=get("intermediate_size"), norm_eps=norm_eps,
        norm_zero_centered=True, tie_embeddings=tie, gdn=gdn, attn=attn)
    return _Layout(config, prefixes=("model.language_model.", "model."), embed=("{p}embed_tokens.weight",),
                   final_norm="{p}norm.weight", mixer_norm="{p}layers.{i}.input_layernorm.weight",
                   mixers={"gdn": "{p}layers.{i}.linear_attn.", "attn": "{p}layers.{i}.self_attn."},
                   mlp_norm="{p}layers.{i}.post_attention_layernorm.weight", mlp="{p}layers.{i}.mlp.",
                   ignore=(r"^mtp\.", r"^model\.visual\.", r"\.rotary_emb\.inv_freq$"))


def _qwen3_next_layout(hf_config: dict[str, Any]) -> _Layout:
    get = _getter(hf_config, _QWEN3_NEXT_DEFAULTS)
    n_layers, experts, step = get("num_hidden_layers"), get("num_experts"), get("decoder_sparse_step")
    dense = set(get("mlp_only_layers"))
    if experts > 0:
        if step <= 0:
            raise ConversionError(f"Qwen3NextForCausalLM: decoder_sparse_step must be >= 1, got {step}")
        moe = [i for i in range(n_layers) if i not in dense and (i + 1) % step == 0]
        if moe:
            raise ConversionError(
                f"Qwen3NextForCausalLM: layers {moe} are sparse MoE blocks (num_experts={experts}, "
                f"decoder_sparse_step={step}, mlp_only_layers={sorted(dense)}); {_MOE_MESSAGE}. "
                f"Only configurations whose every layer is dense (num_experts=0, or every layer in "
                f"mlp_only_layers) can be converted")
    return _qwen_layout("Qwen3NextForCausalLM", hf_config, _QWEN3_NEXT_DEFAULTS,
                        bool(get("tie_word_embeddings")))


def _qwen3_5_layout(hf_config: dict[str, Any]) -> _Layout:
    # a multimodal config nests the text model in text_config; tying is a top-level setting
    text = hf_config.get("text_config") or hf_config
    tie = hf_config.get("tie_word_embeddings")
    architecture = "Qwen3_5ForConditionalGeneration" if "text_config" in hf_config else "Qwen3_5ForCausalLM"
    return _qwen_layout(architecture, text, _QWEN3_5_DEFAULTS, bool(tie))


_LAYOUTS = {"MambaForCausalLM": _mamba_layout, "Mamba2ForCausalLM": _mamba2_layout,
            "Qwen3NextForCausalLM": _qwen3_next_layout, "Qwen3_5ForCausalLM": _qwen3_5_layout,
            "Qwen3_5ForConditionalGeneration": _qwen3_5_layout}


def _rope(text: dict[str, Any], architecture: str) -> tuple[float, float]:
    """``(rope_theta, partial_rotary_factor)`` from ``rope_parameters`` or the legacy keys."""
    params = text.get("rope_parameters") or {}
    legacy = text.get("rope_scaling") or {}
    rope_type = (params.get("rope_type") or params.get("type") or legacy.get("rope_type")
                 or legacy.get("type") or "default")
    if rope_type not in ("default", "mrope"):
        raise ConversionError(f"{architecture}: rope_type {rope_type!r} is not supported; hybridzoo's "
                              f"Rotary implements the default RoPE (rope_theta, partial_rotary_factor)")
    theta = params.get("rope_theta", text.get("rope_theta", 10000.0))
    partial = params.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25))
    return float(theta), float(partial)


def _require_silu(activation: str, architecture: str) -> None:
    if activation not in ("silu", "swish"):
        raise ConversionError(f"{architecture}: hidden_act {activation!r} is not supported (SiLU only)")


def _hybrid_config(architecture: str, **fields: Any) -> HybridConfig:
    try:
        return HybridConfig(**fields)
    except (ConfigError, ValueError, TypeError) as error:
        raise ConversionError(f"{architecture}: the config does not map to a valid HybridConfig: "
                              f"{error}") from error


# ---- tensors --------------------------------------------------------------------------------

class _Checkpoint:
    """The tensors of a safetensors checkpoint directory, read lazily by name."""

    def __init__(self, directory: Path, device: torch.device | str | None):
        self.device = str(device) if device is not None else "cpu"
        self.files: dict[str, Path] = {}
        self._handles: dict[Path, Any] = {}
        index = directory / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as error:
                raise ConversionError(f"from_hf: {index} has no readable weight_map: {error}") from error
            self.files = {name: directory / file for name, file in weight_map.items()}
            missing = sorted({str(f.name) for f in self.files.values() if not f.is_file()})
            if missing:
                raise ConversionError(f"from_hf: {index} lists missing shard(s) {missing}")
        else:
            paths = sorted(directory.glob("*.safetensors"))
            if not paths:
                present = sorted(p.name for p in directory.iterdir())
                raise ConversionError(f"from_hf: no *.safetensors in {directory} (it holds {present}); "
                                      f"pickled pytorch_model.bin checkpoints are not read: re-save the "
                                      f"model with transformers' save_pretrained (safetensors)")
            for path in paths:
                for name in self._open(path).keys():
                    self.files[name] = path
        self.names = frozenset(self.files)
        self.taken: set[str] = set()

    def _open(self, path: Path):
        from safetensors import SafetensorError, safe_open

        if path not in self._handles:
            try:
                self._handles[path] = safe_open(str(path), framework="pt", device=self.device)
            except (SafetensorError, OSError) as error:
                raise ConversionError(f"from_hf: {path} is not a readable safetensors file: "
                                      f"{error}") from error
        return self._handles[path]

    def take(self, *candidates: str) -> torch.Tensor:
        """The first of ``candidates`` present in the checkpoint (marked as used)."""
        for name in candidates:
            if name in self.files:
                self.taken.add(name)
                return self._open(self.files[name]).get_tensor(name)
        raise ConversionError(f"from_hf: tensor {' or '.join(map(repr, candidates))} is missing from "
                              f"the checkpoint")

    def under(self, prefix: str) -> Iterator[str]:
        return (name for name in sorted(self.names) if name.startswith(prefix))

    def __enter__(self) -> "_Checkpoint":
        return self

    def __exit__(self, *exc) -> None:
        self._handles.clear()


def _convert_state(model: HybridLM, layout: _Layout, checkpoint: _Checkpoint) -> dict[str, torch.Tensor]:
    """Our state dict, read from the checkpoint; checks that every tensor is used exactly."""
    p = next((p for p in layout.prefixes if any(n.startswith(p) for n in checkpoint.names)),
             layout.prefixes[-1])
    state = {"embed.weight": checkpoint.take(*(name.format(p=p) for name in layout.embed)),
             "norm.weight": checkpoint.take(layout.final_norm.format(p=p))}
    if not model.config.tie_embeddings:
        state["lm_head.weight"] = checkpoint.take("lm_head.weight")
    for i, block in enumerate(model.blocks):
        state[f"blocks.{i}.mixer_norm.weight"] = checkpoint.take(layout.mixer_norm.format(p=p, i=i))
        prefix = layout.mixers[block.kind].format(p=p, i=i)
        hf_mixer = {name[len(prefix):]: checkpoint.take(name) for name in checkpoint.under(prefix)}
        if not hf_mixer:
            raise ConversionError(f"from_hf: layer {i} ({block.kind}) has no tensors under {prefix!r}")
        try:
            mixer = _convert_mixer(block.kind, hf_mixer, block.mixer.config)
        except ValueError as error:
            raise ConversionError(f"from_hf: layer {i} ({prefix}*): {error}") from error
        extra = sorted(set(mixer) - set(block.mixer.state_dict()))
        if extra:
            raise ConversionError(f"from_hf: tensors {[prefix + name for name in extra]} have no place in "
                                  f"hybridzoo's {block.kind} mixer")
        state.update({f"blocks.{i}.mixer.{name}": t for name, t in mixer.items()})
        if block.mlp is not None:
            state[f"blocks.{i}.mlp_norm.weight"] = checkpoint.take(layout.mlp_norm.format(p=p, i=i))
            for proj in ("gate_proj", "up_proj", "down_proj"):
                state[f"blocks.{i}.mlp.{proj}.weight"] = checkpoint.take(
                    layout.mlp.format(p=p, i=i) + f"{proj}.weight")

    ignore = [re.compile(pattern) for pattern in layout.ignore]
    if model.config.tie_embeddings:  # HF ties too: a stored lm_head is overwritten by the embedding
        ignore.append(re.compile(r"^lm_head\.weight$"))
    leftover = sorted(n for n in checkpoint.names - checkpoint.taken if not any(p.search(n) for p in ignore))
    if leftover:
        experts = [n for n in leftover if ".experts." in n or ".shared_expert" in n]
        hint = f" ({_MOE_MESSAGE})" if experts else ""
        raise ConversionError(f"from_hf: {len(leftover)} checkpoint tensor(s) have no place in the converted "
                              f"model{hint}: {leftover[:10]}{' …' if len(leftover) > 10 else ''}")

    expected = {name: t.shape for name, t in model.state_dict().items()}
    if model.config.tie_embeddings:
        expected.pop("lm_head.weight")
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ConversionError(f"from_hf: converted tensors do not match the model: missing {missing[:10]}, "
                              f"unexpected {unexpected[:10]}")
    wrong = [f"{name}: checkpoint {tuple(t.shape)}, model {tuple(expected[name])}"
             for name, t in state.items() if t.shape != expected[name]]
    if wrong:
        raise ConversionError(f"from_hf: tensor shapes do not match config.json: {wrong[:10]}")
    return state


def _convert_mixer(kind: str, hf_mixer: dict[str, torch.Tensor], config: Any) -> dict[str, torch.Tensor]:
    """One layer's HF mixer tensors (names relative to the mixer) as our mixer's state dict."""
    if kind == "gdn":
        return convert_hf_weights(hf_mixer, config)
    out = dict(hf_mixer)
    conv = out.get("conv1d.weight")
    if conv is not None and conv.dim() == 3:  # [C, 1, W] -> [C, W]
        out["conv1d.weight"] = conv.squeeze(1)
    return out


# ---- building without allocating twice ------------------------------------------------------

@contextlib.contextmanager
def _parameters_on_meta():
    """Modules built inside get their parameters on the meta device (no memory, no init cost)
    while buffers stay real (rotary frequencies), like accelerate's
    ``init_empty_weights(include_buffers=False)``."""
    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:
            meta = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
            meta.__dict__.update(param.__dict__)
            param = meta
        register(module, name, param)

    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def _load(model: HybridLM, state: dict[str, torch.Tensor]) -> None:
    """Give the meta parameters the converted tensors (no copy), keeping parameter attributes
    such as ``_no_weight_decay`` and the tied LM head."""
    attributes = {name: dict(vars(p)) for name, p in model.named_parameters()}
    model.load_state_dict(state, strict=False, assign=True)
    if model.config.tie_embeddings:
        model.lm_head.weight = model.embed.weight
    for name, p in model.named_parameters():
        p.__dict__.update(attributes[name])
    left = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:  # pragma: no cover - _convert_state checked the keys
        raise ConversionError(f"from_hf: parameters left unloaded: {left[:10]}")
