"""Converters: a local Hugging Face checkpoint directory -> :class:`HybridLM`.

``from_hf(path)`` (also ``HybridLM.from_hf``) converts ``MambaForCausalLM``,
``Mamba2ForCausalLM``, ``Qwen3NextForCausalLM`` (dense MLPs), ``Qwen3_5ForCausalLM`` and the
text model of ``Qwen3_5ForConditionalGeneration``; nothing is downloaded and transformers is not
needed. :func:`convert_checkpoint` (``hybridzoo convert SRC OUT``) writes the result as a
hybridzoo checkpoint. The mapping of configs and tensors, and what is not supported, is
documented in :mod:`hybridzoo.zoo.hf_checkpoint`, which does the work.
"""

from __future__ import annotations

from pathlib import Path

import torch

from hybridzoo.zoo.hf_checkpoint import SUPPORTED_ARCHITECTURES, ConversionError, hf_to_hybrid_config, load_hf
from hybridzoo.zoo.model import HybridLM

__all__ = ["SUPPORTED_ARCHITECTURES", "ConversionError", "convert_checkpoint", "from_hf", "hf_to_hybrid_config",
           "save_converted"]


def from_hf(path: str | Path, device: torch.device | str | None = None,
            dtype: torch.dtype | str | None = None) -> HybridLM:
    """Build a :class:`HybridLM` from a local Hugging Face checkpoint directory.

    Args:
        path: a directory with ``config.json`` and ``*.safetensors`` (or a sharded checkpoint
            with ``model.safetensors.index.json``) of one of :data:`SUPPORTED_ARCHITECTURES`.
            Never a hub id: nothing is downloaded (``huggingface-cli download`` it first).
        device: where the parameters are loaded (default CPU).
        dtype: dtype of every parameter (``torch.bfloat16`` or a name such as ``"bf16"``);
            None = the dtype of the checkpoint's embedding matrix.

    Returns:
        the model in eval mode; its logits equal the HF model's (same tokens, same dtype).

    Raises:
        ConversionError: unknown or unsupported architecture (the message lists the supported
            ones), mixture-of-experts layers, non-default RoPE, missing files, or tensors that
            are missing, left over or of the wrong shape.
    """
    return load_hf(HybridLM, path, device=device, dtype=dtype)


def save_converted(model: HybridLM, out_dir: str | Path) -> Path:
    """Write a converted model as a hybridzoo checkpoint (``model.save_pretrained``)."""
    return model.save_pretrained(out_dir)


def convert_checkpoint(src_dir: str | Path, out_dir: str | Path,
                       dtype: torch.dtype | str | None = None) -> Path:
    """Convert a local Hugging Face checkpoint into a hybridzoo checkpoint directory.

    ``from_hf(src_dir, dtype=dtype)`` then :func:`save_converted` into ``out_dir``
    (``model.safetensors`` + ``config.json``, readable by ``HybridLM.from_pretrained``).
    Prints nothing; returns ``out_dir`` as a :class:`~pathlib.Path`.
    """
    return Path(save_converted(from_hf(src_dir, dtype=dtype), out_dir))
