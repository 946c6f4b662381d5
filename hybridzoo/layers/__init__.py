"""Token mixers and the small modules they share.

Every mixer follows one contract (see :class:`hybridzoo.layers.base.Mixer`)::

    y, state = mixer(x, state=None)      # x, y: [B, T, d_model]

``MIXERS`` maps a mixer kind name (``mamba1``, ``mamba2``, ``gla``, ``retnet``, ``gdn``,
``attn``) to its ``(Mixer class, settings dataclass)``.
"""

from hybridzoo.layers.base import Mixer
from hybridzoo.layers.conv import ShortConv
from hybridzoo.layers.mlp import SwiGLU
from hybridzoo.layers.norms import GatedRMSNorm, RMSNorm
from hybridzoo.layers.rotary import Rotary
from hybridzoo.layers.state import MixerState, RecurrentState, StateError

__all__ = [
    "Mixer", "MixerState", "RecurrentState", "StateError",
    "ShortConv", "SwiGLU", "GatedRMSNorm", "RMSNorm", "Rotary",
]
