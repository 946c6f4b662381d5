"""SeCO: exact chunked training of a HybridLM on sequences longer than memory allows.

``seco_step(model, batch, chunk_size)`` gives the same gradients as
``model(ids, labels=labels)[2].backward()`` while keeping only one chunk's activations alive
(Li et al., arXiv:2505.16710; seed 001). Plain function, no Lightning; the
:class:`~hybridzoo.training.seco.SeCO` callback wraps it.

**Stage 1** (no grad): run the chunks in order with carried states. Every full-attention layer
writes its K/V into one store for the whole sequence (a :class:`BlockKVState`); every other layer
(recurrent states + conv tails, sliding-window K/V) has a bounded *Markov* state, saved at each
chunk boundary. Each chunk's RNG state is saved too. The last chunk is not run (nothing after it
reads its states or K/V; stage 2 recomputes it first), unless SpaCO skips it. The LM head is not
applied: a recomputed chunk's loss comes from its stage-2 forward (only chunks that SpaCO skips get
their loss here), which saves stage 1 the head's matmul (for qwen35-0.8b's 248k-token vocabulary
about a third of a forward's matmul FLOPs).

**Stage 2** (reverse sweep, chunk k-1 down to 0): recompute chunk j with grad from its saved
states and RNG state, then one ``torch.autograd.backward`` of

    loss_j  +  Σ_markov <state_out_j, g_j>  +  Σ_full-attn <K/V_j, dKV[:, chunk j]>

* Markov layers: chunk j's incoming state is a fresh leaf; ``g_j`` is the gradient the leaf of
  chunk j+1 received, i.e. what later chunks sent into chunk j's outgoing state.
* Full attention: chunk j reads its prefix from the store block by block (never copied) and
  merges it with its own causal part by log-sum-exp; the backward adds the prefix's K/V gradients
  in place into one gradient buffer per layer (``dKV``). Chunk j's own K/V then receive
  ``dKV[:, chunk j]``, complete because every later chunk has already run.

The loss is the mean over the valid targets of the whole batch: labels are shifted over the whole
sequence first, each chunk's summed cross-entropy is divided by the global count, so the chunk
losses add up to the full loss. The LM head runs on slices of ``loss_slice`` tokens of a chunk's
final hidden states (``model(..., return_hidden=True)``): each slice's logits, loss and their
gradients (w.r.t. the slice's hidden states and the head's weights, by one small
``autograd.grad``) exist only while that slice is processed; the chunk's backward then starts
from its hidden states. (A model whose ``forward`` has no ``return_hidden``, e.g. a subclass
overriding it, returns its logits; then only the loss is sliced.) With a large vocabulary the
logits are the biggest activation (qwen35-0.8b, vocab 248,320: ~3 MB per token in bf16 logits,
their float32 loss input and gradients), so slicing makes large chunks affordable; nothing is
recomputed.

**SpaCO** (``spaco_budget=t``): an unbiased stochastic estimate. Each of the k chunks is
recomputed independently with probability ``p = min(1, t / k)``; a recomputed chunk's loss *and*
every gradient relayed into it are scaled by ``1/p``. A gradient path from the loss of chunk a
through chunks a > c_1 > … > c_m then survives with probability ``p^(m+1)`` and is weighted
``p^-(m+1)``, so every path — hence the gradient — is exact in expectation. (Scaling only the
relayed gradients, as the paper's pseudocode does, shrinks the expectation.) The variance
trade-off: stage 2 costs about ``p`` of SeCO's, but a path through m+1 chunks carries a variance
factor ``p^-(m+1) − 1`` that grows exponentially with its length, so long-range credit assignment
(the reason to train long) gets the noisiest; ``p = 1/2`` already weighs a path through 10 chunks
by 1024 when it survives. Use SpaCO only when backward compute, not memory, is the bottleneck,
with p close to 1.

**kv_offload**: K/V stores and saved boundary states live in pinned host memory and are streamed
to the device block by block; only the gradient buffers stay resident. Refused up front when it
would pin more than 40% of host RAM.

**DDP**: pass ``no_sync=ddp_model.no_sync`` and the DDP-wrapped model: every chunk but the last
recomputed one runs (forward and backward) inside ``no_sync()``, so gradients are all-reduced once.
With ``defer_last=True`` (what Lightning's automatic optimization needs) nothing is written to
``.grad``: the returned ``deferred`` scalar's one backward produces this batch's whole gradient.

**Progress**: a step at 1M tokens takes minutes; ``progress(stage, done, total)`` is called with
``("stage 1", 0, total)`` as a step starts, then after each chunk of either stage
(:class:`ProgressLog` writes a line at most every N seconds; the callback and
``benchmarks/seco.py`` use it). Nothing in it synchronizes the device.

**Startup check**: :func:`check_chunked_forward` compares, on the actual model, the chunked
forward with carried states against one full forward, block by block, and raises
:class:`SeCOCheckError` naming the first block that differs. SeCO's exactness rests on that
equality and nothing else.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import math
import os
import time
from dataclasses import dataclass
from typing import Callable, ContextManager, Sequence

import torch
from torch import nn

from hybridzoo.layers.attention import Attention, BlockKVState, KVState, _HighWater, is_full_attention
from hybridzoo.layers.state import MixerState
from hybridzoo.parallel.comm import ContextParallelError
from hybridzoo.parallel.context import _sharded_shift_labels, suspended
from hybridzoo.training.seco_ranks import RankLink
from hybridzoo.utils import rel_err
from hybridzoo.zoo.model import document_targets, lm_loss, packed_cu_seqlens, shift_labels

OFFLOAD_RAM_FRACTION = 0.4  # at most this share of host RAM may be pinned for kv_offload
LOSS_SLICE = 4096  # default tokens of logits computed at a time for a chunk's loss
CHECK_TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 3e-2}


class SeCOError(RuntimeError):
    """SeCO cannot train this model / batch as asked."""


class ProgressLog:
    """A ``progress`` callable for :func:`seco_step` that writes one line (through ``write``) when
    at least ``every_s`` seconds have passed since the step started or since its last line, e.g.
    ``SeCO: stage 2 (recompute + backward), chunk 12/64, 95 s into the step``, and always after
    the last chunk of a step that wrote one (with ``defer_last`` the caller's backward of that
    chunk comes after it). Stage 1 counts one chunk fewer than stage 2: it does not run the last
    chunk. Short steps stay silent. Times are host wall-clock, without synchronizing the device
    (the host may run ahead by queued work). One object serves many steps: it restarts its clock
    when a step starts (``("stage 1", 0, total)``)."""

    STAGES = {"stage 1": "stage 1 (no-grad forward)", "stage 2": "stage 2 (recompute + backward)"}

    def __init__(self, every_s: float = 30.0, write: Callable[[str], None] = print):
        if not every_s > 0:
            raise ValueError(f"every_s must be > 0, got {every_s!r}")
        self.every_s, self.write = every_s, write
        self.started = self.last = time.perf_counter()
        self.lines = 0

    def __call__(self, stage: str, done: int, total: int) -> None:
        now = time.perf_counter()
        if stage == "stage 1" and done == 0:
            self.started = self.last = now
            self.lines = 0
            return
        final = stage == "stage 2" and done == total
        if now - self.last >= self.every_s or (final and self.lines):
            self.write(f"SeCO: {self.STAGES.get(stage, stage)}, chunk {done}/{total}, "
                       f"{now - self.started:.0f} s into the step")
            self.last = now
            self.lines += 1


class SeCOCheckError(SeCOError):
    """The model's chunked forward with carried states differs from its full forward."""


class SeCOOffloadError(SeCOError):
    """kv_offload would pin too much host memory."""


@dataclass
class SeCOResult:
    """What :func:`seco_step` returns.

    Attributes:
        loss: the batch's mean loss (a detached scalar, float32 or wider): each recomputed chunk's
            from its stage-2 forward, each chunk SpaCO skips from stage 1; exact also under SpaCO.
        num_chunks: number of chunks k.
        selected: per chunk, whether stage 2 recomputed it (all True without SpaCO).
        deferred: with ``defer_last=True``, a scalar equal to ``loss`` whose backward adds this
            batch's gradient (every chunk's) to ``.grad``; else None.
    """

    loss: torch.Tensor
    num_chunks: int
    selected: list[bool]
    deferred: torch.Tensor | None = None


# ---- the model's layers ---------------------------------------------------------------------
def _unwrap(model: nn.Module) -> nn.Module:
    """The HybridLM inside a DDP (or similar ``.module``) wrapper."""
    while not hasattr(model, "blocks") and isinstance(getattr(model, "module", None), nn.Module):
        model = model.module
    if not hasattr(model, "blocks"):
        raise SeCOError(f"SeCO needs a HybridLM (a model with .blocks; a LightningModule holds it as "
                        f".model), got {type(model).__name__}")
    return model


def _is_full_attention(block: nn.Module) -> bool:
    return is_full_attention(block.mixer)


def _activation_dtype(model: nn.Module, device: torch.device) -> torch.dtype:
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return model.embed.weight.dtype if hasattr(model, "embed") else next(model.parameters()).dtype


# ---- options, inputs and loss -------------------------------------------------------------------
def check_options(chunk_size: int, spaco_budget: int | None = None, block_size: int | None = None,
                  *, loss_slice: int | None = None, error: type[Exception] = SeCOError) -> None:
    """Raise ``error`` unless ``chunk_size`` is an int >= 1 and ``spaco_budget``, ``block_size``
    and ``loss_slice`` are None or ints >= 1 (bools are refused)."""
    def bad(value) -> bool:
        return isinstance(value, bool) or not isinstance(value, int) or value < 1

    if bad(chunk_size):
        raise error(f"SeCO: chunk_size must be an int >= 1, got {chunk_size!r}")
    if spaco_budget is not None and bad(spaco_budget):
        raise error(f"SeCO: spaco_budget must be None or an int >= 1 (chunks recomputed per "
                    f"sequence, in expectation), got {spaco_budget!r}")
    if block_size is not None and bad(block_size):
        raise error(f"SeCO: block_size must be None or an int >= 1, got {block_size!r}")
    if loss_slice is not None and bad(loss_slice):
        raise error(f"SeCO: loss_slice must be None or an int >= 1, got {loss_slice!r}")


class _Documents:
    """Packed documents of a SeCO batch (``cu_seqlens`` / ``position_ids``): the global boundaries
    and, per chunk, the boundaries of its piece and how its states connect to the previous chunk.

    A chunk ``[start, end)`` gets the ``cu_seqlens`` of its piece (the boundaries inside it, from
    0). The document that straddles the cut at ``start`` continues the previous chunk's state (its
    last document's row); a document that starts exactly at ``start`` starts from zero state, as
    does every other document of the chunk."""

    def __init__(self, cu_seqlens: torch.Tensor, device: torch.device):
        self.cu = cu_seqlens.tolist()
        self.starts = set(self.cu[:-1])
        self.device = device

    def truncated(self, length: int) -> "_Documents":
        """The documents of the first ``length`` tokens."""
        cu = [c for c in self.cu if c < length] + [length]
        return _Documents(torch.tensor(cu), self.device)

    def piece(self, start: int, end: int) -> torch.Tensor:
        """int32 ``cu_seqlens`` of the chunk ``[start, end)``."""
        inner = [c - start for c in self.cu if start < c < end]
        return torch.tensor([0, *inner, end - start], dtype=torch.int32, device=self.device)

    def doc_start(self, position: int) -> int:
        """Where the document holding token ``position`` starts."""
        return max(c for c in self.cu[:-1] if c <= position)

    def carry(self, states: list, start: int, end: int) -> list:
        """The states entering the chunk ``[start, end)`` from those the previous chunk returned
        (differentiable: SeCO relays gradients through it). A recurrent state keeps the last
        document's row, then zero rows for the chunk's other documents; attention's K/V state is
        already that of the last document. A document starting at ``start``: None (zero state).
        A :class:`BlockKVState` gets ``doc_start`` / ``offset`` of the document at ``start``."""
        continues = start not in self.starts
        n_docs = len(self.piece(start, end)) - 1
        carried = []
        for state in states:
            if isinstance(state, BlockKVState):
                first = self.doc_start(start)
                carried.append(dataclasses.replace(state, doc_start=state.length - (start - first),
                                                   offset=start - first))
            elif state is None or not continues:
                carried.append(None)
            elif isinstance(state, KVState):
                carried.append(state)
            else:
                rows = {}
                for name, tensor in state.tensors().items():
                    last = tensor[-1:]
                    rows[name] = last if n_docs == 1 else torch.cat(
                        [last, last.new_zeros((n_docs - 1, *last.shape[1:]))])
                carried.append(dataclasses.replace(state, **rows))
        return carried


def _documents(batch: dict, shape, device) -> "_Documents | None":
    """The batch's packed documents (``cu_seqlens`` for one row, or ``position_ids [B, T]``), or None."""
    cu, position_ids = batch.get("cu_seqlens"), batch.get("position_ids")
    if cu is None and position_ids is None:
        return None
    if cu is not None and position_ids is not None:
        raise SeCOError("SeCO: give cu_seqlens or position_ids in the batch, not both")
    if position_ids is not None:
        cu = packed_cu_seqlens(position_ids, shape)
    elif shape[0] != 1:
        raise SeCOError(f"SeCO: with cu_seqlens the documents are packed into one row [1, total], got "
                        f"batch {shape[0]}; pass position_ids instead (the rows are then packed)")
    from hybridzoo.kernels.varlen import check_cu_seqlens

    return _Documents(check_cu_seqlens(cu, shape[0] * shape[1]).cpu(), device)


def _inputs(batch, cp=None) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor, "_Documents | None"]:
    """``(input_ids, inputs_embeds, targets, documents)`` with targets aligned to the logits (``cp``:
    the labels are this rank's slice; its last target is the next rank's first label). With packed
    documents (``cu_seqlens`` / ``position_ids`` in the batch) the rows are packed into one
    ``[1, B·T]`` and labels give no target at a document's last token."""
    if not isinstance(batch, dict):
        raise SeCOError(f"SeCO: batch must be a dict with input_ids (or inputs_embeds) and labels "
                        f"(or targets), got {type(batch).__name__}")
    ids, embeds = batch.get("input_ids"), batch.get("inputs_embeds")
    if (ids is None) == (embeds is None):
        raise SeCOError("SeCO: the batch must hold exactly one of input_ids and inputs_embeds")
    labels, targets = batch.get("labels"), batch.get("targets")
    if (labels is None) == (targets is None):
        raise SeCOError("SeCO: the batch must hold exactly one of labels (shifted inside, as in "
                        "Hugging Face) and targets (aligned with the logits)")
    source = ids if ids is not None else embeds
    shape = source.shape[:2]
    docs = _documents(batch, shape, source.device)
    if docs is not None:
        if cp is not None:
            raise ContextParallelError("SeCO with context parallelism: packed documents (cu_seqlens / "
                                       "position_ids) are not supported; use SeCO without context parallelism")
        given = labels if labels is not None else targets
        if given.shape != shape:
            raise SeCOError(f"SeCO: labels/targets must be [B, T] = {list(shape)}, got {list(given.shape)}")
        ids = None if ids is None else ids.reshape(1, -1)
        embeds = None if embeds is None else embeds.reshape(1, -1, embeds.shape[-1])
        if labels is not None:
            targets = document_targets(labels.reshape(1, -1), torch.tensor(docs.cu))
        else:
            targets = targets.reshape(1, -1)
        return ids, embeds, targets, docs
    if labels is not None:  # shift over the WHOLE sequence before chunking
        targets = shift_labels(labels) if cp is None else _sharded_shift_labels(labels, cp)
    if targets.shape != shape:
        raise SeCOError(f"SeCO: labels/targets must be [B, T] = {list(shape)}, got {list(targets.shape)}")
    return ids, embeds, targets, None


def _loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy over targets != -100 (float32 or wider)."""
    return lm_loss(logits, targets, reduction="sum")


def _head_slices(head: nn.Module, hidden: torch.Tensor, size: int):
    """``(start, end, head(hidden[:, start:end]))`` for slices of ``size`` tokens of ``hidden``
    ``[B, T, d_model]``: one slice's logits at a time."""
    for start, end in _chunks(hidden.shape[1], size):
        yield start, end, head(hidden[:, start:end])


def _sliced_loss_sum(head: nn.Module, hidden: torch.Tensor, targets: torch.Tensor,
                     loss_slice: int) -> torch.Tensor:
    """Stage 1 (no grad): the summed cross-entropy of ``head(hidden)`` ``[B, T, d_model]``,
    ``loss_slice`` tokens of logits at a time."""
    return sum(_loss_sum(logits, targets[:, start:end])
               for start, end, logits in _head_slices(head, hidden, loss_slice))


def _loss_roots(head: nn.Module, hidden: torch.Tensor, targets: torch.Tensor, weight: float,
                count: torch.Tensor, loss_slice: int
                ) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
    """Stage 2: ``(tensors, grads, summed)``: a backward of ``tensors`` with ``grads`` is that of
    ``weight · Σ cross-entropy(head(hidden), targets) / count``; ``summed`` is that sum of
    cross-entropies (detached, unweighted). A chunk of at most ``loss_slice`` tokens: its loss and
    ``weight``. A longer one, a slice of ``loss_slice`` tokens at a time (one slice's logits alive):
    ``hidden`` with its gradient, and each head weight with its gradient summed over slices (one
    extra weight-sized buffer, so slicing is only used when it saves logits)."""
    if hidden.shape[1] <= loss_slice:
        summed = _loss_sum(head(hidden), targets)
        loss = summed / count
        return [loss], [torch.full_like(loss, weight)], summed.detach()
    params = [p for p in head.parameters() if p.requires_grad]
    d_hidden = torch.zeros_like(hidden)
    d_params: list[torch.Tensor | None] = [None] * len(params)
    total = None
    for start, end in _chunks(hidden.shape[1], loss_slice):
        leaf = hidden[:, start:end].detach().requires_grad_(hidden.requires_grad)
        with torch.enable_grad():
            # the head gets a view, not the leaf: autocast caches its casts of grad-requiring
            # leaves until the autocast region ends, which would keep every slice (and its bf16
            # copy) alive for the whole step (measured: + 1.5 x d_model x 4 bytes per token)
            x = leaf.view_as(leaf) if leaf.requires_grad else leaf
            part = _loss_sum(head(x), targets[:, start:end])
            loss = part * weight / count  # in the loss's dtype
        total = part.detach() if total is None else total + part.detach()
        inputs = ([leaf] if leaf.requires_grad else []) + params
        if not inputs or not loss.requires_grad:
            continue
        grads = list(torch.autograd.grad(loss, inputs, allow_unused=True))
        if leaf.requires_grad:
            d_hidden[:, start:end] = grads.pop(0)
        for i, grad in enumerate(grads):
            if grad is not None:
                d_params[i] = grad if d_params[i] is None else d_params[i] + grad
    pairs = [(hidden, d_hidden)] + [(p, g) for p, g in zip(params, d_params) if g is not None]
    return [t for t, _ in pairs], [g for _, g in pairs], total


def _chunks(length: int, chunk_size: int) -> list[tuple[int, int]]:
    """``(start, end)`` of each chunk of ``chunk_size`` (a checked int >= 1) tokens; the last may be shorter."""
    return [(start, min(start + chunk_size, length)) for start in range(0, length, chunk_size)]


# ---- RNG replay -------------------------------------------------------------------------------
def _get_rng(device: torch.device) -> list[torch.Tensor]:
    states = [torch.get_rng_state()]
    if device.type == "cuda":
        states.append(torch.cuda.get_rng_state(device))
    return states


def _set_rng(device: torch.device, states: list[torch.Tensor]) -> None:
    torch.set_rng_state(states[0])
    if device.type == "cuda":
        torch.cuda.set_rng_state(states[1], device)


# ---- host memory (kv_offload) -------------------------------------------------------------------
def host_ram_bytes() -> int:
    """Physical RAM of this host, in bytes."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def offload_bytes(model: nn.Module, batch_size: int, length: int, num_chunks: int,
                  dtype: torch.dtype) -> int:
    """Host bytes kv_offload pins: the K/V stores of full-attention layers plus every other
    layer's state at each of the ``num_chunks - 1`` inner chunk boundaries."""
    total = 0
    for block in _unwrap(model).blocks:
        mixer = block.mixer
        if _is_full_attention(block):
            total += 2 * batch_size * length * mixer.n_kv_heads * mixer.head_dim * dtype.itemsize
            continue
        keep = getattr(mixer, "keep", None) or 0  # a sliding window keeps window - 1 positions
        for shape, field_dtype in mixer.expected_state(batch_size, dtype).values():
            numel = math.prod(keep if size == -1 else size for size in shape)
            total += (num_chunks - 1) * numel * field_dtype.itemsize
    return total


def _check_offload(model: nn.Module, batch_size: int, length: int, num_chunks: int,
                   dtype: torch.dtype) -> None:
    needed = offload_bytes(model, batch_size, length, num_chunks, dtype)
    ram = host_ram_bytes()
    if needed > OFFLOAD_RAM_FRACTION * ram:
        raise SeCOOffloadError(
            f"SeCO kv_offload would pin {needed / 2**30:.2f} GiB of host memory (K/V stores and "
            f"chunk-boundary states for batch {batch_size} x {length} tokens), more than "
            f"{OFFLOAD_RAM_FRACTION:.0%} of this host's {ram / 2**30:.1f} GiB of RAM; pinned memory "
            f"cannot be swapped out. Use a shorter sequence or smaller batch, or kv_offload=False.")


# ---- the per-layer states --------------------------------------------------------------------
class _Layers:
    """Which state each block carries in SeCO, how to save / restore / relay it, and how the
    chunk outputs become logits (``head``: the model's LM head when its ``forward`` can return
    hidden states, which SeCO then slices; else an identity on the logits it returns)."""

    def __init__(self, model: nn.Module, length: int, block_size: int, offload: bool,
                 device: torch.device, docs: _Documents | None = None):
        self.model = _unwrap(model)
        self.docs = docs  # packed documents, or None
        self.blocks = list(self.model.blocks)
        # the LM head is applied by SeCO, in slices, when the model can return hidden states
        self.hidden = "return_hidden" in inspect.signature(self.model.forward).parameters
        self.head = self.model.lm_head if self.hidden else nn.Identity()
        self.full = [_is_full_attention(block) for block in self.blocks]
        self.length, self.block_size, self.device = length, block_size, device
        self.host = torch.device("cpu") if offload else None
        self.pin = offload and torch.cuda.is_available()

    def initial(self) -> list[MixerState | None]:
        """States before chunk 0 of stage 1: empty stores for full attention, None elsewhere."""
        return [BlockKVState(kind="attn", capacity=self.length, block_size=self.block_size,
                             store_device=self.host, pin_memory=self.pin) if full else None
                for full in self.full]

    def _copy(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.host is None:
            return tensor.detach().clone()
        out = torch.empty(tensor.shape, dtype=tensor.dtype, device=self.host, pin_memory=self.pin)
        return out.copy_(tensor, non_blocking=self.pin)

    def save(self, states: list) -> list:
        """Copies of the Markov states (compact; on the host with offload); None for full attention."""
        saved = []
        for full, state in zip(self.full, states):
            if full or state is None:
                saved.append(None)
            elif isinstance(state, KVState):  # sliding window: keep only the valid positions
                saved.append(KVState(kind=state.kind, k_buf=self._copy(state.k), v_buf=self._copy(state.v),
                                     start=0, length=state.length, offset=state.offset,
                                     high_water=_HighWater(state.length)))
            else:
                saved.append(state.map(self._copy))
        return saved

    def leaves(self, saved: list) -> tuple[list, list[dict[str, torch.Tensor]]]:
        """Stage-2 incoming Markov states whose tensors are fresh leaves requiring grad."""
        states, leaves = [], []
        for state in saved:
            layer_leaves = {}
            if state is not None:
                for name, tensor in state.tensors().items():
                    leaf = tensor.to(self.device, non_blocking=True).detach()
                    if leaf.is_floating_point():
                        layer_leaves[name] = leaf.requires_grad_()
                state = dataclasses.replace(state, **layer_leaves) if layer_leaves else state
            states.append(state)
            leaves.append(layer_leaves)
        return states, leaves


# ---- stage 1 ------------------------------------------------------------------------------
def _call(model, layers: _Layers, ids, embeds, start, end, states):
    """``(x, states)`` of one chunk through ``model`` (a DDP wrapper stays in the call): ``x`` the
    final-norm hidden states ``[B, end - start, d_model]`` that ``layers.head`` turns into logits
    (the logits themselves, and ``layers.head`` an identity, for a model whose ``forward`` has no
    ``return_hidden``, e.g. a subclass overriding it)."""
    extra = {"return_hidden": True} if layers.hidden else {}
    docs = layers.docs
    if docs is not None:  # this chunk's boundaries, and its states from the previous chunk's
        extra["cu_seqlens"] = docs.piece(start, end)
        if start > 0 and states is not None:
            states = docs.carry(states, start, end)
    if ids is not None:  # checked once by seco_step: no range check (a device sync) per chunk
        with layers.model.ids_checked():
            return model(input_ids=ids[:, start:end], state=states, **extra)
    return model(inputs_embeds=embeds[:, start:end], state=states, **extra)


def _forward_chunks(model, layers: _Layers, ids, embeds, targets, bounds,
                    loss_slice: int = LOSS_SLICE, on_chunk=None, with_loss=None, run_last: bool = True,
                    progress=None, initial=None):
    """Stage 1 (call under no_grad): returns (summed loss, final states, saved boundary states,
    RNG states), ``saved[j]`` / ``rngs[j]`` being those entering chunk j. The summed loss is that
    of the chunks ``with_loss`` marks (default all; None when none), computed ``loss_slice`` tokens
    at a time; ``on_chunk(x)`` (the startup check) gets each chunk's
    output before the LM head (``layers.head`` makes the logits of it). ``run_last=False``
    records the last chunk's incoming states and RNG state but does not run it: nothing of its
    forward is needed when stage 2 recomputes it (no later chunk reads its states or K/V).
    ``progress("stage 1", done, total)`` comes first with ``done = 0``, then after each chunk run.
    ``initial``: the states entering chunk 0 (default: those of a sequence's start)."""
    states = layers.initial() if initial is None else initial
    runs = len(bounds) - (0 if run_last else 1)
    if progress is not None:
        progress("stage 1", 0, runs)
    saved, rngs, total = [], [], None
    device = layers.device
    for j, (start, end) in enumerate(bounds):
        rngs.append(_get_rng(device))
        saved.append(layers.save(states) if j > 0 or initial is not None else [None] * len(states))
        if j == len(bounds) - 1 and not run_last:
            break
        hidden, states = _call(model, layers, ids, embeds, start, end, states)
        if on_chunk is not None:
            on_chunk(hidden)
        if targets is not None and (with_loss is None or with_loss[j]):
            chunk_loss = _sliced_loss_sum(layers.head, hidden, targets[:, start:end], loss_slice)
            total = chunk_loss if total is None else total + chunk_loss
        states = [dataclasses.replace(s, own_k=None, own_v=None) if isinstance(s, BlockKVState) else s
                  for s in states]
        if progress is not None:
            progress("stage 1", j + 1, runs)
    return total, states, saved, rngs


# ---- the step -----------------------------------------------------------------------------
def seco_step(
    model: nn.Module,
    batch: dict,
    chunk_size: int,
    *,
    kv_offload: bool = False,
    spaco_budget: int | None = None,
    selection: Sequence[bool] | None = None,
    generator: torch.Generator | None = None,
    no_sync: Callable[[], ContextManager] | None = None,
    defer_last: bool = False,
    block_size: int | None = None,
    loss_slice: int | None = LOSS_SLICE,
    progress: Callable[[str, int, int], None] | None = None,
) -> SeCOResult:
    """One exact chunked forward + backward of a causal LM loss (see the module docstring).

    Args:
        model: a :class:`~hybridzoo.zoo.HybridLM` (or subclass, or a DDP wrapper of one), called
            as ``model(input_ids=..., state=...)`` / ``model(inputs_embeds=..., state=...)`` ->
            ``(logits, state)``.
        batch: ``{"input_ids" [B, T] int | "inputs_embeds" [B, T, d_model], "labels" [B, T]
            (shifted inside, -100 ignored) | "targets" [B, T] (aligned)}``. A grad-requiring
            ``inputs_embeds`` gets its gradient (leaf: in ``.grad``; else backpropagated further).
        chunk_size: tokens per chunk (the last chunk may be shorter).
        kv_offload: keep K/V stores and boundary states in (pinned) host memory.
        spaco_budget: None = exact SeCO; an int t >= 1 = SpaCO, recompute each chunk with
            probability ``p = min(1, t / k)`` (t chunks in expectation).
        selection: SpaCO only: which chunks to recompute (k bools) instead of drawing them.
        generator: SpaCO only: the torch.Generator of the draws (default: the global one).
        no_sync: e.g. ``ddp_model.no_sync``: all chunks but the last recomputed one run inside it.
        defer_last: leave ``.grad`` untouched and return ``deferred`` (see :class:`SeCOResult`).
        block_size: prefix positions read per block (default ``chunk_size``).
        loss_slice: tokens of logits computed at a time for the loss (default 4096; None = the
            whole chunk at once). Memory only: the gradient is the same.
        progress: called as ``progress(stage, done, total)`` ("stage 1" / "stage 2"): once with
            ``("stage 1", 0, total)`` as the step starts, then after each chunk; e.g. a
            :class:`ProgressLog`. The engine does not synchronize the device for it.

    Under :func:`~hybridzoo.parallel.context.context_parallel`, ``batch`` is this rank's
    contiguous slice and the step is this rank's share (loss and gradient; the shares sum to the
    whole sequence's), the ranks handing states and K/V between them
    (:mod:`hybridzoo.training.seco_ranks`); SpaCO is refused there.

    Returns:
        :class:`SeCOResult`. Without ``defer_last`` the gradients are accumulated into ``.grad``
        like ``loss.backward()`` would.
    """
    with suspended() as cp:  # the chunks run unsharded; the rank hand-off is explicit
        return _step(model, batch, chunk_size, cp, kv_offload=kv_offload, spaco_budget=spaco_budget,
                     selection=selection, generator=generator, no_sync=no_sync, defer_last=defer_last,
                     block_size=block_size, loss_slice=loss_slice, progress=progress)


def _step(model, batch, chunk_size, cp, *, kv_offload, spaco_budget, selection, generator, no_sync,
          defer_last, block_size, loss_slice, progress) -> SeCOResult:
    """:func:`seco_step`; ``cp``: the context-parallel context it was called in, or None."""
    check_options(chunk_size, spaco_budget, block_size, loss_slice=loss_slice)
    inner = _unwrap(model)
    if cp is not None and spaco_budget is not None:
        raise ContextParallelError("SeCO with context parallelism: SpaCO (spaco_budget) is not "
                                   "supported; use exact SeCO (spaco_budget=None) or no context parallelism")
    ids, embeds, targets, docs = _inputs(batch, cp)
    if ids is not None:
        inner.check_ids(ids)  # once for the whole sequence (the chunk calls skip it)
    batch_size, length = targets.shape
    bounds = _chunks(length, chunk_size)
    k = len(bounds)
    device = next(inner.parameters()).device
    block_size = block_size or chunk_size
    link = None  # context parallelism: the hand-off to the neighbouring ranks
    if cp is not None:
        link = RankLink(cp, inner, batch_size, length, _activation_dtype(inner, device), device)
        if cp.check:
            link.check(ids if ids is not None else embeds)
    base = 0 if link is None else link.prefix  # position of this slice's first token
    if kv_offload:
        _check_offload(inner, batch_size, base + length, k, _activation_dtype(inner, device))
    if link is None:
        count = (targets != -100).sum().clamp(min=1)  # the global denominator of the mean
    else:
        count = link.count(targets)
    layers = _Layers(inner, base + length, block_size, kv_offload, device, docs)
    loss_slice = loss_slice or chunk_size

    # which chunks stage 2 recomputes (SpaCO draws them): their losses come from stage 2's
    # forward, so stage 1 applies the LM head only to the chunks SpaCO skips
    weights = _select(k, spaco_budget, selection, generator)

    # ---- stage 1: no-grad pass building the K/V stores and the boundary states ----------
    # (the last chunk only when SpaCO skips it, for its loss; stage 2 recomputes it otherwise)
    # (and on every rank but the last under context parallelism: the next rank starts from it)
    run_last = weights[-1] == 0 or (link is not None and link.sends_states)
    with torch.no_grad():
        initial = None if link is None else link.incoming_states(block_size, layers.host, layers.pin)
        total, final_states, saved, rngs = _forward_chunks(
            model, layers, ids, None if embeds is None else embeds.detach(), targets, bounds, loss_slice,
            with_loss=[w == 0 for w in weights], run_last=run_last, progress=progress, initial=initial)
        if link is not None and link.sends_states:
            link.send_end_states(final_states)
    stores = {i: (state.k_buf, state.v_buf) for i, state in enumerate(final_states)
              if isinstance(state, BlockKVState)}
    del final_states

    order = [j for j in reversed(range(k)) if weights[j] > 0]
    if not order and no_sync is not None:  # every DDP rank must join the one gradient sync
        order, weights = [0], [0.0] * k
    end_rng = _get_rng(device)

    params = [p for p in inner.parameters() if p.requires_grad]
    prior = {}
    if defer_last:  # keep .grad untouched: set aside what is there, give it back at the end
        prior = {p: p.grad for p in params}
        for p in params:
            p.grad = None
    embeds_leaf = None
    if embeds is not None and embeds.requires_grad:
        embeds_leaf = embeds.detach().requires_grad_()  # every chunk but the last recomputed one

    # ---- stage 2: reverse sweep, one chunk's graph at a time -----------------------------
    relay: dict[int, dict[str, torch.Tensor]] = {}  # Markov state grads from chunk j+1
    relay_from = None
    if link is not None:
        relay_from = k
    if link is not None and link.sends_states:  # the next rank's gradients of this slice's end states and K/V
        relay, kv_grads = link.incoming_grads()
    else:  # K/V gradients accumulate from zero (needed once a later chunk, or rank, reads the stores)
        kv_grads = {i: tuple(torch.zeros(store.shape, dtype=torch.promote_types(store.dtype, torch.float32),
                                         device=device) for store in pair)
                    for i, pair in stores.items()} if len(order) > 1 or link is not None else {}
    later = link is not None and link.sends_states  # later ranks read this slice's states and K/V
    deferred = None
    try:
        with torch.enable_grad():
            for n, j in enumerate(order):
                start, end = bounds[j]
                last = n == len(order) - 1
                weight = weights[j]
                if relay_from != j + 1:
                    relay = {}  # chunk j+1 was skipped (SpaCO): nothing reaches chunk j's state
                _set_rng(device, rngs[j])
                sync = no_sync() if (no_sync is not None and not last) else contextlib.nullcontext()
                with sync:
                    states, leaves = layers.leaves(saved[j])
                    for i, (key, value) in stores.items():
                        grad_k, grad_v = kv_grads.get(i, (None, None))
                        states[i] = BlockKVState(kind="attn", k_buf=key, v_buf=value,
                                                 capacity=base + length, length=base + start,
                                                 offset=base + start, block_size=block_size,
                                                 read_only=True, k_grad=grad_k, v_grad=grad_v)
                    x = embeds
                    if embeds_leaf is not None and not last:
                        x = embeds_leaf
                    hidden, out_states = _call(model, layers, ids, x, start, end, states)
                    if j == k - 1 and not run_last:  # the RNG leaves the step past every chunk's draws
                        end_rng = _get_rng(device)
                    # the chunk's loss (scaled by its SpaCO weight), a slice of logits at a time
                    tensors, grads, summed = _loss_roots(layers.head, hidden, targets[:, start:end], weight,
                                                         count, loss_slice)
                    if weight > 0:  # (a DDP-only pass of a skipped chunk has weight 0: loss from stage 1)
                        total = summed if total is None else total + summed
                    for i, state in enumerate(out_states):
                        for name, tensor, grad in _relayed(i, state, relay, kv_grads, base + start,
                                                           base + end, j < k - 1 or later):
                            if tensor.requires_grad and grad is not None and tensor.numel():
                                tensors.append(tensor)
                                grads.append(grad.to(tensor.dtype) * weight if weight != 1 else grad.to(tensor.dtype))
                    if last and embeds_leaf is not None and embeds_leaf.grad is not None:
                        tensors.append(embeds)  # the other chunks' share of d(inputs_embeds)
                        grads.append(embeds_leaf.grad)
                    del out_states, states, hidden
                    if last and defer_last and link is None:  # (the hand-off needs it now)
                        deferred = _deferred(tensors, grads, params, (total / count).detach())
                        if progress is not None:  # its backward is the caller's
                            progress("stage 2", n + 1, len(order))
                        break
                    pairs = [(t, g) for t, g in zip(tensors, grads) if t.requires_grad]
                    if pairs:
                        torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
                    del tensors, grads, pairs
                if progress is not None:
                    progress("stage 2", n + 1, len(order))
                relay = {i: {name: leaf.grad for name, leaf in layer.items() if leaf.grad is not None}
                         for i, layer in enumerate(leaves) if layer}
                relay_from = j
                del leaves
            if link is not None:
                link.send_grads(relay, kv_grads)  # of this slice's incoming states and K/V prefix
            if defer_last and deferred is None:  # SpaCO selected nothing, or context parallelism
                deferred = _deferred([], [], params, (total / count).detach())
    finally:
        _set_rng(device, end_rng)
        if defer_last:
            for p in params:
                p.grad = prior[p]
    loss = (total / count).detach()
    return SeCOResult(loss=loss, num_chunks=k, selected=[w > 0 for w in weights], deferred=deferred)


def _relayed(i, state, relay, kv_grads, start, end, has_later):
    """``(name, tensor, incoming grad)`` for the outputs of chunk j that later chunks used."""
    if isinstance(state, BlockKVState):
        if has_later and i in kv_grads and state.own_k is not None:
            grad_k, grad_v = kv_grads[i]
            yield "own_k", state.own_k, grad_k[:, start:end]
            yield "own_v", state.own_v, grad_v[:, start:end]
        return
    if state is None or i not in relay:
        return
    for name, tensor in state.tensors().items():
        grad = relay[i].get(name)
        if grad is not None and grad.shape != tensor.shape:
            raise SeCOError(f"SeCO: block {i} ({state.kind}): the state field {name!r} has shape "
                            f"{tuple(tensor.shape)} after a chunk but {tuple(grad.shape)} when saved")
        yield name, tensor, grad


def _deferred(tensors, grads, params, loss) -> torch.Tensor:
    """A scalar equal to ``loss`` whose backward = backward(tensors, grads) + the gradient already
    accumulated in ``.grad`` (moved out of it), touching every parameter once (one DDP sync)."""
    parts = [(t * g).sum() for t, g in zip(tensors, grads) if t.requires_grad]
    for p in params:
        stash, p.grad = p.grad, None
        parts.append((p * stash).sum() if stash is not None else p.sum() * 0.0)
    if not parts:
        return loss
    surrogate = torch.stack([part.to(loss.dtype) for part in parts]).sum()
    return surrogate - surrogate.detach() + loss


def _select(k: int, spaco_budget: int | None, selection: Sequence[bool] | None,
            generator: torch.Generator | None) -> list[float]:
    """Per chunk: its weight 1/p if recomputed, 0 if skipped (all 1 without SpaCO);
    ``spaco_budget`` already checked by :func:`check_options`."""
    if spaco_budget is None:
        if selection is not None:
            raise SeCOError("SeCO: selection is a SpaCO option; give spaco_budget too")
        return [1.0] * k
    p = min(1.0, spaco_budget / k)
    if selection is None:
        selection = (torch.rand(k, generator=generator) < p).tolist()
    if len(selection) != k:
        raise SeCOError(f"SeCO: selection must have one entry per chunk ({k}), got {len(selection)}")
    return [1.0 / p if chosen else 0.0 for chosen in selection]


# ---- the startup check --------------------------------------------------------------------------
def check_chunked_forward(
    model: nn.Module,
    batch: dict,
    chunk_size: int,
    *,
    tokens: int | None = None,
    tolerance: float | None = None,
    kv_offload: bool = False,
    block_size: int | None = None,
) -> list[float]:
    """Check that the chunked forward with carried states equals one full forward.

    Runs, without grad, in eval mode (no dropout) and without touching the RNG, on the first
    ``tokens`` positions of the batch (default ``min(T, 4 · chunk_size)``): one full forward, then
    SeCO's chunked stage-1 forward (K/V stores, carried states). Compares every block's output
    and the logits.

    Returns:
        The relative error of each block's output, then of the logits.

    Raises:
        SeCOCheckError: naming the first block (index and mixer kind) whose output differs by more
            than ``tolerance`` (default by dtype: float64 1e-10, float32 1e-4, 16-bit 3e-2; under
            autocast, the autocast dtype's).
    """
    check_options(chunk_size, block_size=block_size)
    inner = _unwrap(model)
    ids, embeds, _, docs = _inputs(batch)
    source = ids if ids is not None else embeds.detach()
    tokens = min(source.shape[1], tokens or 4 * chunk_size)
    docs = None if docs is None else docs.truncated(tokens)
    source = source[:, :tokens]
    ids, embeds = (source, None) if ids is not None else (None, source)
    if ids is not None:
        inner.check_ids(ids)
    device = next(inner.parameters()).device
    dtype = _activation_dtype(inner, device)
    tolerance = CHECK_TOLERANCE.get(dtype, 1e-4) if tolerance is None else tolerance

    outputs: list[list[torch.Tensor]] = [[] for _ in inner.blocks]
    hooks = [block.register_forward_hook(lambda module, args, out, i=i: outputs[i].append(out[0].detach()))
             for i, block in enumerate(inner.blocks)]
    training = {module: module.training for module in inner.modules()}
    devices = [device] if device.type == "cuda" else []
    try:
        inner.eval()
        with torch.no_grad(), torch.random.fork_rng(devices=devices), suspended():  # local, unsharded
            layers = _Layers(inner, tokens, block_size or chunk_size, kv_offload, device, docs)
            full_hidden, _ = _call(model, layers, ids, embeds, 0, tokens, None)
            full = [out.pop() for out in outputs]
            # the logits are compared LOSS_SLICE tokens at a time (sums of squares in float64),
            # never whole: with a large vocabulary they are the biggest tensors in the check
            # (qwen35-0.8b, 65,536 tokens: 32 GB in bf16, twice that per chunk in float64)
            sums = torch.zeros(2, dtype=torch.float64, device=device)  # ‖chunked − full‖², ‖full‖²
            offset = [0]
            finite = torch.ones((), dtype=torch.bool, device=device)  # read once, at the end

            def compare_logits(hidden):
                same_tokens = full_hidden[:, offset[0]:offset[0] + hidden.shape[1]]
                for (_, _, logits), (_, _, ref) in zip(_head_slices(layers.head, hidden, LOSS_SLICE),
                                                       _head_slices(layers.head, same_tokens, LOSS_SLICE)):
                    finite.logical_and_(torch.isfinite(logits).all())
                    sums[0] += (logits.double() - ref.double()).square().sum()
                    sums[1] += ref.double().square().sum()
                offset[0] += hidden.shape[1]

            _forward_chunks(model, layers, ids, embeds, None, _chunks(tokens, chunk_size),
                            on_chunk=compare_logits)
    finally:
        for hook in hooks:
            hook.remove()
        for module, mode in training.items():
            module.train(mode)
    errors = [rel_err(torch.cat(out, dim=1), ref) for out, ref in zip(outputs, full)]
    logits_error = float((sums[0] / sums[1]).sqrt()) if sums[1] > 0 else float(sums[0].sqrt())
    errors.append(logits_error if bool(finite) else float("inf"))
    for i, error in enumerate(errors):
        if not error <= tolerance:  # NaN fails too
            where = (f"block {i} ({inner.blocks[i].kind}, {type(inner.blocks[i].mixer).__name__})"
                     if i < len(inner.blocks) else "the logits (after every block matched)")
            raise SeCOCheckError(
                f"SeCO refuses to train: {where} differs between one full forward and the chunked "
                f"forward with carried states (relative error {error:.3g} > {tolerance:g} for "
                f"{str(dtype).removeprefix('torch.')}, {tokens} tokens in chunks of {chunk_size}). "
                f"SeCO's gradient would not be this model's gradient; fix that layer's state "
                f"handling, or train without SeCO.")
    return errors
