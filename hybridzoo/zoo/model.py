"""``HybridLM``: one model class for every mix of the six mixers.

    input_ids [B, T] -> embedding -> n_layers × Block -> RMSNorm -> LM head -> logits [B, T, V]

    Block: x = x + mixer(norm(x));  x = x + mlp(norm(x))      (pre-norm; MLP optional)

Every block's mixer follows the state contract of :mod:`hybridzoo.layers`, so the model's
state is simply the list of its blocks' states: prefill runs the chunked kernels, decoding
feeds one token at a time with the state carried, and both are the same function.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hybridzoo.layers import MIXERS, MixerState, RMSNorm, SwiGLU
from hybridzoo.parallel.comm import ContextParallelError
from hybridzoo.parallel.context import active, model_call, sharded, sharded_document_targets
from hybridzoo.zoo.cross_entropy import IGNORE_INDEX, token_cross_entropy
from hybridzoo.zoo.config import HybridConfig

ModelState = list  # list[MixerState | None], one entry per block


class Block(nn.Module):
    """Pre-norm residual block: ``x + mixer(norm(x))`` then ``x + mlp(norm(x))``.

    Shapes: ``x [B, T, d_model]`` -> ``(x [B, T, d_model], state)``.
    """

    def __init__(self, config: HybridConfig, kind: str):
        super().__init__()
        mixer_cls = MIXERS[kind][0]
        self.kind = kind
        self.mixer_norm = RMSNorm(config.d_model, config.norm_eps, config.norm_zero_centered)
        self.mixer = mixer_cls(config.d_model, getattr(config, kind), backend=config.backend)
        if config.mlp_width:
            self.mlp_norm = RMSNorm(config.d_model, config.norm_eps, config.norm_zero_centered)
            self.mlp = SwiGLU(config.d_model, config.mlp_width)
        else:
            self.mlp_norm, self.mlp = None, None

    def forward(self, x: torch.Tensor, state: MixerState | None = None, *,
                cu_seqlens: torch.Tensor | None = None) -> tuple[torch.Tensor, MixerState]:
        if cu_seqlens is None:
            y, state = self.mixer(self.mixer_norm(x), state)
        else:
            y, state = self.mixer(self.mixer_norm(x), state, cu_seqlens=cu_seqlens)
        x = x + y
        if self.mlp is not None:
            x = x + self.mlp(self.mlp_norm(x))
        return x, state


class HybridLM(nn.Module):
    """A causal language model whose blocks mix any of the six mixers.

    ``logits, state = model(input_ids)``; ``logits, state, loss = model(input_ids, labels=...)``.
    """

    def __init__(self, config: HybridConfig):
        super().__init__()
        if not isinstance(config, HybridConfig):
            raise TypeError(f"HybridLM takes a HybridConfig, got {type(config).__name__}")
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.blocks = nn.ModuleList(Block(config, kind) for kind in config.layer_kinds())
        self.norm = RMSNorm(config.d_model, config.norm_eps, config.norm_zero_centered)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        self._ids_checked = False  # see ids_checked()
        self._init_weights()

    def check_ids(self, input_ids: torch.Tensor, *, values: bool = True) -> None:
        """Raise ``ValueError`` unless ``input_ids`` is an int tensor ``[B, T]`` of ids in
        ``[0, vocab_size)``. The range check (``values``) reads the ids' min and max back to the host
        (one device-to-host copy, which waits for the GPU's queue to drain)."""
        if input_ids.dim() != 2 or input_ids.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"HybridLM: input_ids must be an int tensor [B, T], got "
                             f"{tuple(input_ids.shape)} {input_ids.dtype}")
        if values and input_ids.numel():
            low, high = torch.stack(torch.aminmax(input_ids)).tolist()  # one read back to the host
            if high >= self.config.vocab_size or low < 0:
                raise ValueError(f"HybridLM: token ids must be in [0, {self.config.vocab_size}), "
                                 f"got range [{low}, {high}]")

    @contextlib.contextmanager
    def ids_checked(self):
        """Within: :meth:`forward` skips the range check of ``input_ids`` (a device-to-host
        sync per call), for a caller that ran :meth:`check_ids` on the whole batch and feeds it
        in pieces (SeCO calls the model twice per chunk; each sync drains the GPU's queue)."""
        previous, self._ids_checked = self._ids_checked, True
        try:
            yield self
        finally:
            self._ids_checked = previous

    def _init_weights(self) -> None:
        """Normal(0, init_std) for the embedding, the MLPs and an untied LM head; the mixers
        keep the published initialisation they gave themselves."""
        std = self.config.init_std
        nn.init.normal_(self.embed.weight, std=std)
        if not self.config.tie_embeddings:
            nn.init.normal_(self.lm_head.weight, std=std)
        for block in self.blocks:
            if block.mlp is not None:
                for linear in (block.mlp.gate_proj, block.mlp.up_proj, block.mlp.down_proj):
                    nn.init.normal_(linear.weight, std=std)

    # ---- forward --------------------------------------------------------------------------
    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        state: ModelState | None = None,
        labels: torch.Tensor | None = None,
        *,
        targets: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        return_hidden: bool = False,
        cu_seqlens: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ):
        """Run the model.

        Args:
            input_ids: ``[B, T]`` int64 token ids (or give ``inputs_embeds [B, T, d_model]``).
            state: the list returned by a previous call (continues that sequence), or None.
            labels: ``[B, T]`` as in Hugging Face: shifted inside (logits at t predict
                labels at t+1); -100 is ignored.
            targets: ``[B, T]`` already aligned with the logits (no shift); -100 ignored.
            return_hidden: return the final-norm hidden states ``[B, T, d_model]`` instead of the
                logits (``lm_head`` not applied; no loss: labels/targets refused). Lets a caller
                apply the head in slices, e.g. SeCO's sliced cross-entropy.
            cu_seqlens: packed documents in one row (``B = 1``): int32 ``[N + 1]``, the cumulative
                document lengths (see :mod:`hybridzoo.kernels.varlen`). No state, conv tail,
                attention read or rotary position crosses a boundary, and with ``labels`` the
                last token of each document gets no target (-100): the loss never predicts across
                a boundary (``targets`` are taken as given).
            position_ids: ``[B, T]`` positions restarting at 0 at each document (transformers'
                ``DataCollatorWithFlattening``), instead of ``cu_seqlens``: the boundaries are where
                they are 0, and every row start is one. With ``B > 1`` the rows are packed into one
                row ``[1, B·T]`` (each split at its own restarts) and the outputs reshaped back to
                ``[B, T, ...]``. They must count ``0, 1, ...`` within each document.

        With documents the returned state is per document (see :meth:`Mixer.forward`): a
        recurrent layer's state holds ``N`` rows, an attention layer's the K/V of the last document.

        Returns:
            ``(logits [B, T, vocab] in the model dtype, state)``, plus the mean cross-entropy
            over the non-ignored positions as a third item when labels or targets are given.
        """
        if return_hidden and (labels is not None or targets is not None):
            raise ValueError("HybridLM: return_hidden gives no loss; do not pass labels or targets")
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("HybridLM: give exactly one of input_ids and inputs_embeds")
        if inputs_embeds is None:
            self.check_ids(input_ids, values=not self._ids_checked)
            inputs_embeds = self.embed(input_ids)
        shape = inputs_embeds.shape[:2]
        cp = active()
        first_position = None  # context parallelism with documents: see ContextParallel
        if position_ids is not None:
            if cu_seqlens is not None:
                raise ValueError("HybridLM: give cu_seqlens or position_ids (the boundaries are derived "
                                 "from them), not both")
            if cp is not None and shape[0] != 1:
                raise ValueError(f"HybridLM: under context_parallel() packed documents take one row, "
                                 f"[1, T] per rank, got batch {shape[0]}")
            cu_seqlens = packed_cu_seqlens(position_ids, shape, carried=state is not None or cp is not None)
            if cp is not None:
                first_position = int(position_ids[0, 0])
        elif cu_seqlens is not None and cp is not None:
            raise ContextParallelError("HybridLM: under context_parallel() pass each rank's slice of "
                                       "position_ids for packed documents, not cu_seqlens")
        if cu_seqlens is not None:
            if shape[0] > 1 and position_ids is None:
                raise ValueError(f"HybridLM: with cu_seqlens the documents are packed into one row, "
                                 f"input [1, total], got batch {shape[0]}; pass position_ids (the "
                                 f"rows are then packed) or flatten the batch and offset cu_seqlens")
            inputs_embeds = inputs_embeds.reshape(1, -1, inputs_embeds.shape[-1])
            labels = None if labels is None else labels.reshape(1, -1)
            targets = None if targets is None else targets.reshape(1, -1)
        if state is None:
            state = [None] * len(self.blocks)
        if len(state) != len(self.blocks):
            raise ValueError(f"HybridLM: state has {len(state)} entries, the model has {len(self.blocks)} blocks")
        x, new_state = inputs_embeds, []
        documents = {} if cu_seqlens is None else {"cu_seqlens": cu_seqlens}
        with model_call(inputs_embeds, state, first_position):  # context parallelism: one shape check, no state
            for block, block_state in zip(self.blocks, state):
                x, block_state = block(x, block_state, **documents)
                new_state.append(block_state)
        x = x.reshape(*shape, x.shape[-1])  # packed rows back to [B, T, d_model]
        if return_hidden:
            return self.norm(x), new_state
        logits = self.lm_head(self.norm(x))
        if labels is None and targets is None:
            return logits, new_state
        if labels is not None and targets is not None:
            raise ValueError("HybridLM: give labels (shifted inside) or targets (aligned), not both")
        if labels is not None:
            if first_position is not None:  # the next rank's first position tells this slice's last target
                targets = sharded_document_targets(labels, position_ids)
            elif cu_seqlens is not None:
                targets = document_targets(labels, cu_seqlens).reshape(shape)
            else:
                targets = sharded(shift_labels)(labels)  # across ranks under context parallelism
        else:
            targets = targets.reshape(shape)
        # under context parallelism: this rank's share of the mean (the shares sum to it)
        return logits, new_state, sharded(lm_loss)(logits, targets)

    def init_state(self, batch_size: int, max_length: int, dtype: torch.dtype | None = None,
                   device: torch.device | str | None = None) -> ModelState:
        """A state to start from that preallocates what can be preallocated (the K/V stores of
        attention layers, for ``max_length`` tokens); recurrent layers start from None."""
        param = next(self.parameters())
        dtype = dtype or param.dtype
        device = device or param.device
        return [block.mixer.init_state(batch_size, max_length, dtype, device)
                if hasattr(block.mixer, "init_state") else None for block in self.blocks]

    # ---- generation and checkpoints (see generation.py, checkpoint.py, recipes.py) -----------
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int = 64, **kwargs: Any) -> torch.Tensor:
        """Prefill then decode; see :func:`hybridzoo.zoo.generation.generate`."""
        from hybridzoo.zoo.generation import generate

        return generate(self, input_ids, max_new_tokens, **kwargs)

    def save_pretrained(self, directory: str | Path) -> Path:
        """Write ``model.safetensors`` + ``config.json`` into ``directory``."""
        from hybridzoo.zoo.checkpoint import save_pretrained

        return save_pretrained(self, directory)

    @classmethod
    def from_pretrained(cls, directory: str | Path, device: torch.device | str | None = None,
                        dtype: torch.dtype | None = None, dtype_cast: bool = False) -> "HybridLM":
        """Load ``directory`` (or its ``model.safetensors`` / ``config.json``) written by
        :meth:`save_pretrained`. The model is float32 (or ``dtype``); float weights saved in any
        float dtype load into it (bf16 / fp16 widen exactly); a tensor of another kind (int32 where a float
        weight is expected, ...) is an error unless ``dtype_cast=True``. See
        :func:`hybridzoo.zoo.checkpoint.load_pretrained`."""
        from hybridzoo.zoo.checkpoint import load_pretrained

        return load_pretrained(cls, directory, device=device, dtype=dtype, dtype_cast=dtype_cast)

    @classmethod
    def from_recipe(cls, name_or_path: str | Path, **overrides: Any) -> "HybridLM":
        """Build from the model section of a packaged recipe name or a YAML path;
        ``overrides`` replace HybridConfig fields (e.g. ``layers="mamba2 attn", n_layers=4``)."""
        from hybridzoo.zoo.recipe_files import load_recipe_config

        return cls(load_recipe_config(name_or_path, **overrides))

    @classmethod
    def from_hf(cls, path: str | Path, device: torch.device | str | None = None,
                dtype: torch.dtype | None = None) -> "HybridLM":
        """Convert a local Hugging Face checkpoint directory (Mamba, Mamba-2, Qwen3-Next dense,
        Qwen3.5 text); see :func:`hybridzoo.zoo.convert.from_hf`."""
        from hybridzoo.zoo.hf_checkpoint import load_hf

        return load_hf(cls, path, device=device, dtype=dtype)

    def num_parameters(self) -> int:
        """Number of distinct parameters (a tied LM head is counted once)."""
        return sum(p.numel() for p in self.parameters())


def packed_cu_seqlens(position_ids: torch.Tensor, shape: tuple[int, int] | torch.Size,
                      carried: bool = False) -> torch.Tensor:
    """``cu_seqlens`` (int32 ``[N + 1]``) of the rows of ``position_ids [B, T]`` packed into one row
    ``[1, B·T]``: a document starts where ``position_ids == 0`` and at every row start. Raises
    ValueError unless ``position_ids`` count ``0, 1, ...`` within each document (the first
    document may start elsewhere when a state is ``carried``: it continues that state)."""
    from hybridzoo.layers.base import document_positions

    if not isinstance(position_ids, torch.Tensor) or position_ids.dim() != 2 or tuple(position_ids.shape) != tuple(shape) \
            or position_ids.is_floating_point():
        got = tuple(position_ids.shape) if isinstance(position_ids, torch.Tensor) else type(position_ids).__name__
        raise ValueError(f"HybridLM: position_ids must be an int tensor {list(shape)} like input_ids, got {got}")
    flat = position_ids.reshape(1, -1)
    starts = flat[0] == 0
    starts[::shape[1]] = True  # every row start is a boundary
    total = torch.tensor([flat.shape[1]], device=flat.device)
    cu = torch.cat([starts.nonzero()[:, 0], total]).to(torch.int32)
    expected = document_positions(cu, flat.shape[1], int(flat[0, 0]) if carried else 0)
    if not torch.equal(flat[0].long(), expected.to(flat.device)):
        raise ValueError("HybridLM: position_ids must restart at 0 at each document and count 0, 1, 2, ... "
                         "within it (transformers' DataCollatorWithFlattening); a row must start a "
                         "document (at 0)")
    return cu


def document_targets(labels: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Targets aligned with the logits from Hugging Face ``labels [1, total]`` of packed documents:
    position t gets label t+1, except the last token of each document (``cu_seqlens[1:] - 1``),
    which gets -100 (no prediction across a boundary)."""
    targets = shift_labels(labels)
    ends = cu_seqlens[1:].long().to(targets.device) - 1
    return targets.index_fill(1, ends, IGNORE_INDEX)


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """Hugging Face ``labels [B, T]`` as targets aligned with the logits ``[B, T]``: position t
    gets label t+1, the last position -100 (ignored)."""
    return F.pad(labels[:, 1:], (0, 1), value=-100)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy over positions whose target is not -100 (float32 or wider): their mean, or
    their sum with ``reduction="sum"`` (``"none"``: the ``[B * T]`` losses, 0 where ignored).
    ``logits [B, T, V]``, ``targets [B, T]`` aligned.

    Upcasts the logits a chunk of rows at a time: for the backward it keeps the logits as given
    (bf16 under autocast) and one float32 log-sum-exp per position (see
    :func:`hybridzoo.zoo.cross_entropy.token_cross_entropy`)."""
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"lm_loss: reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    losses = token_cross_entropy(logits.flatten(0, 1), targets.flatten())
    if reduction == "none":
        return losses
    total = losses.sum()
    if reduction == "sum":
        return total
    return total / (targets != IGNORE_INDEX).sum().to(total.dtype)  # 0 labelled: nan, as F.cross_entropy
