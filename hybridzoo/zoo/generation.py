"""Generation: prefill with the chunked kernels, then one-token steps carrying the states."""

from __future__ import annotations

import torch


def sample_next(logits: torch.Tensor, temperature: float = 0.0, top_k: int | None = None,
                top_p: float | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
    """Pick one token per row from ``logits [B, V]`` -> ``[B]`` int64.

    ``temperature == 0`` is greedy (argmax). Otherwise softmax(logits / temperature) restricted
    to the ``top_k`` most likely tokens and to the smallest set whose mass reaches ``top_p``.
    """
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k is not None:
        if top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {top_k}")
        kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None:
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token when the mass before it already reaches top_p (the first is always kept)
        drop = probs.cumsum(-1) - probs >= top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    probs = logits.softmax(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate(model, input_ids: torch.Tensor, max_new_tokens: int = 64, temperature: float = 0.0,
             top_k: int | None = None, top_p: float | None = None, eos_token_id: int | None = None,
             generator: torch.Generator | None = None) -> torch.Tensor:
    """Continue ``input_ids [B, T]`` (equal-length prompts) by up to ``max_new_tokens`` tokens.

    The prompt is prefilled in one chunked call; then each new token is fed alone with the
    carried state (attention K/V stores are preallocated for the whole output). Rows that
    emit ``eos_token_id`` keep emitting it; generation stops early when every row has.

    Returns ``[B, T + n]`` int64 (prompt included), ``n <= max_new_tokens``.
    """
    if input_ids.dim() != 2 or input_ids.shape[1] == 0:
        raise ValueError(f"generate: input_ids must be [B, T] with T >= 1, got {tuple(input_ids.shape)}")
    if max_new_tokens < 0:
        raise ValueError(f"generate: max_new_tokens must be >= 0, got {max_new_tokens}")
    was_training = model.training
    model.eval()
    try:
        batch, length = input_ids.shape
        state = model.init_state(batch, length + max_new_tokens)
        logits, state = model(input_ids, state)
        tokens = [input_ids]
        finished = torch.zeros(batch, dtype=torch.bool, device=input_ids.device)
        for step in range(max_new_tokens):
            next_token = sample_next(logits[:, -1], temperature, top_k, top_p, generator)
            if eos_token_id is not None:
                next_token = next_token.masked_fill(finished, eos_token_id)
                finished |= next_token == eos_token_id
            tokens.append(next_token[:, None])
            if (eos_token_id is not None and bool(finished.all())) or step == max_new_tokens - 1:
                break
            logits, state = model(next_token[:, None], state)
        return torch.cat(tokens, dim=1)
    finally:
        model.train(was_training)
