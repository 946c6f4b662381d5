"""Mamba-1: the selective state space mixer (Gu & Dao 2023, "Mamba: Linear-Time Sequence Modeling
with Selective State Spaces").

Matches mamba_ssm's ``Mamba`` and Hugging Face transformers' ``MambaMixer``
(``transformers/models/mamba/modeling_mamba.py``), parameter names and shapes included, except
that ``conv1d.weight`` is ``[d_inner, d_conv]`` here (HF / mamba_ssm: ``[d_inner, 1, d_conv]``;
a converter squeezes dim 1). For ``x [B, T, d_model]``::

    x_in, z   = in_proj(x).chunk(2)                     # [B, T, d_inner] each
    u         = silu(causal_conv1d(x_in))               # conv1d: depthwise, kernel d_conv
    dt, B, C  = x_proj(u).split([dt_rank, N, N])
    Δ         = softplus(dt_proj(dt))                   # [B, T, d_inner]
    h_t       = exp(Δ_t A) ⊙ h_{t-1} + Δ_t B_t u_t     # A = -exp(A_log): [d_inner, N]
    y_t       = (C_t · h_t + D u_t) · silu(z_t)
    out       = out_proj(y)

The scan is :func:`hybridzoo.kernels.selective_scan` (``dt_proj.bias`` goes in as its
``delta_bias`` with ``delta_softplus=True``, like mamba_ssm's fused path); a single token with a
state takes :func:`hybridzoo.kernels.selective_scan_step`.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from hybridzoo.kernels import selective_scan, selective_scan_grads, selective_scan_saved, selective_scan_step
from hybridzoo.kernels._dispatch import runs_on_triton
from hybridzoo.layers import recompute
from hybridzoo.layers.base import Mixer, activation_dtype, init_dt_bias_, next_offset
from hybridzoo.layers.conv import ShortConv, short_conv
from hybridzoo.layers.mamba1_inner import Mamba1Inner
from hybridzoo.layers.recompute import Kept, maybe_recomputed, plain_modules
from hybridzoo.layers.state import RecurrentState, state_dtype
from hybridzoo.parallel.context import sharded


@dataclass
class Mamba1Config:
    """Settings of a :class:`Mamba1` mixer (mamba_ssm ``Mamba`` defaults).

    Attributes:
        d_state: N, state entries per channel.
        d_conv: kernel width of the depthwise causal conv.
        expand: ``d_inner = expand * d_model`` channels.
        dt_rank: rank of the step-size projection; ``"auto"`` = ``ceil(d_model / 16)``.
        dt_min, dt_max: the initial step sizes ``softplus(dt_proj.bias)`` are log-uniform in
            ``[dt_min, dt_max]``.
        dt_init_floor: lower clamp of those initial step sizes.
        dt_scale: scales the init of ``dt_proj.weight`` (std ``dt_rank ** -0.5 * dt_scale``).
        dt_init: ``"random"`` (uniform in ``±std``) or ``"constant"`` (all ``std``).
        conv_bias: bias in the conv.
        bias: bias in ``in_proj`` and ``out_proj``.
        keep_scan_states: when the mixer runs recomputed (training), keep the scan's saved
            states (with the Triton backend one float32 state per channel and 16 tokens:
            ``d_state * d_inner / 4`` bytes per token) so that the backward does not run the
            scan's forward again; False recomputes them instead (less memory, a second scan
            forward in every backward). Results are the same either way.
    """

    d_state: int = 16
    d_conv: int = 4
    expand: int = 2
    dt_rank: int | str = "auto"
    dt_min: float = 0.001
    dt_max: float = 0.1
    dt_init_floor: float = 1e-4
    dt_scale: float = 1.0
    dt_init: str = "random"
    conv_bias: bool = True
    bias: bool = False
    keep_scan_states: bool = True


class Mamba1(Mixer):
    """Mamba-1 mixer: ``y, state = mixer(x, state=None)``, ``x, y: [B, T, d_model]``.

    Parameters (names and shapes as HF ``MambaMixer``): ``in_proj`` (d_model -> 2·d_inner),
    ``conv1d`` (:class:`ShortConv`, weight ``[d_inner, d_conv]``), ``x_proj``
    (d_inner -> dt_rank + 2N, no bias), ``dt_proj`` (dt_rank -> d_inner, bias), ``A_log``
    ``[d_inner, N]``, ``D`` ``[d_inner]``, ``out_proj`` (d_inner -> d_model).

    State: ``RecurrentState(kind="mamba1", recurrent=[B, d_inner, N] float32 (float64 for
    float64 inputs), conv=[B, d_conv - 1, d_inner] in x.dtype (the conv's last inputs),
    offset=tokens seen)``.
    """

    kind = "mamba1"
    context_parallel = True

    def __init__(self, d_model: int, config: Mamba1Config | None = None, backend: str = "auto"):
        super().__init__(d_model)
        self.config = config = config or Mamba1Config()
        self.backend = backend
        if config.dt_init not in ("random", "constant"):
            raise ValueError(f"Mamba1: dt_init must be 'random' or 'constant', got {config.dt_init!r}")
        if isinstance(config.dt_rank, str) and config.dt_rank != "auto":
            raise ValueError(f"Mamba1: dt_rank must be 'auto' or an int, got {config.dt_rank!r}")
        self.d_inner = config.expand * d_model
        self.d_state = config.d_state
        self.dt_rank = math.ceil(d_model / 16) if config.dt_rank == "auto" else int(config.dt_rank)

        self.in_proj = nn.Linear(d_model, 2 * self.d_inner, bias=config.bias)
        self.conv1d = ShortConv(self.d_inner, config.d_conv, bias=config.conv_bias,
                                activation="silu", backend=backend)
        self.x_proj = nn.Linear(self.d_inner, self.dt_rank + 2 * self.d_state, bias=False)
        self.dt_proj = nn.Linear(self.dt_rank, self.d_inner, bias=True)
        self.A_log = nn.Parameter(torch.empty(self.d_inner, self.d_state))
        self.D = nn.Parameter(torch.empty(self.d_inner))
        self.reset_ssm_parameters()  # before out_proj: torch's RNG is drawn in mamba_ssm's order
        self.out_proj = nn.Linear(self.d_inner, d_model, bias=config.bias)
        for module in (self.in_proj, self.conv1d, self.dt_proj, self.out_proj):
            if module.bias is not None:
                module.bias._no_weight_decay = True
        self.A_log._no_weight_decay = True
        self.D._no_weight_decay = True

    @torch.no_grad()
    def reset_ssm_parameters(self) -> None:
        """mamba_ssm's init: S4D-real ``A = 1..N`` per channel, ``D = 1``, ``dt_proj`` such that
        ``softplus(dt_proj.bias)`` is log-uniform in ``[dt_min, dt_max]``."""
        cfg = self.config
        A = torch.arange(1, self.d_state + 1, dtype=torch.float32).expand(self.d_inner, -1)
        self.A_log.copy_(torch.log(A))
        self.D.fill_(1.0)
        std = self.dt_rank ** -0.5 * cfg.dt_scale
        if cfg.dt_init == "constant":
            self.dt_proj.weight.fill_(std)
        else:
            self.dt_proj.weight.uniform_(-std, std)
        init_dt_bias_(self.dt_proj.bias, cfg.dt_min, cfg.dt_max, cfg.dt_init_floor)

    def expected_state(self, batch_size: int, dtype: torch.dtype
                       ) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return {
            "recurrent": ((batch_size, self.d_inner, self.d_state), state_dtype(dtype)),
            "conv": ((batch_size, self.config.d_conv - 1, self.d_inner), dtype),
        }

    def mix(self, x: torch.Tensor, state: RecurrentState | None, cu_seqlens: torch.Tensor | None = None
            ) -> tuple[torch.Tensor, RecurrentState]:
        """``x [B, T, d_model]`` -> ``(y [B, T, d_model] in x.dtype, state)``; ``cu_seqlens``:
        packed documents (``B = 1``, per-document states ``[N, ...]``; see :meth:`Mixer.forward`),
        passed to the conv and the scan of every path below (the fused one is not taken).

        With a gradient wanted, everything between ``in_proj`` and ``out_proj`` is recomputed in
        the backward: on our Triton kernels, for a whole sequence without a carried state, by
        :class:`~hybridzoo.layers.mamba1_inner.Mamba1Inner` (its backward written out), otherwise by
        :func:`~hybridzoo.layers.recompute.recomputed`. Per token the step keeps
        ``in_proj``'s input and output and ``out_proj``'s input, as mamba_ssm's fused path does.
        The scan's forward is not run again: the step keeps the state the scan's backward restarts
        from (:func:`~hybridzoo.kernels.selective_scan_saved`; with our Triton backend one state
        per 16 tokens, float32)."""
        if not plain_modules(self.conv1d, self.x_proj):
            return self._mix_modules(x, state, cu_seqlens)
        xz = self.in_proj(x)
        params = (self.conv1d.weight, self.conv1d.bias, self.x_proj.weight, self.dt_proj.weight,
                  self.dt_proj.bias, self.A_log, self.D)
        if cu_seqlens is not None:
            tensors = (xz, *params, None if state is None else state.conv, None if state is None else state.recurrent)
            y, conv_tail, recurrent = maybe_recomputed(functools.partial(self._inner, cu_seqlens=cu_seqlens),
                                                       *tensors, keeps=True)
        elif self._fused_inner(xz, params, state):
            device = xz.device.type
            cast = (torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device)
                    and xz.dtype == torch.get_autocast_dtype(device) else None)
            y, conv_tail, recurrent = Mamba1Inner.apply(xz, *params, self.dt_rank, cast)
        else:
            tensors = (xz, *params, None if state is None else state.conv, None if state is None else state.recurrent)
            y, conv_tail, recurrent = maybe_recomputed(self._inner, *tensors, keeps=True)
        offset = next_offset(cu_seqlens, x.shape[1], 0 if state is None else state.offset)
        out = self.out_proj(y.to(activation_dtype(x)))
        return out, RecurrentState(kind=self.kind, recurrent=recurrent, conv=conv_tail, offset=offset)

    def _fused_inner(self, xz: torch.Tensor, params: tuple, state: RecurrentState | None) -> bool:
        """Whether this training call takes :class:`~hybridzoo.layers.mamba1_inner.Mamba1Inner` (one
        autograd node with a written-out backward) instead of the recomputed body: a gradient is
        wanted, no state comes in, the sequence fills the conv's window, the scan's states are kept
        and the conv and scan run on our Triton kernels."""
        return (state is None and self.config.keep_scan_states and self.conv1d.activation == "silu"
                and xz.shape[1] >= self.config.d_conv - 1 and xz.shape[1] > 1
                and recompute.wants_recompute(xz, *params)
                and runs_on_triton(self.backend, xz.device, ("causal_conv1d", "selective_scan")))

    def _mix_modules(self, x: torch.Tensor, state: RecurrentState | None, cu_seqlens: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, RecurrentState]:
        """:meth:`mix` through the submodules (called as modules, everything kept for the backward):
        taken when one of them is replaced or hooked (:func:`~hybridzoo.layers.recompute.plain_modules`)."""
        def conv(x_in, tail):
            return self.conv1d(x_in, tail, cu_seqlens=cu_seqlens)

        y, conv_tail, recurrent = self._body(
            self.in_proj(x), conv, self.x_proj, self.dt_proj.weight, self.dt_proj.bias, self.A_log,
            self.D, None if state is None else state.conv, None if state is None else state.recurrent,
            cu_seqlens=cu_seqlens)
        offset = next_offset(cu_seqlens, x.shape[1], 0 if state is None else state.offset)
        out = self.out_proj(y.to(x.dtype))
        return out, RecurrentState(kind=self.kind, recurrent=recurrent, conv=conv_tail, offset=offset)

    def _inner(self, xz, conv_weight, conv_bias, x_proj_weight, dt_proj_weight, dt_proj_bias, A_log,
               D, conv_tail, recurrent, keep: Kept | None = None, cu_seqlens: torch.Tensor | None = None):
        """From ``in_proj``'s output ``xz [B, T, 2·d_inner]`` (the activation dtype) to the gated
        scan output ``[B, T, d_inner]`` (xz's dtype), with the new conv tail and recurrent state.
        The parameters come in as arguments (see :meth:`mix`); ``keep`` (see
        :class:`~hybridzoo.layers.recompute.Kept`) keeps the scan's saved states."""
        def conv(x_in, tail):
            return short_conv(x_in, conv_weight, conv_bias, tail, self.conv1d.activation, self.backend,
                              cu_seqlens=cu_seqlens)

        return self._body(xz, conv, lambda u: F.linear(u, x_proj_weight), dt_proj_weight, dt_proj_bias, A_log,
                          D, conv_tail, recurrent, keep, cu_seqlens)

    def _body(self, xz, conv, x_proj, dt_proj_weight, dt_proj_bias, A_log, D, conv_tail, recurrent,
              keep: Kept | None = None, cu_seqlens: torch.Tensor | None = None):
        """The mixer between ``in_proj`` and ``out_proj``, shared by :meth:`_inner` (weights as
        tensors) and :meth:`_mix_modules` (submodules): ``conv(x_in, tail) -> (u, tail)`` and
        ``x_proj(u)`` are the short convolution and the x projection either way. Returns the gated
        scan output ``[B, T, d_inner]``, the conv tail and the recurrent state."""
        x_in, z = xz.chunk(2, dim=-1)                                       # [B, T, d_inner]
        u, conv_tail = conv(x_in, conv_tail)
        dt, B, C = x_proj(u).split([self.dt_rank, self.d_state, self.d_state], dim=-1)
        delta = F.linear(dt, dt_proj_weight)                                # bias added in the scan
        A = -torch.exp(A_log.to(state_dtype(A_log.dtype)))                  # [d_inner, N]
        if xz.shape[1] == 1 and recurrent is not None and cu_seqlens is None:
            y, recurrent = selective_scan_step(
                u[:, 0], delta[:, 0], A, B[:, 0], C[:, 0], D, z[:, 0],
                delta_bias=dt_proj_bias, delta_softplus=True, state=recurrent)
            return y[:, None], conv_tail, recurrent
        if keep is not None and self.config.keep_scan_states:  # recomputed: the first run's saved states
            saved, grads = self._scan_saved, self._scan_grads
            if cu_seqlens is not None:
                saved = functools.partial(saved, cu_seqlens=cu_seqlens)
                grads = functools.partial(grads, cu_seqlens=cu_seqlens)
            y, recurrent, _ = keep.op(saved, grads, (u, delta, A, B, C, D, z, dt_proj_bias,
                                      recurrent), keep_values=(False, False, True), grads_take_outputs=True)
            return y, conv_tail, recurrent
        y, recurrent = sharded(selective_scan)(
            u, delta, A, B, C, D, z, delta_bias=dt_proj_bias, delta_softplus=True,
            initial_state=recurrent, output_final_state=True, backend=self.backend,
            **({} if cu_seqlens is None else {"cu_seqlens": cu_seqlens}))
        return y, conv_tail, recurrent

    def _scan_saved(self, u, delta, A, B, C, D, z, delta_bias, initial_state, cu_seqlens=None):
        """The scan with no graph: ``(y, final state, saved)`` (y and the final state are only
        returned by the body, so only ``saved`` is kept)."""
        return selective_scan_saved(u, delta, A, B, C, D, z, delta_bias, True, initial_state,
                                    cu_seqlens=cu_seqlens, backend=self.backend)

    def _scan_grads(self, u, delta, A, B, C, D, z, delta_bias, initial_state, y, final, saved, dy, dfinal, dsaved,
                    cu_seqlens=None):
        """The backward of :meth:`_scan_saved` from its ``saved`` states, without a second forward."""
        return selective_scan_grads(u, delta, A, B, C, D, z, delta_bias, initial_state, saved, dy, dfinal,
                                    delta_softplus=True, cu_seqlens=cu_seqlens, backend=self.backend)

    def extra_repr(self) -> str:
        return (f"d_model={self.d_model}, d_inner={self.d_inner}, d_state={self.d_state}, "
                f"dt_rank={self.dt_rank}, d_conv={self.config.d_conv}")
