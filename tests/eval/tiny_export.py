"""A tiny byte-level HybridLM export (random weights) for the evaluation tests, and the
ground truth they compare with: log-probabilities from one full forward of the whole text."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from hybridzoo import HybridLM

TASKS = Path(__file__).parent / "tasks"   # the shipped lm-eval task YAMLs and their data
REPO = Path(__file__).parents[2]


def tiny_model(dtype: torch.dtype = torch.float64, seed: int = 0) -> HybridLM:
    """The tiny-hybrid recipe cut to one block of each kind (gdn, mamba2, sliding-window attn
    with a 64-token window), random weights: its logits are peaked enough that greedy choices
    are clear-cut."""
    torch.manual_seed(seed)
    return HybridLM.from_recipe("tiny-hybrid", n_layers=3, init_std=0.3).to(dtype).eval()


def tiny_export(directory: Path, seed: int = 0) -> Path:
    """``tiny_model`` saved as an export directory like ``hybridzoo fit`` writes (float32
    safetensors + config.json + training.json naming the byte-level text data)."""
    model = tiny_model(torch.float32, seed)
    model.save_pretrained(directory)
    data = {"class_path": "hybridzoo.training.data.TextDataModule",
            "init_args": {"paths": None, "tokenizer": None, "seq_len": 64, "batch_size": 2}}
    (Path(directory) / "training.json").write_text(json.dumps({"data": data, "global_step": 0}) + "\n")
    return Path(directory)


@torch.no_grad()
def full_forward_logprobs(model: HybridLM, tokens: list[int]) -> torch.Tensor:
    """float64 ``[len(tokens) - 1, V]``: row t is log p(. | tokens[: t + 1]), from one forward of
    the whole sequence with no state passed in or out."""
    logits, _ = model(torch.tensor([tokens], dtype=torch.long, device=next(model.parameters()).device))
    return logits[0, :-1].double().log_softmax(-1)


def reference_loglikelihood(model: HybridLM, context: list[int], continuation: list[int]) -> tuple[float, bool]:
    """``(sum of log p of the continuation tokens, whether each is the argmax)`` from one full
    forward of ``context + continuation``."""
    rows = full_forward_logprobs(model, context + continuation)[len(context) - 1:]
    target = torch.tensor(continuation)
    return (float(rows.gather(-1, target[:, None]).sum()), bool((rows.argmax(-1) == target).all()))


@torch.no_grad()
def greedy_tokens(model: HybridLM, context: list[int], n: int) -> list[int]:
    """``n`` greedy tokens after ``context``, each from a full forward of everything so far."""
    tokens = list(context)
    for _ in range(n):
        tokens.append(int(full_forward_logprobs(model, tokens + [0])[-1].argmax()))
    return tokens[len(context):]
