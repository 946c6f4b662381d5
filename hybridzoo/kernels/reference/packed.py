"""Packed documents in the reference backend: run each document alone and join the results.

This is the spec of every op's ``cu_seqlens`` form (:mod:`hybridzoo.kernels.varlen`): document
``n`` (tokens ``cu[n] … cu[n+1]-1`` of the ``[1, total, ...]`` row) runs through the op's own
unpacked reference from ``initial_state[n]``; the outputs are concatenated along time and the final
states stacked along the document axis. Autograd flows through the slices, so every gradient
(``initial_state`` included) is that of the documents run separately.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from hybridzoo.kernels.varlen import check_packed, split_documents


def run_per_document(
    op: str,
    run: Callable[..., tuple[torch.Tensor, torch.Tensor | None]],
    cu_seqlens: torch.Tensor,
    sequences: Sequence[torch.Tensor | None],
    initial_state: torch.Tensor | None,
    output_final_state: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``run(*document_slices, initial_state=h0, output_final_state=...)`` per document, joined.

    Args:
        op: the op's name (for error messages).
        run: the unpacked op, taking the sliced ``sequences`` positionally.
        cu_seqlens: int32 ``[N + 1]``.
        sequences: the per-token tensors ``[1, total, ...]`` (None entries pass through as None).
        initial_state: ``[N, ...]`` or None (zeros for every document).
        output_final_state: also return the stacked final states ``[N, ...]``.

    Returns:
        ``(output [1, total, ...], final_state [N, ...] or None)``.
    """
    first = next(t for t in sequences if t is not None)
    cu = check_packed(op, cu_seqlens, first, initial_state)
    outputs, finals = [], []
    for n, (start, end) in enumerate(split_documents(cu)):
        pieces = [None if t is None else t[:, start:end] for t in sequences]
        h0 = None if initial_state is None else initial_state[n:n + 1]
        out, final = run(*pieces, initial_state=h0, output_final_state=output_final_state)
        outputs.append(out)
        finals.append(final)
    output = torch.cat(outputs, dim=1)
    return output, (torch.cat(finals, dim=0) if output_final_state else None)
