"""SeCO under context parallelism: each rank runs SeCO over its own contiguous slice, exactly.

Use: call :func:`~hybridzoo.training.seco_engine.seco_step` (or train with the ``SeCO`` callback)
inside :func:`~hybridzoo.parallel.context.context_parallel`, each rank with its slice
``[B, T / P]`` of the same batch (:func:`~hybridzoo.parallel.context.shard_sequence`); the
:class:`~hybridzoo.parallel.lightning.ContextParallelCallback` does this. Each rank's loss is its
share of the sequence's mean loss and its gradient its share of the whole gradient (the shares
sum to the unsharded full-backprop values, float64-exact).

**Design: a sequential hand-off between ranks.** Rank ``p``'s slice is its own sequence of SeCO
chunks; the states entering its first chunk are the true states at the end of rank ``p − 1``'s
slice:

* stage 1 (no grad): rank ``p`` waits for rank ``p − 1``'s end states (every Markov layer's
  recurrent state and conv tail, a sliding window's last ``w − 1`` keys/values) and, for each
  full-attention layer, the K/V store of positions ``[0, p T)``; it runs its chunks from them
  (positions continue at ``p T``: the states carry the offset) and hands its end states and store
  ``[0, (p + 1) T)`` on to rank ``p + 1``;
* stage 2 (reverse sweep): rank ``P − 1`` starts; rank ``p`` waits for rank ``p + 1``'s gradients
  with respect to its end states (SeCO's relay into its last chunk) and to its store (the K/V
  gradient buffer, complete for every position of rank ``p``'s slice, since every later rank has
  run), sweeps its chunks, and hands the gradients of its incoming states (the leaves of its first
  chunk) and of the store ``[0, p T)`` on to rank ``p − 1``.

Why this design: a mixer stack is nonlinear across layers, so a rank's true incoming states
depend on the whole prefix through every layer; the per-layer state scan of
:mod:`~hybridzoo.parallel.recurrent_ops` needs every layer's input for the whole slice at once,
i.e. layer-major order with whole-slice activations, which is exactly what SeCO's chunk-major
order avoids. The hand-off reuses SeCO's own mechanism (saved boundary states, relayed state
gradients, the K/V gradient buffer) across the rank boundary, for every mixer, with nothing new
to get exact. Its cost: the ranks run one after another (a step takes about as long as
single-process SeCO over the whole sequence, plus the messages), so the composition buys memory,
not speed: a rank holds its own slice's boundary states and the K/V stores of positions up to its
slice's end only (the last rank: the whole sequence, as single-process SeCO).

Bytes sent per step and layer, all ranks together (``P`` ranks, ``T`` tokens per rank, batch
``B``; ``e`` bytes per activation number, ``s`` per state number, ``g = max(e, 4)`` per K/V
gradient number; :func:`hybridzoo.parallel.costs.seco_bytes_per_step`), each direction once:

* recurrent layer with state ``S`` numbers and conv tail ``C`` numbers per batch row:
  ``(P − 1) · B · (S · s + C · e)`` forward and the same backward;
* sliding-window attention ``w``: ``Σ_{p=1}^{P−1} min(w − 1, p T) · B · Hk · (D + Dv) · e``
  forward and the same backward;
* full attention: ``P (P − 1) / 2 · T · B · Hk · (D + Dv) · e`` forward (the stores),
  the same numbers in ``g`` bytes backward;
* the labels' shift: ``(P − 1) · B · 8`` (one int64 column per boundary).

Not supported (clear errors): SpaCO (``spaco_budget``) with context parallelism.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hybridzoo.layers.attention import Attention, BlockKVState, KVState, _HighWater, is_full_attention
from hybridzoo.layers.state import RecurrentState
from hybridzoo.parallel.comm import ContextParallelError, check_same_shapes, exchange
from hybridzoo.parallel.context import ContextParallel


def _window_keep(mixer, prefix: int) -> int:
    return min(mixer.keep, prefix)


class RankLink:
    """The hand-off of one rank in a context-parallel SeCO step (see the module docstring).

    Args:
        cp: the active context (group, rank, size).
        model: the ``HybridLM`` (unwrapped).
        batch_size, local_len: this rank's slice ``[B, T]`` (the same on every rank).
        dtype: the activation dtype (K/V stores, conv tails; recurrent states are float32 or wider).
        device: the activations' device.
    """

    def __init__(self, cp: ContextParallel, model, batch_size: int, local_len: int,
                 dtype: torch.dtype, device: torch.device):
        self.group, self.rank, self.size = cp.group, cp.rank, cp.size
        self.blocks = list(model.blocks)
        self.batch_size, self.local_len = batch_size, local_len
        self.dtype, self.device = dtype, device
        self.prefix = self.rank * local_len
        self.capacity = self.prefix + local_len

    # ---- the whole-batch pieces ---------------------------------------------------------------
    def check(self, inputs: torch.Tensor) -> None:
        """One ``all_gather``: every rank holds a slice of the same shape."""
        check_same_shapes(self.group, "SeCO (context parallel)", (inputs,))

    def count(self, targets: torch.Tensor) -> torch.Tensor:
        """Labelled tokens of the whole sequence (all ranks), at least 1."""
        count = (targets != -100).sum()
        dist.all_reduce(count, group=self.group)
        return count.clamp(min=1)

    @property
    def sends_states(self) -> bool:
        return self.rank < self.size - 1

    # ---- what crosses a boundary ----------------------------------------------------------------
    def _fields(self, prefix: int) -> list[tuple[int, str, tuple[int, ...], torch.dtype]]:
        """``(block, field, shape, dtype)`` of the states at position ``prefix``: Markov fields by
        the names SeCO relays them under, then ``k_store``/``v_store`` for full attention."""
        B, out = self.batch_size, []
        for i, block in enumerate(self.blocks):
            mixer = block.mixer
            if isinstance(mixer, Attention):
                n = prefix if is_full_attention(block.mixer) else _window_keep(mixer, prefix)
                names = ("k_store", "v_store") if is_full_attention(block.mixer) else ("k_buf", "v_buf")
                for name in names:
                    out.append((i, name, (B, n, mixer.n_kv_heads, mixer.head_dim), self.dtype))
            else:
                for name, (shape, dtype) in mixer.expected_state(B, self.dtype).items():
                    out.append((i, name, tuple(shape), dtype))
        return out

    def _send(self, tensors: list[torch.Tensor], dst: int) -> None:
        for tensor in tensors:
            if tensor.numel():
                exchange(tensor, dst, None, None, self.group)

    def _recv(self, fields, src: int, grad: bool = False) -> dict[tuple[int, str], torch.Tensor]:
        out = {}
        for i, name, shape, dtype in fields:
            if grad and name.endswith("_store"):
                dtype = torch.promote_types(dtype, torch.float32)
            like = torch.empty(shape, dtype=dtype, device=self.device)
            out[i, name] = exchange(None, None, like, src, self.group) if like.numel() else like
        return out

    # ---- stage 1 ------------------------------------------------------------------------------
    def incoming_states(self, block_size: int, store_device, pin: bool) -> list | None:
        """The states entering this rank's first chunk (received from rank ``p − 1``), with the
        K/V stores allocated for positions ``[0, (p + 1) T)``; None on rank 0."""
        if self.rank == 0:
            return None
        got = self._recv(self._fields(self.prefix), self.rank - 1)
        states = []
        for i, block in enumerate(self.blocks):
            mixer = block.mixer
            if is_full_attention(block.mixer):
                bufs = []
                for name in ("k_store", "v_store"):
                    part = got[i, name]
                    buf = torch.empty((part.shape[0], self.capacity, *part.shape[2:]), dtype=part.dtype,
                                      device=store_device or self.device, pin_memory=pin)
                    buf[:, :self.prefix].copy_(part)
                    bufs.append(buf)
                states.append(BlockKVState(kind="attn", k_buf=bufs[0], v_buf=bufs[1], capacity=self.capacity,
                                           length=self.prefix, offset=self.prefix, block_size=block_size,
                                           store_device=store_device, pin_memory=pin))
            elif isinstance(mixer, Attention):
                n = _window_keep(mixer, self.prefix)
                states.append(KVState(kind="attn", k_buf=got[i, "k_buf"], v_buf=got[i, "v_buf"], start=0,
                                      length=n, offset=self.prefix, high_water=_HighWater(n)))
            else:
                fields = {name: got[i, name] for name in mixer.expected_state(1, self.dtype)}
                states.append(RecurrentState(kind=mixer.kind, offset=self.prefix, **fields))
        return states

    def send_end_states(self, states: list) -> None:
        """Hand this slice's end states (and the stores ``[0, (p + 1) T)``) to rank ``p + 1``."""
        tensors = []
        for (i, name, shape, _), in_order in zip(self._fields(self.capacity), self._end_tensors(states)):
            if tuple(in_order.shape) != shape:
                raise ContextParallelError(f"SeCO (context parallel): block {i} field {name!r} ends "
                                           f"with shape {tuple(in_order.shape)}, expected {shape}")
            tensors.append(in_order.to(self.device))  # (stores offloaded to host memory)
        self._send(tensors, self.rank + 1)

    def _end_tensors(self, states: list):
        for block, state in zip(self.blocks, states):
            if isinstance(state, BlockKVState):
                yield state.k_buf[:, :self.capacity]
                yield state.v_buf[:, :self.capacity]
            elif isinstance(state, KVState):
                yield state.k
                yield state.v
            else:
                for name in block.mixer.expected_state(1, self.dtype):
                    yield getattr(state, name)

    # ---- stage 2 ------------------------------------------------------------------------------
    def incoming_grads(self) -> tuple[dict, dict]:
        """From rank ``p + 1`` (every rank but the last): ``(relay, kv_grads)``: the gradients of
        this slice's end Markov states (``{block: {field: grad}}``, SeCO's relay into its last
        chunk) and the K/V gradient buffers ``{block: (dK, dV)}`` ``[B, (p + 1) T, Hk, D]``."""
        got = self._recv(self._fields(self.capacity), self.rank + 1, grad=True)
        relay, kv = {}, {}
        for (i, name), grad in got.items():
            if name.endswith("_store"):
                kv.setdefault(i, []).append(grad)
            else:
                relay.setdefault(i, {})[name] = grad
        return relay, {i: tuple(pair) for i, pair in kv.items()}

    def send_grads(self, relay: dict[int, dict[str, torch.Tensor]], kv_grads: dict) -> None:
        """Hand the gradients of this slice's incoming states (``relay``: those of the first
        chunk's state leaves, ``{block: {field: grad}}``) and of the stores ``[0, p T)`` to rank
        ``p − 1``."""
        if self.rank == 0:
            return
        tensors = []
        for i, name, shape, dtype in self._fields(self.prefix):
            if name.endswith("_store"):
                tensors.append(kv_grads[i][0 if name == "k_store" else 1][:, :self.prefix])
                continue
            grad = relay.get(i, {}).get(name)
            tensors.append(torch.zeros(shape, dtype=dtype, device=self.device) if grad is None else grad)
        self._send(tensors, self.rank - 1)

