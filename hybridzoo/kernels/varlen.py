"""Packed documents ("varlen"): the helpers every op, backend and kernel shares.

A packed batch lays its documents end to end in one row, ``[1, total, ...]``, and names their
boundaries with ``cu_seqlens``: int32 ``[N + 1]``, the cumulative document lengths
(``cu[0] == 0``, ``cu[-1] == total``, strictly increasing: no empty document). Every op then
behaves as if each document ran alone from its own initial state (``[N, ...]``) and the outputs
were concatenated and the final states stacked.

* :func:`check_cu_seqlens` — validate (one clear ``ValueError`` per mistake), return int32 on the
  device. A tensor once validated is remembered (until it is modified in place), so the check that
  reads the values (a device-to-host copy on CUDA) runs once per forward, not once per layer.
* :func:`seq_idx_from_cu_seqlens` — the document index of each token, int32 ``[total]``.
* :func:`cu_seqlens_from_position_ids` — documents start where ``position_ids == 0``
  (transformers' ``DataCollatorWithFlattening`` convention).
* :func:`prepare_chunk_indices` — ``(document, chunk within the document)`` of every chunk of a
  per-document chunk grid, int32 ``[n_chunks, 2]``, as fla's kernels walk it (the last chunk of a
  document is partial; documents are never padded to a chunk multiple).
* :func:`check_packed` — the shape rules of a packed op call (batch 1, initial states ``[N, ...]``).
"""

from __future__ import annotations

import torch

__all__ = [
    "check_cu_seqlens",
    "check_packed",
    "cu_seqlens_from_position_ids",
    "prepare_chunk_indices",
    "chunk_tables",
    "seq_idx_from_cu_seqlens",
    "split_documents",
]

# id(tensor) -> (tensor, version, total, device, validated int32 copy); small and bounded
_VALIDATED: dict[int, tuple] = {}
_MAX_REMEMBERED = 64


def check_cu_seqlens(cu_seqlens: torch.Tensor, total: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Validate ``cu_seqlens`` for a packed row of ``total`` tokens; return it as int32 on ``device``.

    Args:
        cu_seqlens: int32 or int64 ``[N + 1]``, ``N >= 1``; ``cu[0] == 0``, ``cu[-1] == total``,
            strictly increasing (a zero-length document is refused).
        total: the number of tokens of the packed row.
        device: where the result lives (default: where ``cu_seqlens`` is).

    Returns:
        int32 ``[N + 1]`` on ``device`` (the input itself when it already is).

    Raises:
        ValueError: naming the rule broken and the fix.
    """
    if not isinstance(cu_seqlens, torch.Tensor):
        raise ValueError(f"cu_seqlens must be a torch.Tensor (int32 [N + 1]), got {type(cu_seqlens).__name__}; "
                         "build it with hybridzoo.kernels.varlen.cu_seqlens_from_position_ids or torch.tensor(..., dtype=torch.int32)")
    device = cu_seqlens.device if device is None else torch.device(device)
    key = id(cu_seqlens)
    seen = _VALIDATED.get(key)
    if seen is not None and seen[0] is cu_seqlens and seen[1] == cu_seqlens._version and seen[2] == total \
            and seen[3] == device:
        return seen[4]
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"cu_seqlens must be int32 (or int64), got {cu_seqlens.dtype}; pass .to(torch.int32)")
    if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 2:
        raise ValueError(f"cu_seqlens must be 1-D [N + 1] with N >= 1 documents, got shape {tuple(cu_seqlens.shape)}")
    values = cu_seqlens.tolist()
    if values[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0, got cu_seqlens[0] = {values[0]}")
    if values[-1] != total:
        raise ValueError(f"cu_seqlens must end at the packed length {total} (the tokens of the [1, total, ...] "
                         f"row), got cu_seqlens[-1] = {values[-1]}")
    lengths = [b - a for a, b in zip(values[:-1], values[1:])]
    bad = next((i for i, n in enumerate(lengths) if n <= 0), None)
    if bad is not None:
        raise ValueError(f"cu_seqlens must be strictly increasing: document {bad} has length {lengths[bad]} "
                         f"(cu_seqlens[{bad}:{bad + 2}] = {values[bad:bad + 2]}); drop empty documents")
    result = cu_seqlens.to(device=device, dtype=torch.int32)
    if len(_VALIDATED) >= _MAX_REMEMBERED:
        _VALIDATED.clear()
    _VALIDATED[key] = (cu_seqlens, cu_seqlens._version, total, device, result)
    if result is not cu_seqlens:  # the converted copy, passed on to backends, is valid too
        _VALIDATED[id(result)] = (result, result._version, total, device, result)
    return result


def check_packed(op: str, cu_seqlens: torch.Tensor, x: torch.Tensor,
                 initial_state: torch.Tensor | None = None, state_shape: tuple[int, ...] | None = None) -> torch.Tensor:
    """The shape rules of a packed call of ``op``: ``x`` is ``[1, total, ...]``, ``initial_state``
    (if given) is ``[N, *state_shape]``. Returns the validated int32 ``cu_seqlens`` on ``x``'s device.

    Raises:
        ValueError: naming the op, the rule and the fix.
    """
    if x.dim() < 2 or x.shape[0] != 1:
        raise ValueError(f"{op}: with cu_seqlens the batch dimension must be 1 (documents packed as [1, total, ...]), "
                         f"got shape {tuple(x.shape)}; flatten the batch with x.reshape(1, -1, ...) and offset cu_seqlens")
    cu = check_cu_seqlens(cu_seqlens, x.shape[1], x.device)
    n_docs = cu.shape[0] - 1
    if initial_state is not None:
        expected = (n_docs,) + (tuple(state_shape) if state_shape is not None else tuple(initial_state.shape[1:]))
        if tuple(initial_state.shape) != expected:
            raise ValueError(f"{op}: with cu_seqlens of {n_docs} documents the initial_state must be one per document, "
                             f"{list(expected)}, got {list(initial_state.shape)}")
    return cu


def split_documents(cu_seqlens: torch.Tensor) -> list[tuple[int, int]]:
    """``[(start, end), ...]`` of each document (host ints) from a validated ``cu_seqlens``."""
    values = cu_seqlens.tolist()
    return list(zip(values[:-1], values[1:]))


def seq_idx_from_cu_seqlens(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """The document index of each token: int32 ``[total]`` on ``cu_seqlens``' device
    (``0`` for the tokens of the first document, ...), as mamba_ssm's ``seq_idx``."""
    cu = check_cu_seqlens(cu_seqlens, total)
    lengths = (cu[1:] - cu[:-1]).long()
    return torch.repeat_interleave(torch.arange(lengths.shape[0], device=cu.device, dtype=torch.int32),
                                   lengths, output_size=total)


def cu_seqlens_from_position_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """int32 ``cu_seqlens`` ``[N + 1]`` of a packed row whose ``position_ids`` restart at 0 at
    each document (transformers' ``DataCollatorWithFlattening``).

    Args:
        position_ids: ``[1, T]`` or ``[T]`` integer; ``position_ids[..., 0] == 0`` and each entry
            is either 0 (a document starts) or the previous entry + 1.

    Returns:
        int32 ``[N + 1]`` on ``position_ids``' device.

    Raises:
        ValueError: on a batch of more than one row or positions that do not count up from 0.
    """
    if position_ids.dim() == 2:
        if position_ids.shape[0] != 1:
            raise ValueError(f"cu_seqlens_from_position_ids takes one packed row [1, T], got shape "
                             f"{tuple(position_ids.shape)}; pack the batch into one row (position_ids.reshape(1, -1))")
        position_ids = position_ids[0]
    if position_ids.dim() != 1 or position_ids.shape[0] == 0:
        raise ValueError(f"position_ids must be [1, T] or [T] with T >= 1, got shape {tuple(position_ids.shape)}")
    if position_ids.is_floating_point() or position_ids.is_complex():
        raise ValueError(f"position_ids must be integers, got {position_ids.dtype}")
    pos = position_ids.long()
    starts = pos == 0
    follows = torch.cat([pos.new_ones(1, dtype=torch.bool), pos[1:] == pos[:-1] + 1])
    if not bool((starts | follows).all()) or not bool(starts[0]):
        bad = int((~(starts | follows)).nonzero()[0]) if not bool((starts | follows).all()) else 0
        raise ValueError(f"position_ids must restart at 0 at each document and count up by 1 inside it; "
                         f"position {bad} holds {int(pos[bad])}")
    total = pos.shape[0]
    begins = starts.nonzero().flatten()
    return torch.cat([begins, begins.new_tensor([total])]).to(torch.int32)


def prepare_chunk_indices(cu_seqlens: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """Every chunk of a per-document chunk grid, as fla's ``prepare_chunk_indices``.

    Args:
        cu_seqlens: int32 ``[N + 1]`` (validated).
        chunk_size: tokens per chunk, >= 1.

    Returns:
        int32 ``[n_chunks, 2]`` on ``cu_seqlens``' device: row ``i`` is ``(document, chunk within
        the document)``; document ``n`` has ``ceil(len_n / chunk_size)`` chunks, its last one
        partial. Chunk ``(n, c)`` covers tokens ``cu[n] + c·chunk_size … min(cu[n+1], cu[n] + (c+1)·chunk_size) - 1``.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    counts = (lengths + chunk_size - 1) // chunk_size
    n_chunks = int(counts.sum())
    doc = torch.repeat_interleave(torch.arange(counts.shape[0], device=cu_seqlens.device), counts, output_size=n_chunks)
    first = torch.cumsum(counts, 0) - counts  # the index of each document's first chunk
    within = torch.arange(n_chunks, device=cu_seqlens.device) - first[doc]
    return torch.stack([doc, within], dim=1).to(torch.int32)


# (id, version, chunk size) of a cu_seqlens tensor -> (that tensor, its chunk_tables); small, bounded
_TABLES: dict[tuple, tuple] = {}
_MAX_TABLES = 64


def chunk_tables(cu_seqlens: torch.Tensor, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each packed document in its own grid of ``chunk_size``-token chunks (the last one partial,
    no padding), as the Triton chunk kernels read it: ``(cu_seqlens, chunk_indices [n_chunks, 2],
    chunk_offsets [N + 1])`` int32 on ``cu_seqlens``' device: (document, chunk within the document)
    of every chunk (:func:`prepare_chunk_indices`) and the first chunk of each document
    (``chunk_offsets[-1] = n_chunks``). ``cu_seqlens``: validated int32 ``[N + 1]``.

    Building them reads the chunk count on the host (a device sync on CUDA), so the tables of a
    ``cu_seqlens`` tensor are remembered until it is modified in place: every layer of a forward,
    and the backward, reuse them, as :func:`check_cu_seqlens` hands every layer the same tensor."""
    key = (id(cu_seqlens), cu_seqlens._version, chunk_size)
    seen = _TABLES.get(key)
    if seen is not None and seen[0] is cu_seqlens:
        return seen[1]
    indices = prepare_chunk_indices(cu_seqlens, chunk_size).contiguous()
    counts = (cu_seqlens[1:] - cu_seqlens[:-1] + chunk_size - 1) // chunk_size
    offsets = torch.nn.functional.pad(torch.cumsum(counts, 0), (1, 0)).to(torch.int32)
    tables = (cu_seqlens.to(torch.int32).contiguous(), indices, offsets)
    if len(_TABLES) >= _MAX_TABLES:
        _TABLES.clear()
    _TABLES[key] = (cu_seqlens, tables)
    return tables
