"""Gated DeltaNet (Yang, Kautz & Hatamizadeh 2024, "Gated Delta Networks: Improving Mamba2 with
Delta Rule"), as Qwen3-Next and Qwen3.5 use it.

Matches Hugging Face transformers' ``Qwen3_5GatedDeltaNet`` (``transformers/models/qwen3_5``)
parameter for parameter, and ``Qwen3NextGatedDeltaNet`` (``transformers/models/qwen3_next``) up to
a fixed permutation of its fused projections (see :func:`convert_hf_weights`). With ``Hk`` key
heads of size ``K = head_k_dim``, ``H`` value heads of size ``V = head_v_dim`` (``H % Hk == 0``;
value head ``h`` reads q/k head ``h // (H / Hk)``, i.e. HF's ``repeat_interleave``)::

    q, k, v  = silu(causal_conv1d(in_proj_qkv(x))).split([Hk K, Hk K, H V])   # one conv, no bias
    q, k     = l2norm(q), l2norm(k)                                           # per head, eps 1e-6
    z        = in_proj_z(x)                                                   # [B, T, H, V]
    beta     = sigmoid(in_proj_b(x))                                          # [B, T, H]
    log_a    = -exp(A_log) * softplus(in_proj_a(x) + dt_bias)                 # [B, T, H] float32
    S_t      = a_t (I − β_t k_t k_tᵀ) S_{t-1} + β_t k_t v_tᵀ                  # S: [K, V] per head
    o_t      = K^-½ · S_tᵀ q_t                                                # HF's scale
    out      = out_proj(rmsnorm(o) * norm.weight * silu(z))                   # norm per value head

The recurrence is :func:`hybridzoo.kernels.chunk_delta_rule` (a single token with a state takes
:func:`hybridzoo.kernels.delta_rule_step`).

Weight mapping from Hugging Face (keys relative to the ``linear_attn`` module):

* Qwen3.5 (``Qwen3_5GatedDeltaNet``): same names and shapes, except ``conv1d.weight`` is
  ``[conv_dim, conv_size]`` here (HF: ``[conv_dim, 1, conv_size]``; squeeze dim 1).
* Qwen3-Next (``Qwen3NextGatedDeltaNet``): ``in_proj_qkvz`` and ``in_proj_ba`` are fused and
  interleaved per key head (``fix_query_key_value_ordering``): the rows of ``in_proj_qkvz`` are
  ``Hk`` blocks ``[q_g (K) | k_g (K) | v_g (r V) | z_g (r V)]`` and those of ``in_proj_ba`` are
  ``Hk`` blocks ``[b_g (r) | a_g (r)]`` with ``r = H / Hk``, the value heads ``g r … g r + r − 1``
  of key head ``g``. :func:`convert_hf_weights` de-interleaves them into ``in_proj_qkv``
  (``[q_0 … q_{Hk-1} | k_0 … | v_0 …]``), ``in_proj_z``, ``in_proj_b`` and ``in_proj_a``.
* fla's ``GatedDeltaNet`` layer: ``q_proj/k_proj/v_proj`` stacked = ``in_proj_qkv``, its three
  short convs stacked = ``conv1d``, ``g_proj`` = ``in_proj_z``, ``b_proj`` = ``in_proj_b``,
  ``a_proj`` = ``in_proj_a``, ``o_norm`` = ``norm``, ``o_proj`` = ``out_proj``.

State mapping from HF's cache: ``recurrent`` equals HF's recurrent state ``[B, H, K, V]``; ``conv``
is HF's conv state ``[B, conv_dim, conv_size]`` without its oldest column, transposed.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from hybridzoo.kernels import chunk_delta_rule, delta_rule_step
from hybridzoo.layers.base import Mixer, activation_dtype, init_dt_bias_, next_offset, projection_input
from hybridzoo.layers.conv import ShortConv
from hybridzoo.layers.norms import GatedRMSNorm, l2_normalize
from hybridzoo.layers.state import RecurrentState, state_dtype
from hybridzoo.parallel.context import sharded

L2_EPS = 1e-6  # HF's and fla's l2norm: x * rsqrt(Σ x² + eps)


@dataclass
class GatedDeltaNetConfig:
    """Settings of a :class:`GatedDeltaNet` mixer.

    The defaults are the layer sizes of flame's ``configs/gated_deltanet_340M.json`` (``d_model``
    1024, ``num_heads`` 6, ``head_dim`` 256, ``expand_v`` 2; with 24 such layers that model has
    about 512M parameters, so the packaged ``gated-deltanet-340m`` recipe uses fla's own sizing
    rule instead). As in fla and Qwen3-Next, the sizes are absolute, not derived from ``d_model``. Qwen3-Next-80B: 16 key heads, 32 value heads, both
    of size 128.

    Attributes:
        num_k_heads: Hk, heads of q and k (HF ``linear_num_key_heads``).
        num_v_heads: H, heads of v, z, beta and the decay (HF ``linear_num_value_heads``); a
            multiple of ``num_k_heads``, each key head serving ``H / Hk`` consecutive value heads.
        head_k_dim: K, size of a q/k head (HF ``linear_key_head_dim``); the read is scaled by
            ``K ** -0.5``.
        head_v_dim: V, size of a v/z head (HF ``linear_value_head_dim``; fla ``head_dim *
            expand_v``).
        conv_size: kernel width of the short conv over q, k, v (HF ``linear_conv_kernel_dim``).
        chunk_size: tokens per chunk of the chunkwise delta rule.
        norm_eps: epsilon of the gated RMSNorm (HF ``rms_norm_eps``).
        dt_min, dt_max: at init, ``softplus(dt_bias)`` is log-uniform in this range (fla).
        dt_init_floor: lower clamp of those initial step sizes (fla).
        A_init_range: ``A_log = log(uniform(*A_init_range))`` per value head at init (fla's
            ``(0, 16)``; an A of exactly 0, probability ~1e-7 per head, gives ``A_log = -inf``,
            i.e. no decay, which the kernels and its gradient (0) handle; HF uses 0.01 as the
            lower bound).

        decay_init: ``"fla"`` (the draws above) or ``"multiscale"``: ``dt_bias`` drawn as fla
            does, then ``A`` set per head so that the initial decay ``exp(-A softplus(dt_bias))``
            is ``1 - 1 / L_h`` with memories ``L_h`` log-spaced over ``memory_range`` (one head:
            their geometric mean), a spread of fixed time scales across heads as in RetNet's
            ``1 - 2^(-5 - h)``.
        memory_range: ``(L_min, L_max)`` tokens, the memories of ``"multiscale"``.

    With only a few value heads per layer the initial decays ``exp(-A softplus(dt_bias))`` vary
    a lot between seeds (memories of one to hundreds of tokens; a layer of 2 heads has a head
    of decay >= 0.99 with probability ~0.25), as in fla: recall tasks then depend on the seed.
    """

    num_k_heads: int = 6
    num_v_heads: int = 6
    head_k_dim: int = 256
    head_v_dim: int = 512
    conv_size: int = 4
    chunk_size: int = 64
    norm_eps: float = 1e-6
    dt_min: float = 0.001
    dt_max: float = 0.1
    dt_init_floor: float = 1e-4
    A_init_range: tuple[float, float] = (0.0, 16.0)
    decay_init: str = "fla"
    memory_range: tuple[float, float] = (4.0, 4096.0)


class GatedDeltaNet(Mixer):
    """Gated DeltaNet mixer: ``y, state = mixer(x, state=None)``, ``x, y: [B, T, d_model]``.

    Parameters (names and shapes as HF ``Qwen3_5GatedDeltaNet``): ``in_proj_qkv`` (d_model ->
    2 Hk K + H V), ``in_proj_z`` (d_model -> H V), ``in_proj_b``, ``in_proj_a`` (d_model -> H),
    ``conv1d`` (:class:`ShortConv`, no bias, SiLU, weight ``[conv_dim, conv_size]`` with
    ``conv_dim = 2 Hk K + H V``), ``dt_bias``, ``A_log`` (``[H]``), ``norm``
    (:class:`GatedRMSNorm` over one value head, weight ``[V]`` shared by the heads),
    ``out_proj`` (H V -> d_model). No biases.

    State: ``RecurrentState(kind="gdn", recurrent=[B, H, K, V] float32 (float64 for float64
    inputs), conv=[B, conv_size - 1, conv_dim] in x.dtype, offset=tokens seen)``.
    """

    kind = "gdn"
    context_parallel = True

    def __init__(self, d_model: int, config: GatedDeltaNetConfig | None = None, backend: str = "auto"):
        super().__init__(d_model)
        self.config = config = config or GatedDeltaNetConfig()
        self.backend = backend
        for name in ("num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim", "conv_size", "chunk_size"):
            if getattr(config, name) < 1:
                raise ValueError(f"GatedDeltaNet: {name} must be >= 1, got {getattr(config, name)}")
        if config.decay_init not in ("fla", "multiscale"):
            raise ValueError(f"GatedDeltaNet: decay_init must be 'fla' or 'multiscale', got {config.decay_init!r}")
        if not 1.0 < config.memory_range[0] <= config.memory_range[1]:
            raise ValueError(f"GatedDeltaNet: memory_range must be (L_min, L_max) with 1 < L_min <= L_max, "
                             f"got {config.memory_range}")
        if config.num_v_heads % config.num_k_heads:
            raise ValueError(f"GatedDeltaNet: num_v_heads {config.num_v_heads} is not a multiple of "
                             f"num_k_heads {config.num_k_heads}")
        self.num_k_heads, self.num_v_heads = config.num_k_heads, config.num_v_heads
        self.head_k_dim, self.head_v_dim = config.head_k_dim, config.head_v_dim
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim

        # Built, and so drawn from torch's RNG, in the order of fla's GatedDeltaNet layer (q, k, v,
        # a, b projections, then A and dt, the q/k/v convs, the gate and output projections), with
        # the same distributions: under the same seed both layers start from the same weights.
        self.in_proj_qkv = nn.Linear(d_model, self.conv_dim, bias=False)
        self.in_proj_a = nn.Linear(d_model, self.num_v_heads, bias=False)
        self.in_proj_b = nn.Linear(d_model, self.num_v_heads, bias=False)
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads))
        self.dt_bias = nn.Parameter(torch.empty(self.num_v_heads))
        self.reset_gate_parameters()
        self.conv1d = ShortConv(self.conv_dim, config.conv_size, bias=False, activation="silu",
                                backend=backend)
        self.in_proj_z = nn.Linear(d_model, self.value_dim, bias=False)
        self.norm = GatedRMSNorm(self.head_v_dim, eps=config.norm_eps, norm_before_gate=True)
        self.out_proj = nn.Linear(self.value_dim, d_model, bias=False)
        for p in (self.dt_bias, self.A_log, self.norm.weight):
            p._no_weight_decay = True

    @torch.no_grad()
    def reset_gate_parameters(self) -> None:
        """fla's init of the decay, in fla's order: ``A_log = log(uniform(A_init_range))``, then
        ``dt_bias`` such that ``softplus(dt_bias)`` is log-uniform in ``[dt_min, dt_max]`` (HF sets
        ``dt_bias = 1``)."""
        cfg = self.config
        self.A_log.copy_(torch.log(torch.empty(self.num_v_heads).uniform_(*cfg.A_init_range)))
        init_dt_bias_(self.dt_bias, cfg.dt_min, cfg.dt_max, cfg.dt_init_floor)
        if cfg.decay_init == "multiscale":  # the draws above are kept, so later layers draw as with "fla"
            low, high = (math.log(x) for x in cfg.memory_range)
            memory = (torch.linspace(low, high, self.num_v_heads) if self.num_v_heads > 1
                      else torch.tensor([(low + high) / 2])).exp()
            decay_rate = -torch.log1p(-1.0 / memory.double())           # -log(1 - 1/L) > 0
            step = F.softplus(self.dt_bias.double())
            self.A_log.copy_((decay_rate / step).log())

    def expected_state(self, batch_size: int, dtype: torch.dtype
                       ) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return {
            "recurrent": ((batch_size, self.num_v_heads, self.head_k_dim, self.head_v_dim),
                          state_dtype(dtype)),
            "conv": ((batch_size, self.config.conv_size - 1, self.conv_dim), dtype),
        }

    def mix(self, x: torch.Tensor, state: RecurrentState | None, cu_seqlens: torch.Tensor | None = None
            ) -> tuple[torch.Tensor, RecurrentState]:
        """``x [B, T, d_model]`` -> ``(y [B, T, d_model] in x.dtype, state)``; ``cu_seqlens``:
        packed documents (``B = 1``, per-document states ``[N, ...]``; see :meth:`Mixer.forward`)."""
        batch, length, _ = x.shape
        Hk, H, K, V = self.num_k_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim
        compute = state_dtype(x.dtype)                                      # float32 (float64)
        h = projection_input(x)  # one autocast copy shared by the four projections
        qkv, conv_tail = self.conv1d(self.in_proj_qkv(h), None if state is None else state.conv,
                                      cu_seqlens=cu_seqlens)
        q, k, v = qkv.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        # q, k normalised in float32, then handed to the kernel in the activation dtype (bf16
        # under autocast: tensor-core dots; float32 q/k would force exact fp32 dots, ~10x slower)
        act = activation_dtype(x)
        # only q and k as given are kept, not their float32 copies (l2_normalize: one fused pass
        # each way on a GPU, else the plain body recomputed in the backward)
        q, k = (l2_normalize(t, K, L2_EPS).unflatten(-1, (Hk, K)).to(act) for t in (q, k))  # [B, T, Hk, K]
        v = v.unflatten(-1, (H, V)).to(act)                                 # [B, T, H, V]
        z = self.in_proj_z(h).unflatten(-1, (H, V))
        beta = self.in_proj_b(h).to(compute).sigmoid()                      # [B, T, H]
        log_a = -self.A_log.to(compute).exp() * F.softplus(
            self.in_proj_a(h).to(compute) + self.dt_bias.to(compute))       # [B, T, H] <= 0

        scale = K ** -0.5
        if length == 1 and state is not None and cu_seqlens is None:
            o, recurrent = delta_rule_step(q[:, 0], k[:, 0], v[:, 0], log_a[:, 0], beta[:, 0],
                                           state.recurrent, scale=scale)
            o = o[:, None]
        else:
            o, recurrent = sharded(chunk_delta_rule)(
                q, k, v, log_a, beta, scale=scale,
                initial_state=None if state is None else state.recurrent,
                output_final_state=True, chunk_size=self.config.chunk_size, backend=self.backend,
                **({} if cu_seqlens is None else {"cu_seqlens": cu_seqlens}))
        y = self.norm(o, z).reshape(batch, length, self.value_dim)          # per value head
        offset = next_offset(cu_seqlens, length, 0 if state is None else state.offset)
        out = self.out_proj(y.to(x.dtype))
        return out, RecurrentState(kind=self.kind, recurrent=recurrent, conv=conv_tail, offset=offset)

    def extra_repr(self) -> str:
        return (f"d_model={self.d_model}, k_heads={self.num_k_heads}x{self.head_k_dim}, "
                f"v_heads={self.num_v_heads}x{self.head_v_dim}, conv_size={self.config.conv_size}, "
                f"chunk_size={self.config.chunk_size}")


_COMMON_KEYS = ("conv1d.weight", "dt_bias", "A_log", "norm.weight", "out_proj.weight")
_QWEN3_NEXT_KEYS = frozenset(("in_proj_qkvz.weight", "in_proj_ba.weight") + _COMMON_KEYS)
_QWEN3_5_KEYS = frozenset(("in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight",
                           "in_proj_a.weight") + _COMMON_KEYS)


def convert_hf_weights(hf_state: Mapping[str, torch.Tensor], config: GatedDeltaNetConfig
                       ) -> dict[str, torch.Tensor]:
    """The weights of one HF GDN module as a :class:`GatedDeltaNet` state dict.

    Args:
        hf_state: the state dict of a ``Qwen3NextGatedDeltaNet`` (``in_proj_qkvz``,
            ``in_proj_ba``, ...) or a ``Qwen3_5GatedDeltaNet`` (``in_proj_qkv``, ``in_proj_z``,
            ``in_proj_b``, ``in_proj_a``, ...), keys relative to the module (strip
            ``model.layers.{i}.linear_attn.``).
        config: the matching settings (head counts and sizes).

    Returns:
        ``{name: tensor}`` for :meth:`GatedDeltaNet.load_state_dict` (same dtypes; Qwen3-Next's
        fused projections de-interleaved, ``conv1d.weight`` squeezed to ``[conv_dim, W]``).
    """
    keys = set(hf_state)
    if keys not in (_QWEN3_NEXT_KEYS, _QWEN3_5_KEYS):
        raise ValueError(f"convert_hf_weights: expected the keys of a Qwen3-Next GDN "
                         f"{sorted(_QWEN3_NEXT_KEYS)} or of a Qwen3.5 GDN {sorted(_QWEN3_5_KEYS)}, "
                         f"got {sorted(keys)}")
    out = {name: hf_state[name] for name in _COMMON_KEYS}
    conv = out["conv1d.weight"]
    out["conv1d.weight"] = conv.squeeze(1) if conv.dim() == 3 else conv
    if keys == _QWEN3_5_KEYS:
        out.update({name: hf_state[name] for name in _QWEN3_5_KEYS - set(_COMMON_KEYS)})
        return out

    Hk, H, K, V = config.num_k_heads, config.num_v_heads, config.head_k_dim, config.head_v_dim
    r = H // Hk
    qkvz, ba = hf_state["in_proj_qkvz.weight"], hf_state["in_proj_ba.weight"]
    d_model = qkvz.shape[-1]
    if qkvz.shape != (Hk * (2 * K + 2 * r * V), d_model) or ba.shape != (2 * H, d_model):
        raise ValueError(f"convert_hf_weights: in_proj_qkvz.weight {tuple(qkvz.shape)} / "
                         f"in_proj_ba.weight {tuple(ba.shape)} do not fit Hk={Hk}, H={H}, K={K}, V={V}: "
                         f"expected [{Hk * (2 * K + 2 * r * V)}, d_model] / [{2 * H}, d_model]")
    # rows per key head g: [q_g | k_g | v_g | z_g] and [b_g | a_g] (fix_query_key_value_ordering)
    q, k, v, z = qkvz.view(Hk, 2 * K + 2 * r * V, d_model).split([K, K, r * V, r * V], dim=1)
    b, a = ba.view(Hk, 2 * r, d_model).split([r, r], dim=1)
    out["in_proj_qkv.weight"] = torch.cat([t.reshape(-1, d_model) for t in (q, k, v)])
    out["in_proj_z.weight"] = z.reshape(H * V, d_model)
    out["in_proj_b.weight"] = b.reshape(H, d_model)
    out["in_proj_a.weight"] = a.reshape(H, d_model)
    return out
