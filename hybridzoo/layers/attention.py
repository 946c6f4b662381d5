"""Softmax attention, full or sliding-window, with a K/V store as its state (mixer kind ``attn``).

Matches Hugging Face transformers' ``LlamaAttention`` (GQA, rotary), ``Qwen3Attention``
(per-head RMSNorm on q and k, optional sliding window) and ``Qwen3NextAttention`` (gated
attention, zero-centred q/k norms, partial rotary); parameter names and shapes are theirs
(``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``, ``q_norm``, ``k_norm``). With ``H`` query
heads, ``Hk`` K/V heads (query head ``h`` uses K/V head ``h // (H / Hk)``) and head size ``D``::

    q, gate = q_proj(x)       # [B, T, H, D] each; per head the D query channels, then the D gate
                              # channels (Qwen3-Next's layout; no gate without output_gate)
    k, v    = k_proj(x), v_proj(x)                      # [B, T, Hk, D]
    q, k    = q_norm(q), k_norm(k)                      # if qk_norm (RMSNorm over D, per head)
    q, k    = rotary(q, offset), rotary(k, offset)      # first rotary_dim channels of each head
    o       = softmax(D**-0.5 q kᵀ + causal/window mask) v     # over the stored prefix + this call
    y       = o_proj(o * sigmoid(gate))                 # gate only if output_gate

The state is a :class:`KVState`: the rotated keys and the values seen so far, in one buffer that
is appended to in place (see :class:`KVState` for when a copy is made instead). SeCO passes a
:class:`BlockKVState` instead: one store for the whole sequence, attended block by block, whose
backward adds the prefix's K/V gradients into one buffer (full attention only). That call runs
through :func:`~hybridzoo.layers.chunk_attention.chunk_attention` (prefix and own keys in one
Function, PyTorch's flash backward per block) where it applies, i.e. on the CPU and, for bf16/fp16,
on CUDA (the default); otherwise through :func:`~hybridzoo.layers.prefix_attention.block_prefix_attention` merged
with the call's own causal attention.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
from torch import nn

from hybridzoo.kernels import attention, merge_attention
from hybridzoo.layers.base import Mixer, document_positions, projection_input
from hybridzoo.layers.norms import RMSNorm
from hybridzoo.layers.chunk_attention import chunk_attention, chunk_attention_applies
from hybridzoo.layers.prefix_attention import block_prefix_attention
from hybridzoo.layers.rotary import Rotary
from hybridzoo.layers.state import MixerState, StateError
from hybridzoo.parallel.context import sequence_start, sharded


@dataclass
class AttentionConfig:
    """Settings of an :class:`Attention` mixer (defaults: a 340M-class model, d_model 1024).

    Attributes:
        n_heads: query heads H.
        n_kv_heads: key/value heads Hk, a divisor of H (GQA); None = H (multi-head attention).
        head_dim: channels per head D; None = d_model // n_heads.
        window: None = full causal attention; an int w >= 1 = sliding window: each query sees
            ``w`` positions, itself included (key ``j`` is visible from query ``p`` iff
            ``0 <= p - j < w``, transformers' ``sliding_window``).
        qk_norm: RMSNorm over D on every head of q and k (Qwen3, Qwen3-Next), before rotary.
        norm_zero_centered: the q/k norms scale by ``1 + weight`` (Qwen3-Next), weights start at 0.
        output_gate: gated attention (Qwen3-Next): ``q_proj`` also emits a gate,
            ``o *= sigmoid(gate)`` before ``o_proj``.
        rotary_dim: channels per head that get rotary (even, <= D); None = use
            ``partial_rotary_factor``.
        partial_rotary_factor: ``rotary_dim = int(D * partial_rotary_factor)`` when rotary_dim is
            None (Qwen3-Next: 0.25).
        rope_base: rotary base (``rope_theta``).
        bias: biases on q_proj, k_proj, v_proj and o_proj.
        norm_eps: epsilon of the q/k norms.
        initializer_range: std of the normal init of the projection weights (biases start at 0).
    """

    n_heads: int = 16
    n_kv_heads: int | None = None
    head_dim: int | None = None
    window: int | None = None
    qk_norm: bool = False
    norm_zero_centered: bool = False
    output_gate: bool = False
    rotary_dim: int | None = None
    partial_rotary_factor: float = 1.0
    rope_base: float = 10000.0
    bias: bool = False
    norm_eps: float = 1e-6
    initializer_range: float = 0.02


class _HighWater:
    """How far a K/V buffer has been written, shared by every state viewing that buffer."""

    __slots__ = ("end",)

    def __init__(self, end: int):
        self.end = end

    def __repr__(self) -> str:
        return f"_HighWater({self.end})"


@dataclass
class KVState(MixerState):
    """State of an attention mixer: the rotated keys and the values seen so far.

    Attributes:
        k_buf, v_buf: ``[B, capacity, Hk, D]`` in the activation dtype (rotary already applied to
            the keys). Only ``[:, start : start + length]`` is valid (:attr:`k`, :attr:`v`).
        start: first valid position in the buffer (always 0 for full attention).
        length: number of valid positions. Full attention keeps every token; a sliding window of
            ``w`` keeps the last ``w - 1`` (all that a future query can see).
        offset: number of tokens consumed so far (rotary positions continue from it).

    Appending (done by :class:`Attention`, never by the user):

    * **In place**: when the buffer has room after the valid positions and autograd is not
      recording through the state (grad disabled, or neither the new keys/values nor the buffer
      require grad), the new tokens are written into the buffer and the returned state is a new
      ``KVState`` sharing it, with a larger ``length``: no copy. This is how decoding, SeCO and
      long prefill share one mechanism; :meth:`Attention.init_state` preallocates the buffer.
    * **Grow**: with no room, a new buffer of twice the capacity is allocated and the valid
      positions copied once (amortised O(1) per token). A sliding window instead moves its
      ``w - 1`` kept positions to the front of a fresh ``2 (w - 1)`` buffer, so the state stays
      bounded.
    * **Functionally** (``torch.cat``) when gradients must flow through the state (training with
      a carried state, SeCO's backward): an in-place write would bump the version of a buffer
      whose views autograd saved in earlier calls and make ``backward`` fail. The new buffer is
      then exactly full.

    Branching is safe: every state sharing a buffer shares its high-water mark (how far the
    buffer has been written). Extending an older state whose valid positions end before that mark
    (e.g. two continuations of one prompt) would overwrite tokens a newer state still uses, so it
    copies into a fresh buffer instead. Older states thus always stay valid. (``map`` and
    ``detach`` copies keep sharing the mark; at worst that costs one needless copy.)

    Decoding should run under ``torch.no_grad()`` / ``torch.inference_mode()``: with autograd
    recording, every append is functional (one copy of the store per call).
    """

    k_buf: torch.Tensor | None = None
    v_buf: torch.Tensor | None = None
    start: int = 0
    length: int = 0
    offset: int = 0
    high_water: _HighWater = field(default_factory=lambda: _HighWater(0), repr=False, compare=False)

    @property
    def k(self) -> torch.Tensor:
        """Valid keys ``[B, length, Hk, D]``: a view of ``k_buf``, never a copy."""
        return self.k_buf[:, self.start:self.start + self.length]

    @property
    def v(self) -> torch.Tensor:
        """Valid values ``[B, length, Hk, D]``: a view of ``v_buf``, never a copy."""
        return self.v_buf[:, self.start:self.start + self.length]

    @property
    def capacity(self) -> int:
        return self.k_buf.shape[1]


@dataclass
class BlockKVState(MixerState):
    """A full-attention state for chunked training (SeCO): one K/V store for the whole sequence.

    A call with this state attends to its own tokens causally and to the stored prefix
    ``[:, :length]`` block by block (:func:`~hybridzoo.layers.prefix_attention.block_prefix_attention`),
    the two merged by log-sum-exp; the prefix is read in place (no copy, also from host memory).
    The returned state is this one advanced by the call's ``T`` tokens, with ``own_k``/``own_v``
    set to the call's keys/values (autograd tensors: SeCO feeds them the gradient that later
    chunks left in ``k_grad``/``v_grad``). Full attention only; a sliding window keeps a
    :class:`KVState` (it is a bounded, Markov state).

    Attributes:
        k_buf, v_buf: the stores ``[B, capacity, Hk, D]`` in the activation dtype, or None until the
            first call allocates them (on ``store_device``, pinned if ``pin_memory``).
        capacity: positions the stores hold (the sequence length).
        length: positions already in the store, i.e. the prefix of the next call.
        offset: tokens consumed so far (rotary positions); equals ``length``.
        block_size: prefix positions read per block.
        store_device: where the stores live (None: with the activations; ``"cpu"``: offloaded).
        pin_memory: allocate host stores in pinned memory (only with CUDA available).
        read_only: False: a call writes its K/V into the store (stage 1); True: the store already
            holds them and is only read (stage 2, recomputation with grad).
        k_grad, v_grad: gradient buffers shaped like the stores, on the activations' device, or None.
        own_k, own_v: keys/values ``[B, T, Hk, D]`` of the call that returned this state.
        doc_start: packed documents (a call with ``cu_seqlens``): the store position where the
            document that continues into the next call began; that call's first document attends
            to ``[doc_start, length)`` of the store, its other documents to nothing stored. A
            document starting exactly at the next call's first token: ``doc_start = length``
            (SeCO sets it). 0 without documents.
    """

    k_buf: torch.Tensor | None = None
    v_buf: torch.Tensor | None = None
    capacity: int = 0
    length: int = 0
    offset: int = 0
    block_size: int = 4096
    store_device: torch.device | str | None = None
    pin_memory: bool = False
    read_only: bool = False
    k_grad: torch.Tensor | None = None
    v_grad: torch.Tensor | None = None
    own_k: torch.Tensor | None = field(default=None, repr=False)
    own_v: torch.Tensor | None = field(default=None, repr=False)
    doc_start: int = 0

    def check(self, kind: str, batch_size: int, device: torch.device,
              expected: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> None:
        """Kind, batch, heads and head size must fit; the stores may sit on another device and,
        under autocast, hold another dtype than the input; the gradient buffers must be on the
        input's device."""
        if self.kind != kind:
            raise StateError(f"{kind}: got a state of a {self.kind!r} mixer")
        for name in ("k_buf", "v_buf", "k_grad", "v_grad"):
            tensor = getattr(self, name)
            if tensor is None:
                continue
            shape = expected["v_buf" if name.startswith("v") else "k_buf"][0]
            if tensor.dim() != 4 or tensor.shape[0] != batch_size or tuple(tensor.shape[2:]) != tuple(shape[2:]) \
                    or tensor.shape[1] != self.capacity:
                raise StateError(f"{kind}: BlockKVState field {name!r} has shape {tuple(tensor.shape)}, "
                                 f"expected {(batch_size, self.capacity, *shape[2:])}")
            if name.endswith("grad") and tensor.device != device:
                raise StateError(f"{kind}: BlockKVState field {name!r} is on {tensor.device}, input on {device}")


class Attention(Mixer):
    """Causal softmax attention mixer: ``y, state = mixer(x, state=None)``, ``x, y: [B, T, d_model]``.

    Parameters (names and shapes as transformers' Llama / Qwen3 / Qwen3-Next attention):
    ``q_proj`` (d_model -> H·D, or 2·H·D with output_gate), ``k_proj`` and ``v_proj``
    (d_model -> Hk·D), ``o_proj`` (H·D -> d_model), ``q_norm`` and ``k_norm``
    (:class:`RMSNorm` over D, if qk_norm).

    State: :class:`KVState` (kind ``"attn"``), keys and values ``[B, capacity, Hk, D]`` in
    x.dtype. Every call, ``T = 1`` included, is one call of :func:`hybridzoo.kernels.attention`
    with the stored keys/values as its prefix (K/V heads are never expanded to the query heads).

    Packed documents (``cu_seqlens``, ``x [1, total, d_model]``): a query attends only to keys of
    its own document (the window counts positions inside it) and rotary positions restart at 0 at
    each document. The K/V store is that of ONE document, batch 1: a state passed in is the prefix
    of the first document of the call (which continues it; its positions continue from the
    state's offset), the other documents start empty; the returned state holds the K/V of the
    last document (the one a next call may continue), ``offset`` its length so far. (Per-document
    stores of every document are not kept: only the last can be continued.)
    """

    kind = "attn"
    context_parallel = True

    def __init__(self, d_model: int, config: AttentionConfig | None = None, backend: str = "auto"):
        super().__init__(d_model)
        self.config = config = config or AttentionConfig()
        self.backend = backend
        self.n_heads = H = config.n_heads
        self.n_kv_heads = Hk = config.n_kv_heads or H
        if H < 1 or H % Hk:
            raise ValueError(f"Attention: n_heads {H} must be a positive multiple of n_kv_heads {Hk}")
        if config.head_dim is None and d_model % H:
            raise ValueError(f"Attention: d_model {d_model} is not a multiple of n_heads {H}; set head_dim")
        self.head_dim = D = config.head_dim or d_model // H
        window = config.window
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            raise ValueError(f"Attention: window must be None or an int >= 1, got {window!r}")
        rotary_dim = config.rotary_dim
        if rotary_dim is None:
            rotary_dim = int(D * config.partial_rotary_factor)
        self.scale = D ** -0.5

        self.q_proj = nn.Linear(d_model, H * D * (2 if config.output_gate else 1), bias=config.bias)
        self.k_proj = nn.Linear(d_model, Hk * D, bias=config.bias)
        self.v_proj = nn.Linear(d_model, Hk * D, bias=config.bias)
        self.o_proj = nn.Linear(H * D, d_model, bias=config.bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(D, eps=config.norm_eps, zero_centered=config.norm_zero_centered)
            self.k_norm = RMSNorm(D, eps=config.norm_eps, zero_centered=config.norm_zero_centered)
        self.rotary = Rotary(D, rotary_dim, base=config.rope_base)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Projection weights ~ N(0, initializer_range²) (transformers' init), biases 0, norm
        weights 1 (0 when zero-centred). Biases and norm weights are marked ``_no_weight_decay``."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, mean=0.0, std=self.config.initializer_range)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
                    module.bias._no_weight_decay = True
            elif isinstance(module, RMSNorm):
                nn.init.constant_(module.weight, 0.0 if module.zero_centered else 1.0)
                module.weight._no_weight_decay = True

    @property
    def keep(self) -> int | None:
        """Positions a state must keep for future queries: all (None) or ``window - 1``."""
        return None if self.config.window is None else self.config.window - 1

    def expected_state(self, batch_size: int, dtype: torch.dtype
                       ) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        shape = (batch_size, -1, self.n_kv_heads, self.head_dim)  # -1: any capacity
        return {"k_buf": (shape, dtype), "v_buf": (shape, dtype)}

    def state_batch(self, x: torch.Tensor, cu_seqlens: torch.Tensor | None) -> int:
        """The K/V store is that of one document with ``cu_seqlens`` (see the class docstring)."""
        return x.shape[0] if cu_seqlens is None else 1

    def init_state(self, batch_size: int, max_length: int, dtype: torch.dtype | None = None,
                   device: torch.device | str | None = None) -> KVState:
        """An empty state whose buffers hold ``max_length`` tokens (a sliding window: at most
        ``2 (window - 1)``), so that appending up to there never reallocates (decoding, SeCO)."""
        dtype = dtype or self.q_proj.weight.dtype
        device = device or self.q_proj.weight.device
        capacity = max_length if self.keep is None else min(max_length, 2 * self.keep)
        shape = (batch_size, capacity, self.n_kv_heads, self.head_dim)
        return KVState(kind=self.kind, k_buf=torch.zeros(shape, dtype=dtype, device=device),
                       v_buf=torch.zeros(shape, dtype=dtype, device=device))

    def mix(self, x: torch.Tensor, state: KVState | None, cu_seqlens: torch.Tensor | None = None
            ) -> tuple[torch.Tensor, KVState]:
        """``x [B, T, d_model]`` -> ``(y [B, T, d_model] in x.dtype, state)``; ``cu_seqlens``:
        packed documents (``B = 1``; the state is that of one document, see the class docstring)."""
        B, T, _ = x.shape
        H, Hk, D = self.n_heads, self.n_kv_heads, self.head_dim
        h = projection_input(x)  # one autocast copy shared by q, k and v's projections
        q = self.q_proj(h)
        gate = None
        if self.config.output_gate:
            q, gate = q.view(B, T, H, 2 * D).chunk(2, dim=-1)  # per head: [q (D), gate (D)]
            gate = gate.reshape(B, T, H * D)
        q = q.reshape(B, T, H, D)
        k = self.k_proj(h).view(B, T, Hk, D)
        v = self.v_proj(h).view(B, T, Hk, D)
        if self.config.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        offset = sequence_start(T) if state is None else state.offset
        positions = None if cu_seqlens is None else document_positions(cu_seqlens, T, offset)
        q, k = self.rotary.pair(q, k, offset=offset, positions=positions)  # one cos / sin table for both

        if cu_seqlens is not None:
            o, state = self._attend_documents(q, k, v, state, cu_seqlens)
        elif isinstance(state, BlockKVState):
            o, state = self._attend_store(q, k, v, state)
        else:
            prefix = None if state is None or state.length == 0 else (state.k, state.v)
            o, _ = sharded(attention)(q, k, v, window=self.config.window, prefix=prefix, scale=self.scale,
                             backend=self.backend)
            state = self._append(state, k, v)
        o = o.reshape(B, T, H * D)
        if gate is not None:
            o = o * torch.sigmoid(gate)
        return self.o_proj(o), state

    def _attend_documents(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          state: KVState | BlockKVState | None, cu_seqlens: torch.Tensor
                          ) -> tuple[torch.Tensor, KVState | BlockKVState]:
        """Packed documents (``q [1, total, H, D]``, ``cu_seqlens [N + 1]``): the first document
        attends to the state's prefix (if any) and itself, every other document to itself only
        (one ``attention`` call with ``cu_seqlens``). Returns the output and the state of the last
        document (see the class docstring)."""
        T = q.shape[1]
        first, last = int(cu_seqlens[1]), int(cu_seqlens[-2])
        n_docs = cu_seqlens.shape[0] - 1
        if isinstance(state, BlockKVState):
            o_first, new_state = self._attend_store(q[:, :first], k[:, :first], v[:, :first], state,
                                                    write=(k, v))
            new_state = dataclasses.replace(new_state, length=state.length + T, offset=T - last if n_docs > 1
                                            else state.offset + T, own_k=k, own_v=v,
                                            doc_start=state.length + last if n_docs > 1 else state.doc_start)
        else:
            prefix = None if state is None or state.length == 0 else (state.k, state.v)
            if prefix is None:
                o_first = None  # every document in the one packed call below
            else:
                o_first, _ = attention(q[:, :first], k[:, :first], v[:, :first], window=self.config.window,
                                       prefix=prefix, scale=self.scale, backend=self.backend)
            new_state = self._append(state if n_docs == 1 else None, k[:, last:], v[:, last:])
        if o_first is None:  # (ring attention under context parallelism)
            o, _ = sharded(attention)(q, k, v, window=self.config.window, scale=self.scale, backend=self.backend,
                                      cu_seqlens=cu_seqlens)
            return o, new_state
        if n_docs == 1:
            return o_first, new_state
        o_rest, _ = attention(q[:, first:], k[:, first:], v[:, first:], window=self.config.window,
                              scale=self.scale, backend=self.backend, cu_seqlens=cu_seqlens[1:] - first)
        return torch.cat([o_first, o_rest], dim=1), new_state

    def _attend_store(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state: BlockKVState,
                      write: tuple[torch.Tensor, torch.Tensor] | None = None
                      ) -> tuple[torch.Tensor, BlockKVState]:
        """Attention over ``state``'s stored prefix (block by block, from ``state.doc_start``) and
        this call's own tokens, merged by log-sum-exp; writes ``write`` (default ``k, v``) into the
        store unless ``state.read_only``."""
        if self.config.window is not None:
            raise ValueError("Attention: a BlockKVState serves full attention only; a sliding-window "
                             "layer carries a KVState")
        k_write, v_write = (k, v) if write is None else write
        T, P = k_write.shape[1], state.length
        if P + T > state.capacity:
            raise ValueError(f"Attention: BlockKVState holds {state.capacity} positions, "
                             f"{P} stored + {T} new do not fit")
        start = state.doc_start  # the prefix this call's (first) document sees: [start, P)
        if not 0 <= start <= P:
            raise ValueError(f"Attention: BlockKVState.doc_start {start} must lie in [0, length {P}]")

        def view(buf):
            return buf if buf is None or start == 0 else buf[:, start:]

        seen = P - start
        if seen > 0 and chunk_attention_applies(q, state.v_buf, self.backend):
            # prefix and own keys in one Function, stock flash backward per block
            o = chunk_attention(q, k, v, view(state.k_buf), view(state.v_buf), seen, block_size=state.block_size,
                                scale=self.scale, k_grad=view(state.k_grad), v_grad=view(state.v_grad),
                                backend=self.backend)
        else:
            # the log-sum-exp only when there is a prefix to merge with (without it SDPA serves)
            o, lse = attention(q, k, v, scale=self.scale, return_lse=seen > 0, backend=self.backend)
            if seen > 0:
                o_prefix, lse_prefix = block_prefix_attention(
                    q, view(state.k_buf), view(state.v_buf), seen, block_size=state.block_size, scale=self.scale,
                    k_grad=view(state.k_grad), v_grad=view(state.v_grad), backend=self.backend)
                o, _ = merge_attention(o_prefix, lse_prefix, o, lse)
        k, v = k_write, v_write
        k_buf, v_buf = state.k_buf, state.v_buf
        if not state.read_only:
            if k_buf is None:  # first call: allocate the stores in the dtype attention consumes
                device = torch.device(state.store_device) if state.store_device is not None else k.device
                pin = state.pin_memory and device.type == "cpu" and torch.cuda.is_available()
                shape = (k.shape[0], state.capacity, *k.shape[2:])
                k_buf = torch.empty(shape, dtype=k.dtype, device=device, pin_memory=pin)
                v_buf = torch.empty(shape[:3] + v.shape[3:], dtype=v.dtype, device=device, pin_memory=pin)
            with torch.no_grad():
                k_buf[:, P:P + T].copy_(k, non_blocking=k_buf.is_pinned())
                v_buf[:, P:P + T].copy_(v, non_blocking=v_buf.is_pinned())
        return o, dataclasses.replace(state, k_buf=k_buf, v_buf=v_buf, length=P + T,
                                      offset=state.offset + T, own_k=k, own_v=v)

    def _append(self, state: KVState | None, k: torch.Tensor, v: torch.Tensor) -> KVState:
        """The state after ``state`` followed by keys/values ``k, v [B, T, Hk, D]`` (see KVState)."""
        T = k.shape[1]
        length = 0 if state is None else state.length
        offset = (0 if state is None else state.offset) + T
        total = length + T
        keep = total if self.keep is None else min(self.keep, total)
        drop_old = min(total - keep, length)  # oldest stored positions no query will see again
        drop_new = total - keep - drop_old    # new positions already out of every future window

        recording = torch.is_grad_enabled() and (k.requires_grad or v.requires_grad)
        writable = state is not None and not recording and not state.k_buf.requires_grad \
            and not state.v_buf.requires_grad
        if writable and drop_new == 0:
            end = state.start + length
            if end + T <= state.capacity and state.high_water.end == end:  # room, newest branch
                state.k_buf[:, end:end + T] = k
                state.v_buf[:, end:end + T] = v
                state.high_water.end = end + T
                return KVState(kind=self.kind, k_buf=state.k_buf, v_buf=state.v_buf,
                               start=state.start + drop_old, length=keep, offset=offset,
                               high_water=state.high_water)

        # a new buffer holding the kept old positions, then the kept new ones
        parts_k, parts_v = [k[:, drop_new:]], [v[:, drop_new:]]
        if length - drop_old > 0:
            parts_k.insert(0, state.k[:, drop_old:])
            parts_v.insert(0, state.v[:, drop_old:])
        old_capacity = 0 if state is None else state.capacity
        if recording or state is None and self.keep is None:
            capacity = keep  # functional, or a first prefill: exactly full
        elif self.keep is None:
            capacity = old_capacity if old_capacity >= keep else max(keep, 2 * old_capacity)
        else:
            capacity = 2 * self.keep
        if capacity == keep:
            if len(parts_k) == 1 and drop_new == 0:  # nothing kept from before: the new k, v
                k_buf, v_buf = parts_k[0], parts_v[0]
            else:  # a copy, so a window state never holds a view of a long chunk
                k_buf, v_buf = torch.cat(parts_k, dim=1), torch.cat(parts_v, dim=1)
        else:
            shape = (k.shape[0], capacity, *k.shape[2:])
            k_buf = torch.zeros(shape, dtype=k.dtype, device=k.device)
            v_buf = torch.zeros(shape, dtype=v.dtype, device=v.device)
            k_buf[:, :keep] = torch.cat(parts_k, dim=1)
            v_buf[:, :keep] = torch.cat(parts_v, dim=1)
        return KVState(kind=self.kind, k_buf=k_buf, v_buf=v_buf, start=0, length=keep,
                       offset=offset, high_water=_HighWater(keep))


def is_full_attention(mixer: nn.Module) -> bool:
    """True for an :class:`Attention` mixer without a window: its state keeps every position
    (``keep`` None), so chunked training (SeCO) gives it a K/V store instead of a Markov state."""
    return isinstance(mixer, Attention) and mixer.keep is None
