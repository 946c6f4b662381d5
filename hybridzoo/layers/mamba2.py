"""Mamba-2: the SSD mixer (Dao & Gu 2024, "Transformers are SSMs: Generalized Models and Efficient
Algorithms Through Structured State Space Duality").

Matches mamba_ssm's ``Mamba2`` and Hugging Face transformers' ``Mamba2Mixer``
(``transformers/models/mamba2/modeling_mamba2.py``), parameter names and shapes included, except
that ``conv1d.weight`` is ``[conv_dim, d_conv]`` here (HF / mamba_ssm: ``[conv_dim, 1, d_conv]``;
a converter squeezes dim 1). With ``H = d_inner / head_dim`` heads of size ``P = head_dim``,
``G = n_groups`` groups of B/C of size ``N = d_state`` (head ``h`` reads group ``h // (H / G)``)::

    z, xBC, dt = in_proj(x).split([d_inner, d_inner + 2GN, H])    # HF's order; no d_mlp part
    x, B, C    = silu(causal_conv1d(xBC)).split([d_inner, GN, GN])
    Δ          = clamp(softplus(dt + dt_bias), *time_step_limit)   # [B, T, H] float32
    S_t        = exp(Δ_t A) S_{t-1} + B_t (Δ_t x_t)ᵀ              # per head, S: [N, P], A = -exp(A_log)
    y_t        = S_tᵀ C_t + D x_t
    out        = out_proj(rmsnorm(y ⊙ silu(z)) per group of d_inner / G channels)

The scan is SSD, i.e. :func:`hybridzoo.kernels.chunk_linear_attn` with a scalar decay per head:
``q = C``, ``k = B``, ``v = Δ x``, ``log_a = Δ A``, ``scale = 1``; a single token with a state
takes :func:`hybridzoo.kernels.linear_attn_step`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from hybridzoo.kernels import chunk_linear_attn, chunk_linear_attn_grads, linear_attn_step
from hybridzoo.kernels._dispatch import runs_on_triton
from hybridzoo.layers import recompute
from hybridzoo.layers.base import Mixer, init_dt_bias_, next_offset
from hybridzoo.layers.conv import ShortConv, short_conv
from hybridzoo.layers.mamba2_inner import NO_LIMIT, Mamba2Inner, d_skip, ssd_inputs
from hybridzoo.layers.norms import GatedRMSNorm, _fused_kernels, gated_rms_norm
from hybridzoo.layers.recompute import Kept, kept_op, linear_grads, maybe_recomputed, plain_modules
from hybridzoo.layers.state import RecurrentState, state_dtype
from hybridzoo.parallel.context import sharded


@dataclass
class Mamba2Config:
    """Settings of a :class:`Mamba2` mixer (mamba_ssm ``Mamba2`` defaults).

    Attributes:
        d_state: N, the state rows per head (the size of B and C).
        d_conv: kernel width of the depthwise causal conv over ``xBC``.
        expand: ``d_inner = expand * d_model``.
        head_dim: P, channels per head; ``H = d_inner / head_dim`` heads.
        n_groups: G, groups of B/C; each serves ``H / G`` heads (and the gated norm is taken
            over groups of ``d_inner / G`` channels).
        chunk_size: tokens per chunk of the SSD kernel.
        dt_min, dt_max: initial step sizes ``softplus(dt_bias)`` are log-uniform in this range.
        dt_init_floor: lower clamp of those initial step sizes.
        A_init_range: ``A_log = log(uniform(*A_init_range))`` per head at init.
        time_step_limit: ``Δ`` is clamped to this range after the softplus.
        conv_bias: bias in the conv.
        bias: bias in ``in_proj`` and ``out_proj``.
        norm_eps: epsilon of the gated RMSNorm.
    """

    d_state: int = 128
    d_conv: int = 4
    expand: int = 2
    head_dim: int = 64
    n_groups: int = 1
    chunk_size: int = 256
    dt_min: float = 0.001
    dt_max: float = 0.1
    dt_init_floor: float = 1e-4
    A_init_range: tuple[float, float] = (1.0, 16.0)
    time_step_limit: tuple[float, float] = (0.0, float("inf"))
    conv_bias: bool = True
    bias: bool = False
    norm_eps: float = 1e-5


class Mamba2(Mixer):
    """Mamba-2 mixer: ``y, state = mixer(x, state=None)``, ``x, y: [B, T, d_model]``.

    Parameters (names and shapes as HF ``Mamba2Mixer``): ``in_proj`` (d_model ->
    2·d_inner + 2GN + H), ``conv1d`` (:class:`ShortConv`, weight ``[conv_dim, d_conv]`` with
    ``conv_dim = d_inner + 2GN``), ``dt_bias``, ``A_log``, ``D`` (each ``[H]``), ``norm``
    (:class:`GatedRMSNorm`, weight ``[d_inner]``), ``out_proj`` (d_inner -> d_model).

    State: ``RecurrentState(kind="mamba2", recurrent=[B, H, N, P] float32 (float64 for float64
    inputs; rows are the B/C state index, i.e. HF's ``[B, H, P, N]`` transposed),
    conv=[B, d_conv - 1, conv_dim] in x.dtype, offset=tokens seen)``.
    """

    kind = "mamba2"
    context_parallel = True

    def __init__(self, d_model: int, config: Mamba2Config | None = None, backend: str = "auto"):
        super().__init__(d_model)
        self.config = config = config or Mamba2Config()
        self.backend = backend
        self.d_inner = config.expand * d_model
        if self.d_inner % config.head_dim:
            raise ValueError(f"Mamba2: d_inner = expand * d_model = {self.d_inner} is not a multiple "
                             f"of head_dim {config.head_dim}")
        self.n_heads = self.d_inner // config.head_dim
        if self.n_heads % config.n_groups:
            raise ValueError(f"Mamba2: the head count {self.n_heads} is not a multiple of "
                             f"n_groups {config.n_groups}")
        self.head_dim, self.n_groups, self.d_state = config.head_dim, config.n_groups, config.d_state
        self.conv_dim = self.d_inner + 2 * self.n_groups * self.d_state

        self.in_proj = nn.Linear(d_model, self.d_inner + self.conv_dim + self.n_heads, bias=config.bias)
        self.conv1d = ShortConv(self.conv_dim, config.d_conv, bias=config.conv_bias,
                                activation="silu", backend=backend)
        self.dt_bias = nn.Parameter(torch.empty(self.n_heads))
        self.A_log = nn.Parameter(torch.empty(self.n_heads))
        self.D = nn.Parameter(torch.empty(self.n_heads))
        self.reset_ssm_parameters()  # before out_proj: torch's RNG is drawn in mamba_ssm's order
        self.norm = GatedRMSNorm(self.d_inner, eps=config.norm_eps,
                                 group_size=self.d_inner // self.n_groups, norm_before_gate=False)
        self.out_proj = nn.Linear(self.d_inner, d_model, bias=config.bias)
        for module in (self.in_proj, self.conv1d, self.out_proj):
            if module.bias is not None:
                module.bias._no_weight_decay = True
        for p in (self.dt_bias, self.A_log, self.D, self.norm.weight):
            p._no_weight_decay = True

    @torch.no_grad()
    def reset_ssm_parameters(self) -> None:
        """mamba_ssm's init: ``A_log = log(uniform(A_init_range))``, ``D = 1``, ``dt_bias`` such
        that ``softplus(dt_bias)`` is log-uniform in ``[dt_min, dt_max]``."""
        cfg = self.config
        init_dt_bias_(self.dt_bias, cfg.dt_min, cfg.dt_max, cfg.dt_init_floor)
        self.A_log.copy_(torch.log(torch.empty(self.n_heads).uniform_(*cfg.A_init_range)))
        self.D.fill_(1.0)

    def expected_state(self, batch_size: int, dtype: torch.dtype
                       ) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return {
            "recurrent": ((batch_size, self.n_heads, self.d_state, self.head_dim), state_dtype(dtype)),
            "conv": ((batch_size, self.config.d_conv - 1, self.conv_dim), dtype),
        }

    def mix(self, x: torch.Tensor, state: RecurrentState | None, cu_seqlens: torch.Tensor | None = None
            ) -> tuple[torch.Tensor, RecurrentState]:
        """``x [B, T, d_model]`` -> ``(y [B, T, d_model] in x.dtype, state)``; ``cu_seqlens``:
        packed documents (``B = 1``, per-document states ``[N, ...]``; see :meth:`Mixer.forward`),
        passed to the conv and the scan of every path below (the fused one is not taken).

        With a gradient wanted, everything after ``in_proj`` runs recomputed in the backward: on
        our Triton kernels, for a whole sequence without a carried state, by
        :class:`~hybridzoo.layers.mamba2_inner.Mamba2Inner` (its backward written out), otherwise by
        :func:`~hybridzoo.layers.recompute.recomputed`. Per token the step keeps ``in_proj``'s
        input and output and the scan's output, as mamba_ssm's fused path does; the backward
        reruns the conv, gates and norm, not the scan's forward nor ``out_proj``."""
        if not plain_modules(self.conv1d, self.norm, self.out_proj):
            return self._mix_modules(x, state, cu_seqlens)
        zxbcdt = self.in_proj(x)
        params = (self.conv1d.weight, self.conv1d.bias, self.dt_bias, self.A_log, self.D, self.norm.weight,
                  self.out_proj.weight, self.out_proj.bias)
        if cu_seqlens is not None:
            tensors = (zxbcdt, *params, None if state is None else state.conv,
                       None if state is None else state.recurrent)
            out, conv_tail, recurrent = maybe_recomputed(functools.partial(self._inner, cu_seqlens=cu_seqlens),
                                                         *tensors, keeps=True)
        elif self._fused_inner(zxbcdt, params, state):
            cfg = self.config
            shape = (self.n_heads, self.head_dim, self.n_groups, self.d_state, cfg.chunk_size, self.norm.eps,
                     self.norm.group_size)
            out, conv_tail, recurrent = Mamba2Inner.apply(zxbcdt, *params, shape)
        else:
            tensors = (zxbcdt, *params, None if state is None else state.conv,
                       None if state is None else state.recurrent)
            out, conv_tail, recurrent = maybe_recomputed(self._inner, *tensors, keeps=True)
        offset = next_offset(cu_seqlens, x.shape[1], 0 if state is None else state.offset)
        return out, RecurrentState(kind=self.kind, recurrent=recurrent, conv=conv_tail, offset=offset)

    def _fused_inner(self, zxbcdt: torch.Tensor, params: tuple, state: RecurrentState | None) -> bool:
        """Whether this training call takes :class:`~hybridzoo.layers.mamba2_inner.Mamba2Inner` (one
        autograd node with a written-out backward) instead of the recomputed body: a gradient is
        wanted, no state comes in, the sequence fills the conv's window, no step-size limit, and
        the conv, the scan and the gated norm run on our Triton kernels."""
        return (state is None and tuple(self.config.time_step_limit) == NO_LIMIT
                and self.conv1d.activation == "silu" and self.norm.norm_before_gate is False
                and zxbcdt.shape[1] >= self.config.d_conv - 1 and zxbcdt.shape[1] > 1
                and recompute.wants_recompute(zxbcdt, *params)
                and runs_on_triton(self.backend, zxbcdt.device, ("causal_conv1d", "chunk_linear_attn"))
                and _fused_kernels(self.norm.group_size, zxbcdt, self.norm.weight) is not None)

    def _mix_modules(self, x: torch.Tensor, state: RecurrentState | None, cu_seqlens: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, RecurrentState]:
        """:meth:`mix` through the submodules (called as modules, everything kept for the backward):
        taken when one of them is replaced or hooked (:func:`~hybridzoo.layers.recompute.plain_modules`)."""
        def conv(xBC, tail):
            return self.conv1d(xBC, tail, cu_seqlens=cu_seqlens)

        out, conv_tail, recurrent = self._body(
            self.in_proj(x), conv, self.norm, lambda y: self.out_proj(y.to(x.dtype)), self.dt_bias,
            self.A_log, self.D, None if state is None else state.conv, None if state is None else state.recurrent,
            cu_seqlens=cu_seqlens)
        offset = next_offset(cu_seqlens, x.shape[1], 0 if state is None else state.offset)
        return out, RecurrentState(kind=self.kind, recurrent=recurrent, conv=conv_tail, offset=offset)

    def _inner(self, zxbcdt, conv_weight, conv_bias, dt_bias, A_log, D, norm_weight, out_weight,
               out_bias, conv_tail, recurrent, keep: Kept | None = None, cu_seqlens: torch.Tensor | None = None):
        """From ``in_proj``'s output ``zxbcdt [B, T, 2·d_inner + 2GN + H]`` (the activation dtype)
        to the mixer's output ``[B, T, d_model]`` (the same dtype), with the new conv tail and
        recurrent state. The parameters come in as arguments (see :meth:`mix`); ``keep`` (see
        :class:`~hybridzoo.layers.recompute.Kept`) keeps the scan's output for the backward."""
        def conv(xBC, tail):
            return short_conv(xBC, conv_weight, conv_bias, tail, self.conv1d.activation, self.backend,
                              cu_seqlens=cu_seqlens)

        def norm(y, z):
            return gated_rms_norm(y, z, norm_weight, self.norm.eps, self.norm.group_size, self.norm.norm_before_gate)

        def out(y):  # out_proj on the activation dtype (autocast's casts, made explicit for the kept path)
            dtype = zxbcdt.dtype
            linear = (y.to(dtype), out_weight.to(dtype), None if out_bias is None else out_bias.to(dtype))
            return kept_op(keep, lambda *a: (F.linear(*a),), linear_grads, linear, keep_values=False)[0]

        return self._body(zxbcdt, conv, norm, out, dt_bias, A_log, D, conv_tail, recurrent, keep, cu_seqlens)

    def _body(self, zxbcdt, conv, norm, out, dt_bias, A_log, D, conv_tail, recurrent, keep: Kept | None = None,
              cu_seqlens: torch.Tensor | None = None):
        """The mixer after ``in_proj``, shared by :meth:`_inner` (weights as tensors) and
        :meth:`_mix_modules` (submodules): ``conv(xBC, tail) -> (xBC, tail)``, ``norm(y, z)`` (the
        gated RMSNorm) and ``out(y)`` (``out_proj``) are called either way. Returns the output
        ``[B, T, d_model]``, the conv tail and the recurrent state."""
        batch, length, _ = zxbcdt.shape
        H, P, G, N = self.n_heads, self.head_dim, self.n_groups, self.d_state
        z, xBC, dt = zxbcdt.split([self.d_inner, self.conv_dim, H], dim=-1)
        xBC, conv_tail = conv(xBC, conv_tail)
        xs, B, C = xBC.split([self.d_inner, G * N, G * N], dim=-1)
        xs = xs.unflatten(-1, (H, P))                                       # [B, T, H, P]
        B, C = B.unflatten(-1, (G, N)), C.unflatten(-1, (G, N))              # [B, T, G, N]

        y, recurrent = self._ssd(xs, B, C, dt, dt_bias, A_log, D, recurrent, keep, cu_seqlens)
        y = norm(y.reshape(batch, length, self.d_inner), z)
        return out(y), conv_tail, recurrent

    def _ssd(self, xs, B, C, dt, dt_bias, A_log, D, recurrent, keep: Kept | None = None,
             cu_seqlens: torch.Tensor | None = None):
        """The SSD part of :meth:`_body`, from the conv's output (``xs [B, T, H, P]``, ``B``, ``C``
        ``[B, T, G, N]``) and ``in_proj``'s raw ``dt [B, T, H]`` to ``y + D x`` (``[B, T, H, P]``
        float32, float64 for float64) and the recurrent state."""
        _, _, _, log_a, v = ssd_inputs(xs, dt, dt_bias, A_log, self.config.time_step_limit)
        if xs.shape[1] == 1 and recurrent is not None and cu_seqlens is None:
            y, recurrent = linear_attn_step(C[:, 0], B[:, 0], v[:, 0], log_a[:, 0], recurrent, scale=1.0)
            y = y[:, None]
        else:
            scan, grads = self._scan, self._scan_grads
            if cu_seqlens is not None:
                scan = functools.partial(scan, cu_seqlens=cu_seqlens)
                grads = functools.partial(grads, cu_seqlens=cu_seqlens)
            y, recurrent = kept_op(keep, scan, grads, (C, B, v, log_a, recurrent),
                                   keep_values=(True, False))   # the final state is only returned
        return d_skip(y, D, xs), recurrent

    def _scan(self, C, B, v, log_a, initial_state, cu_seqlens=None):
        """SSD: ``(y [B, T, H, P] in v.dtype, final state [B, H, N, P])`` (``[N, H, N, P]``, one
        per document, with ``cu_seqlens``)."""
        return sharded(chunk_linear_attn)(C, B, v, log_a, scale=1.0, initial_state=initial_state,
                                          output_final_state=True, chunk_size=self.config.chunk_size,
                                          backend=self.backend,
                                          **({} if cu_seqlens is None else {"cu_seqlens": cu_seqlens}))

    def _scan_grads(self, C, B, v, log_a, initial_state, dy, dfinal, cu_seqlens=None):
        """The backward of :meth:`_scan` without its forward (its output was kept)."""
        return chunk_linear_attn_grads(C, B, v, log_a, initial_state, dy, dfinal, scale=1.0,
                                       chunk_size=self.config.chunk_size, cu_seqlens=cu_seqlens,
                                       backend=self.backend)

    def extra_repr(self) -> str:
        return (f"d_model={self.d_model}, d_inner={self.d_inner}, heads={self.n_heads}x{self.head_dim}, "
                f"n_groups={self.n_groups}, d_state={self.d_state}, chunk_size={self.config.chunk_size}")
