"""Scoring and generation for evaluation harnesses, carrying the model's state.

A recurrent model's state after a prompt summarises the whole prompt, so evaluation never has to
run a prompt twice:

* :func:`continuation_logprobs` runs each distinct context once (in pieces of ``prefill_chunk``
  tokens, the state carried from piece to piece), keeps the per-layer state, and scores every
  continuation of that context from it: the first continuation token from the context's last
  logits, the others from one forward of the continuation with the context's state.
* :func:`rolling_logprobs` scores whole documents, each token once, with all the tokens before
  it as context (no sliding windows: the state carries everything).
* :func:`generate_until` prefills each context once and decodes one token at a time from the
  carried state until a stop string, the end-of-document id or the token budget.

Batching is exact (no padding ever enters a state that is used later): contexts are batched
with contexts of the same token length (a state holds one position count for its whole batch);
continuations and documents are right-padded, which cannot change the logits before the pad.
Token ids are plain lists of ints; the caller tokenizes. Everything runs under ``no_grad`` in
the model's dtype; log-probabilities are taken in float32 (float64 for a float64 model).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

ModelState = list  # list[MixerState | None], one entry per block (as in hybridzoo.zoo.model)


def select_state(state: ModelState, rows: torch.Tensor) -> ModelState:
    """The state of the batch rows ``rows`` (int64 ``[R]``, repeats allowed): every tensor of
    every layer's state indexed along its batch dimension (a copy)."""
    return [None if s is None else s.map(lambda t: t.index_select(0, rows)) for s in state]


def prefill(model, input_ids: torch.Tensor, state: ModelState | None = None,
            prefill_chunk: int = 4096) -> tuple[torch.Tensor, ModelState]:
    """Run ``input_ids [B, T]`` (T >= 1) through ``model`` in pieces of ``prefill_chunk`` tokens,
    the state carried between pieces. Returns the logits at the last position ``[B, V]`` and the
    state after the last token (the LM head runs on the last position only)."""
    if input_ids.shape[1] == 0:
        raise ValueError("prefill: input_ids must hold at least one token per row")
    for start in range(0, input_ids.shape[1], prefill_chunk):
        hidden, state = model(input_ids[:, start:start + prefill_chunk], state, return_hidden=True)
    return model.lm_head(hidden[:, -1]), state


def _log_softmax(logits: torch.Tensor) -> torch.Tensor:
    return logits.to(torch.promote_types(logits.dtype, torch.float32)).log_softmax(-1)


def _chunks(items: Sequence, size: int):
    for start in range(0, len(items), size):
        yield items[start:start + size]


def _right_padded(rows: Sequence[Sequence[int]], device, pad: int = 0) -> torch.Tensor:
    width = max(len(r) for r in rows)
    return torch.tensor([list(r) + [pad] * (width - len(r)) for r in rows], dtype=torch.long, device=device)


def _check_batch_size(batch_size: int) -> None:
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")


@torch.no_grad()
def continuation_logprobs(model, requests: Sequence[tuple[Sequence[int], Sequence[int]]],
                          batch_size: int = 16, prefill_chunk: int = 4096,
                          on_result: Callable[[int, tuple[float, bool]], None] | None = None,
                          ) -> list[tuple[float, bool]]:
    """``(log p(continuation | context), is_greedy)`` for each ``(context_ids, continuation_ids)``.

    ``log p`` is the sum over the continuation tokens of the log-softmax of the logits that
    predict them; ``is_greedy`` is whether every continuation token is the argmax of those
    logits. Each distinct context (non-empty) is run once; requests sharing it are scored from
    its state. ``batch_size`` bounds the rows of every forward (contexts in a prefill,
    continuations in a scoring pass). ``on_result(i, result)`` is called as each request is done.
    """
    _check_batch_size(batch_size)
    device = next(model.parameters()).device
    results: list[tuple[float, bool] | None] = [None] * len(requests)
    by_context: dict[tuple[int, ...], list[int]] = defaultdict(list)
    for i, (context, continuation) in enumerate(requests):
        if len(context) == 0:
            raise ValueError(f"request {i}: the context has no tokens (give at least a prefix token)")
        by_context[tuple(context)].append(i)
    by_length: dict[int, list[tuple[int, ...]]] = defaultdict(list)
    for context in by_context:
        by_length[len(context)].append(context)

    for length in sorted(by_length, reverse=True):
        for contexts in _chunks(by_length[length], batch_size):
            last_logits, state = prefill(model, torch.tensor(contexts, dtype=torch.long, device=device),
                                         prefill_chunk=prefill_chunk)
            first = _log_softmax(last_logits)  # [C, V]: predicts each continuation's first token
            rows = [(c, i) for c, context in enumerate(contexts) for i in by_context[context]]
            for part in _chunks(rows, batch_size):
                for (i, result) in zip((i for _, i in part), _score_rows(model, state, first, part, requests)):
                    results[i] = result
                    if on_result is not None:
                        on_result(i, result)
    return results


def _score_rows(model, state: ModelState, first: torch.Tensor, part: Sequence[tuple[int, int]],
                requests) -> list[tuple[float, bool]]:
    """Score the continuations of ``part`` (``(context row, request index)`` pairs) from the
    contexts' ``state`` and first-token log-probabilities ``first [C, V]``."""
    continuations = [list(requests[i][1]) for _, i in part]
    context_rows = torch.tensor([c for c, _ in part], dtype=torch.long, device=first.device)
    first = first.index_select(0, context_rows)                            # [R, V]
    width = max(len(c) for c in continuations)
    if width == 0:
        return [(0.0, True)] * len(part)
    if width > 1:  # feed tokens 0 .. n-2 of each continuation from its context's state
        inputs = _right_padded([c[:-1] if c else [0] for c in continuations], first.device)
        logits, _ = model(inputs, select_state(state, context_rows))
        logprobs = torch.cat([first[:, None], _log_softmax(logits)], dim=1)  # [R, width, V]
    else:
        logprobs = first[:, None]
    out = []
    for row, continuation in enumerate(continuations):
        n = len(continuation)
        if n == 0:
            out.append((0.0, True))
            continue
        target = torch.tensor(continuation, dtype=torch.long, device=first.device)
        rows = logprobs[row, :n]
        total = rows.gather(-1, target[:, None]).sum()
        greedy = bool((rows.argmax(-1) == target).all())
        out.append((float(total), greedy))
    return out


@torch.no_grad()
def rolling_logprobs(model, documents: Sequence[Sequence[int]], prefix_id: int, batch_size: int = 16,
                     prefill_chunk: int = 4096) -> list[float]:
    """``log p(document | prefix_id)`` for each token list: every token scored once, predicted
    from ``prefix_id`` and all the document's tokens before it. Documents are batched by similar
    length (right-padded) and run in pieces of ``prefill_chunk`` tokens with the state carried."""
    _check_batch_size(batch_size)
    device = next(model.parameters()).device
    results = [0.0] * len(documents)
    order = sorted((i for i, d in enumerate(documents) if len(d)), key=lambda i: -len(documents[i]))
    for indices in _chunks(order, batch_size):
        docs = [list(documents[i]) for i in indices]
        inputs = _right_padded([[prefix_id] + d[:-1] for d in docs], device)
        targets = _right_padded(docs, device, pad=-1)
        totals = torch.zeros(len(docs), dtype=torch.float64, device=device)
        state = None
        for start in range(0, inputs.shape[1], prefill_chunk):
            logits, state = model(inputs[:, start:start + prefill_chunk], state)
            target = targets[:, start:start + prefill_chunk]
            picked = _log_softmax(logits).gather(-1, target.clamp(min=0)[..., None])[..., 0]
            totals += torch.where(target >= 0, picked, 0).sum(-1).double()
        for i, total in zip(indices, totals.tolist()):
            results[i] = total
    return results


@dataclass
class GenerationRequest:
    """One prompt to continue: ``context`` token ids (non-empty), the strings that end it
    (``until``; the text is cut before the first), the most tokens to generate, and the sampling
    settings of :func:`hybridzoo.zoo.generation.sample_next` (``temperature`` 0 = greedy)."""

    context: Sequence[int]
    until: Sequence[str] = ()
    max_new_tokens: int = 256
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None


def cut_at_stop(text: str, until: Sequence[str]) -> tuple[str, bool]:
    """``text`` cut before the earliest occurrence of any non-empty string of ``until``, and
    whether one occurred."""
    cut = min((text.find(s) for s in until if s and s in text), default=-1)
    return (text, False) if cut < 0 else (text[:cut], True)


@torch.no_grad()
def generate_until(model, requests: Sequence[GenerationRequest], decode: Callable[[list[int]], str],
                   eos_id: int | None = None, batch_size: int = 16, prefill_chunk: int = 4096,
                   generator: torch.Generator | None = None) -> list[str]:
    """Continue each request's context, one token at a time from the carried state, until its
    text holds one of its ``until`` strings, ``eos_id`` is generated, or ``max_new_tokens``
    tokens; return each continuation's text (``decode`` of the new tokens, ``eos_id`` left out)
    cut before the first stop string.

    Requests whose contexts have the same token length are prefilled and decoded together (at
    most ``batch_size`` rows); a row that stops leaves the batch (its state rows are dropped).
    """
    _check_batch_size(batch_size)
    device = next(model.parameters()).device
    texts = [""] * len(requests)
    by_length: dict[int, list[int]] = defaultdict(list)
    for i, request in enumerate(requests):
        if len(request.context) == 0:
            raise ValueError(f"generation request {i}: the context has no tokens")
        if request.max_new_tokens > 0:
            by_length[len(request.context)].append(i)
    for length in sorted(by_length, reverse=True):
        for indices in _chunks(by_length[length], batch_size):
            contexts = torch.tensor([list(requests[i].context) for i in indices], dtype=torch.long, device=device)
            logits, state = prefill(model, contexts, prefill_chunk=prefill_chunk)
            active, new_tokens = list(indices), {i: [] for i in indices}
            while True:
                tokens = _next_tokens(logits, [requests[i] for i in active], generator)
                keep = []
                for row, (i, token) in enumerate(zip(active, tokens)):
                    done = token == eos_id
                    if not done:
                        new_tokens[i].append(token)
                        texts[i], done = cut_at_stop(decode(new_tokens[i]), requests[i].until)
                    if not done and len(new_tokens[i]) < requests[i].max_new_tokens:
                        keep.append(row)
                if not keep:
                    break
                if len(keep) < len(active):
                    state = select_state(state, torch.tensor(keep, dtype=torch.long, device=device))
                    active = [active[row] for row in keep]
                step = torch.tensor([[new_tokens[i][-1]] for i in active], dtype=torch.long, device=device)
                logits, state = model(step, state)
                logits = logits[:, -1]
    return texts


def _next_tokens(logits: torch.Tensor, requests: Sequence[GenerationRequest],
                 generator: torch.Generator | None) -> list[int]:
    """One token per row of ``logits [R, V]``: the argmax, or sampled with the row's settings."""
    from hybridzoo.zoo.generation import sample_next

    if all(r.temperature == 0 for r in requests):
        return logits.argmax(-1).tolist()
    return [int(sample_next(logits[row:row + 1], r.temperature, r.top_k, r.top_p, generator))
            for row, r in enumerate(requests)]
