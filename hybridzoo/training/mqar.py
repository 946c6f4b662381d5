"""Multi-query associative recall (MQAR), the synthetic recall task of Zoology.

Arora et al. (2023), "Zoology: Measuring and Improving Recall in Efficient Language Models". Each
example first lists ``num_pairs`` key-value pairs, then queries every key once, later in the
sequence; the model must answer each query with the value paired with that key. Following
Zoology's ``multiquery_ar`` generator:

- keys are drawn without replacement from the lower half of the vocabulary ``[1, V//2)``, values
  from the upper half ``[V//2, V)``, so keys and values never share an id;
- the context is ``k0 v0 k1 v1 ...`` (``2 * num_pairs`` tokens); the rest of the sequence has
  ``space = (seq_len - 2 * num_pairs) // 2`` two-token slots, and key ``j`` is placed at slot
  ``gap_j``, i.e. at position ``2 * num_pairs + 2 * gap_j``. The gaps are distinct and drawn with
  probabilities ``p_i ∝ i ** (power_a - 1)`` over ``i = 1 .. space``: small ``power_a`` puts most
  queries close to the context, as repeated bigrams are in real text (``power_a = 1`` is uniform);
- every other position holds a random token of the whole vocabulary (``random_non_queries``,
  Zoology's default) or 0.

Labels follow the Hugging Face convention of ``HybridLM`` (logits at ``t`` predict ``labels[t+1]``):
``labels[q + 1]`` is the value for the query key at position ``q``, and every other label is
-100, so the loss and :func:`mqar_accuracy` see exactly ``num_pairs`` positions per example.
"""

from __future__ import annotations

import torch

IGNORE_INDEX = -100


def check_mqar_args(vocab_size: int, seq_len: int, num_pairs: int) -> None:
    """Raise ``ValueError`` with the reason when these MQAR settings cannot make an example."""
    if num_pairs < 1:
        raise ValueError(f"MQAR: num_pairs must be >= 1, got {num_pairs}")
    if seq_len < 4 * num_pairs:
        raise ValueError(
            f"MQAR: seq_len={seq_len} is too short for num_pairs={num_pairs}: the pairs take "
            f"{2 * num_pairs} tokens and the queries need {num_pairs} distinct two-token slots after "
            f"them, so seq_len must be >= 4 * num_pairs = {4 * num_pairs}"
        )
    num_keys, num_values = vocab_size // 2 - 1, vocab_size - vocab_size // 2
    if min(num_keys, num_values) < num_pairs:
        raise ValueError(
            f"MQAR: vocab_size={vocab_size} is too small for num_pairs={num_pairs}: keys come from "
            f"[1, {vocab_size // 2}) ({num_keys} ids) and values from [{vocab_size // 2}, {vocab_size}) "
            f"({num_values} ids); vocab_size must be >= {2 * num_pairs + 2}"
        )


def _distinct_uniform(n: int, low: int, high: int, k: int, generator: torch.Generator) -> torch.Tensor:
    """``[n, k]`` int64: per row, ``k`` distinct ids drawn uniformly from ``[low, high)``."""
    rows = []
    chunk = max(1, (1 << 22) // (high - low))  # keep the random matrix to ~16 MB
    for start in range(0, n, chunk):
        scores = torch.rand(min(chunk, n - start), high - low, generator=generator)
        rows.append(scores.topk(k, dim=1).indices + low)
    return torch.cat(rows) if rows else torch.empty(0, k, dtype=torch.long)


def multiquery_ar(
    num_examples: int,
    seq_len: int,
    vocab_size: int,
    num_pairs: int,
    seed: int,
    power_a: float = 0.01,
    random_non_queries: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generate MQAR examples (see the module docstring), deterministic in ``seed``.

    Returns ``(input_ids, labels)``, both int64 ``[num_examples, seq_len]``; ``labels`` is -100
    except at the ``num_pairs`` positions that follow a query key, where it is the key's value.
    """
    check_mqar_args(vocab_size, seq_len, num_pairs)
    if power_a <= 0:
        raise ValueError(f"MQAR: power_a must be > 0, got {power_a}")
    g = torch.Generator().manual_seed(seed)
    half = vocab_size // 2
    keys = _distinct_uniform(num_examples, 1, half, num_pairs, g)  # [N, P]
    values = _distinct_uniform(num_examples, half, vocab_size, num_pairs, g)  # [N, P]

    context = 2 * num_pairs
    space = (seq_len - context) // 2
    slot = torch.arange(1, space + 1, dtype=torch.float64)
    weights = (power_a * slot ** (power_a - 1)).expand(num_examples, space)
    gaps = torch.multinomial(weights, num_pairs, replacement=False, generator=g)  # [N, P], distinct
    query_pos = context + 2 * gaps

    if random_non_queries:
        input_ids = torch.randint(vocab_size, (num_examples, seq_len), generator=g)
    else:
        input_ids = torch.zeros(num_examples, seq_len, dtype=torch.long)
    input_ids[:, 0:context:2] = keys
    input_ids[:, 1:context:2] = values
    input_ids.scatter_(1, query_pos, keys)
    labels = torch.full((num_examples, seq_len), IGNORE_INDEX, dtype=torch.long)
    labels.scatter_(1, query_pos + 1, values)
    return input_ids, labels


def mqar_accuracy(logits: torch.Tensor, labels: torch.Tensor) -> tuple[int, int]:
    """``(correct, total)`` over answer positions: ``argmax logits[:, t]`` against ``labels[:, t+1]``.

    ``logits``: ``[B, T, V]`` (any float dtype); ``labels``: int64 ``[B, T]`` in the Hugging Face
    convention of ``HybridLM`` (-100 = not scored). Accuracy is ``correct / total``.
    """
    if logits.dim() != 3 or labels.shape != logits.shape[:2]:
        raise ValueError(
            f"mqar_accuracy: logits must be [B, T, V] and labels [B, T]; got "
            f"{tuple(logits.shape)} and {tuple(labels.shape)}"
        )
    target = labels[:, 1:]
    scored = target != IGNORE_INDEX
    correct = (logits[:, :-1].argmax(-1) == target) & scored
    return int(correct.sum()), int(scored.sum())
