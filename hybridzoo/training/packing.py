"""Packing documents and fine-tuning samples into rows with document boundaries.

:class:`DocumentRows` (``TextDataModule(packing="documents")``) lays token sequences into rows
of exactly ``seq_len`` tokens without letting any row mix two documents in one context:

* each sequence (a document plus its end-of-document id, or a fine-tuning sample) longer than a
  row is cut into row-sized pieces, each piece its own document;
* the pieces are placed best-fit decreasing (longest first, each into the row with the least room
  that still holds it, a new row when none does): a piece shorter than a row is never split;
* what is left of a row is filled with padding (the end-of-document id, or 0), a document of its
  own whose tokens get no loss.

Items are ``{"input_ids", "labels", "position_ids"}``, int64 ``[seq_len]``: ``position_ids``
restart at 0 at every document (transformers' ``DataCollatorWithFlattening`` convention, from
which ``HybridLM`` derives ``cu_seqlens``); ``labels`` (unshifted, as ``HybridLM`` takes them)
are -100 at the first token of every document, so no target crosses a boundary, on padding and
on the tokens a fine-tuning sample does not train (its prompt).

:class:`Sample` is a fine-tuning sample: text segments, each trained or not. Two jsonl formats
(see :func:`sample_from_record`): ``{"prompt": ..., "response": ...}`` (the prompt, then the
response and the end-of-document id, trained) and ``{"messages": [{"role": ..., "content": ...}]}``
rendered in the ChatML form ``<|im_start|>{role}\\n{content}<|im_end|>\\n`` (Qwen's chat format),
training the content and ``<|im_end|>`` of each ``assistant`` message.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.utils.data import Dataset

__all__ = ["DocumentRows", "Sample", "pack_rows", "sample_from_record", "tokenize_sequences"]

CHAT_START, CHAT_END = "<|im_start|>", "<|im_end|>"


@dataclass(frozen=True)
class Sample:
    """A fine-tuning sample: ``segments`` of ``(text, trained)`` in order; the loss covers the
    trained segments' tokens only. ``eos``: append the end-of-document id (trained)."""

    segments: tuple[tuple[str, bool], ...]
    eos: bool = True

    def utf8_bytes(self) -> int:
        return sum(len(text.encode("utf-8")) for text, _ in self.segments)


def sample_from_record(record: dict, where: str) -> Sample | None:
    """The fine-tuning sample of one jsonl record, or None if it is not one (no ``prompt`` /
    ``response`` / ``messages`` keys).

    Raises:
        ValueError: naming ``where`` (file and line) on a malformed sample.
    """
    if "messages" in record:
        messages = record["messages"]
        if not isinstance(messages, list) or not messages:
            raise ValueError(f'{where}: "messages" must be a non-empty list of {{"role", "content"}} objects')
        segments = []
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str) \
                    or not isinstance(message.get("content"), str):
                raise ValueError(f'{where}: messages[{i}] must be an object with "role" and "content" strings')
            segments.append((f"{CHAT_START}{message['role']}\n", False))
            segments.append((f"{message['content']}{CHAT_END}", message["role"] == "assistant"))
            segments.append(("\n", False))
        if not any(trained for _, trained in segments):
            raise ValueError(f'{where}: no "assistant" message: the sample would train nothing')
        return Sample(tuple(segments), eos=False)
    if "prompt" in record or "response" in record:
        prompt, response = record.get("prompt"), record.get("response")
        if not isinstance(prompt, str) or not isinstance(response, str) or not response:
            raise ValueError(f'{where}: a fine-tuning record needs a "prompt" string and a non-empty '
                             f'"response" string')
        return Sample(((prompt, False), (response, True)), eos=True)
    return None


def tokenize_sequences(items: Sequence, tokenizer) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """Token ids of documents (``str`` / ``bytes``: the text and the end-of-document id, all
    trained) and :class:`Sample` s, as ``(ids int64 [L], trained bool [L] or None = all)``."""
    eos = [] if tokenizer.eos_id is None else [tokenizer.eos_id]
    texts, owners = [], []
    for n, item in enumerate(items):
        if isinstance(item, Sample):
            for text, _ in item.segments:
                texts.append(text)
                owners.append(n)
        else:
            texts.append(item.decode("utf-8", errors="replace") if isinstance(item, bytes) else item)
            owners.append(n)
    encoded = iter(tokenizer.encode_batch(texts))
    out = []
    for item in items:
        if not isinstance(item, Sample):
            ids = list(next(encoded)) + eos
            out.append((torch.tensor(ids, dtype=torch.int64), None))
            continue
        ids, trained = [], []
        for _, train in item.segments:
            piece = list(next(encoded))
            ids += piece
            trained += [train] * len(piece)
        if item.eos:
            ids += eos
            trained += [True] * len(eos)
        out.append((torch.tensor(ids, dtype=torch.int64), torch.tensor(trained, dtype=torch.bool)))
    return out


def pack_rows(lengths: Sequence[int], seq_len: int) -> list[list[tuple[int, int, int]]]:
    """Place sequences of ``lengths`` into rows of ``seq_len`` tokens.

    A sequence longer than a row is cut into row-sized pieces; pieces go best-fit decreasing (ties
    in input order). Returns the rows in order of creation, each a list of pieces
    ``(sequence, start, end)``.
    """
    pieces = [(n, start, min(length, start + seq_len))
              for n, length in enumerate(lengths) for start in range(0, length, seq_len)]
    pieces.sort(key=lambda p: -(p[2] - p[1]))  # stable: equal lengths keep their input order
    rows: list[list[tuple[int, int, int]]] = []
    room: list[tuple[int, int]] = []  # (room left, row) sorted, rows with room > 0 only
    for piece in pieces:
        size = piece[2] - piece[1]
        at = bisect.bisect_left(room, (size, -1))
        if at == len(room):
            rows.append([piece])
            left, row = seq_len - size, len(rows) - 1
        else:
            left, row = room.pop(at)
            rows[row].append(piece)
            left -= size
        if left > 0:
            bisect.insort(room, (left, row))
    return rows


class DocumentRows(Dataset):
    """Rows of packed documents with their boundaries (see the module docstring).

    Args:
        sequences: ``(ids int64 [L], trained bool [L] or None)`` per document or sample, L >= 1.
        seq_len: tokens per row.
        pad_id: the id of the padding that fills a row's rest.

    ``padding`` counts the padding tokens of all rows.
    """

    def __init__(self, sequences: Sequence[tuple[torch.Tensor, torch.Tensor | None]], seq_len: int, pad_id: int = 0):
        self.seq_len = seq_len
        rows = pack_rows([len(ids) for ids, _ in sequences], seq_len)
        tokens, trained, starts, offset, self.padding = [], [], [], 0, 0
        for row in rows:
            for n, start, end in row:
                ids, mask = sequences[n]
                tokens.append(ids[start:end].to(torch.int32))
                trained.append(torch.ones(end - start, dtype=torch.bool) if mask is None else mask[start:end])
                starts.append(offset)
                offset += end - start
            pad = seq_len - sum(end - start for _, start, end in row)
            if pad:
                tokens.append(torch.full((pad,), pad_id, dtype=torch.int32))
                trained.append(torch.zeros(pad, dtype=torch.bool))
                starts.append(offset)
                offset += pad
                self.padding += pad
        self.tokens = torch.cat(tokens) if tokens else torch.empty(0, dtype=torch.int32)  # int32: half the memory
        self.trained = torch.cat(trained) if trained else torch.empty(0, dtype=torch.bool)
        self.starts = torch.tensor(starts, dtype=torch.int64)  # where each document (piece, padding) starts

    def __len__(self) -> int:
        return self.tokens.numel() // self.seq_len

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(f"row {i} out of range for {len(self)} rows")
        lo, hi = i * self.seq_len, (i + 1) * self.seq_len
        ids = self.tokens[lo:hi].long()
        first = int(torch.searchsorted(self.starts, lo, right=True)) - 1
        last = int(torch.searchsorted(self.starts, hi))
        row_starts = self.starts[first:last] - lo  # the first is 0: no document crosses a row edge
        is_start = torch.zeros(self.seq_len, dtype=torch.bool)
        is_start[row_starts] = True
        index = torch.arange(self.seq_len)
        position_ids = index - torch.cummax(torch.where(is_start, index, 0), dim=0).values
        labels = torch.where(self.trained[lo:hi] & ~is_start, ids, torch.full_like(ids, -100))
        return {"input_ids": ids, "labels": labels, "position_ids": position_ids}
