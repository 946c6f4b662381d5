"""Models: ``HybridConfig``, ``HybridLM``, recipes, generation, safetensors checkpoints."""

from hybridzoo.zoo.checkpoint import CheckpointError
from hybridzoo.zoo.config import ConfigError, HybridConfig
from hybridzoo.zoo.convert import ConversionError
from hybridzoo.zoo.model import Block, HybridLM

__all__ = ["Block", "CheckpointError", "ConfigError", "ConversionError", "HybridConfig", "HybridLM"]
