"""Token mixers and the small modules they share.

Every mixer follows one contract (see :class:`hybridzoo.layers.base.Mixer`)::

    y, state = mixer(x, state=None)      # x, y: [B, T, d_model]

``MIXERS`` maps a mixer kind name (``mamba1``, ``mamba2``, ``gla``, ``retnet``, ``gdn``,
``attn``) to its ``(Mixer class, settings dataclass)``.
"""

from hybridzoo.layers.attention import Attention, AttentionConfig, KVState
from hybridzoo.layers.base import Mixer
from hybridzoo.layers.conv import ShortConv
from hybridzoo.layers.gated_deltanet import GatedDeltaNet, GatedDeltaNetConfig
from hybridzoo.layers.gla import GLA, GLAConfig
from hybridzoo.layers.mamba1 import Mamba1, Mamba1Config
from hybridzoo.layers.mamba2 import Mamba2, Mamba2Config
from hybridzoo.layers.mlp import SwiGLU
from hybridzoo.layers.norms import GatedRMSNorm, RMSNorm
from hybridzoo.layers.retnet import RetNet, RetNetConfig
from hybridzoo.layers.rotary import Rotary
from hybridzoo.layers.state import MixerState, RecurrentState, StateError

MIXERS: dict[str, tuple[type, type]] = {
    "mamba1": (Mamba1, Mamba1Config),
    "mamba2": (Mamba2, Mamba2Config),
    "gla": (GLA, GLAConfig),
    "retnet": (RetNet, RetNetConfig),
    "gdn": (GatedDeltaNet, GatedDeltaNetConfig),
    "attn": (Attention, AttentionConfig),
}

__all__ = [
    "MIXERS",
    "Attention", "AttentionConfig", "KVState", "GatedDeltaNet", "GatedDeltaNetConfig",
    "GLA", "GLAConfig", "Mamba1", "Mamba1Config", "Mamba2", "Mamba2Config", "RetNet", "RetNetConfig",
    "Mixer", "MixerState", "RecurrentState", "StateError",
    "ShortConv", "SwiGLU", "GatedRMSNorm", "RMSNorm", "Rotary",
]
