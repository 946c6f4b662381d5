"""``hybridzoo eval`` and ``hybridzoo generate`` on an exported checkpoint directory.

A directory written by :class:`~hybridzoo.training.callbacks.ExportCallback` holds
``model.safetensors`` + ``config.json`` (``HybridLM.from_pretrained``), the tokenizer files if
any, and ``training.json``: the data module class and arguments of the run, so that ``eval``
rebuilds the same held-out split (or evaluates ``--data`` files with the same tokenizer).
"""

from __future__ import annotations

import importlib
import json
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch

from hybridzoo.cli_errors import user_error_exit, user_errors
from hybridzoo.training.callbacks import TRAINING_NAME
from hybridzoo.training.tokenizers import has_tokenizer
from hybridzoo.zoo.checkpoint import checkpoint_dir

TEXT_DATA = "hybridzoo.training.data.TextDataModule"


def resolve_device(device: str | None) -> torch.device:
    """The device of ``--device`` (default: CUDA if available, else the CPU); ``ValueError`` with
    the fix for a name torch does not know or a device this machine does not have."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError as error:
        raise ValueError(f"--device {device!r} is not a device name ({error}); use cpu or cuda") from None
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device {device}: CUDA is not available on this machine "
                             f"(torch.cuda.is_available() is False); use --device cpu, or leave --device out")
        if resolved.index is not None and resolved.index >= torch.cuda.device_count():
            raise ValueError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s), "
                             f"numbered from 0")
    elif resolved.type not in ("cpu", "meta"):
        backend = getattr(torch, resolved.type, None)
        if backend is not None and hasattr(backend, "is_available") and not backend.is_available():
            raise ValueError(f"--device {device}: {resolved.type} is not available on this machine; use --device cpu")
    return resolved


def check_finite(model, directory: str | Path) -> None:
    """``ValueError`` naming the first tensor of ``model`` that holds NaN or infinite values (a
    diverged run): such a model gives NaN logits, which cannot be sampled from or evaluated."""
    from hybridzoo.zoo.checkpoint import WEIGHTS_NAME

    for name, tensor in (*model.named_parameters(), *model.named_buffers()):
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            nan, inf = int(torch.isnan(tensor).sum()), int(torch.isinf(tensor).sum())
            raise ValueError(f"{Path(directory) / WEIGHTS_NAME}: tensor {name!r} holds {nan} NaN and {inf} "
                             f"infinite values (of {tensor.numel()}): the model is unusable (a diverged "
                             f"run? use an earlier checkpoint)")


def load_model(directory: str | Path, device: str | None = None):
    """``HybridLM.from_pretrained(directory)`` on ``device`` (default: CUDA if available).

    ``ValueError`` (one line, with the fix) for a device this machine does not have, and for a
    checkpoint holding NaN or infinite weights (:func:`check_finite`)."""
    from hybridzoo.zoo import HybridLM

    model = HybridLM.from_pretrained(directory, device=resolve_device(device))
    check_finite(model, directory)
    return model


def training_info(directory: str | Path) -> dict[str, Any]:
    """The export's ``training.json`` (``{}`` when absent, e.g. a converted checkpoint)."""
    path = Path(directory) / TRAINING_NAME
    if not path.is_file():
        return {}
    try:
        info = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, RecursionError) as error:  # bad JSON or UTF-8, deep nesting
        raise ValueError(f"{path} is not valid JSON: {error}") from error
    if not isinstance(info, dict) or not isinstance(info.get("data") or {}, dict):
        raise ValueError(f'{path}: expected an object whose "data" is an object, got {str(info)[:80]}')
    return info


def data_module_for(directory: str | Path, config, data: list[str] | None = None,
                    batch_size: int | None = None):
    """The data module to evaluate a checkpoint with: the run's own (``training.json``), its
    ``paths`` replaced by ``data`` if given, its tokenizer read from the export directory."""
    info = training_info(directory)
    spec = info.get("data") or {}
    class_path = spec.get("class_path") or TEXT_DATA
    init_args = dict(spec.get("init_args") or {})
    is_text = class_path.rsplit(".", 1)[-1] == "TextDataModule"
    if not spec and not data and config.vocab_size != 256:
        raise ValueError(f"{directory} has no {TRAINING_NAME} (not written by hybridzoo fit) and the "
                         f"model is not byte-level (vocab_size {config.vocab_size}): pass --data")
    if data:
        if not is_text:
            raise ValueError(f"--data: the checkpoint was trained with {class_path}, which reads no files")
        init_args["paths"] = list(data)
    if is_text and has_tokenizer(directory):
        init_args["tokenizer"] = str(directory)
    if batch_size is not None:
        init_args["batch_size"] = batch_size
    module_name, _, class_name = class_path.rpartition(".")
    cls = getattr(importlib.import_module(module_name), class_name)
    return cls(**init_args)


@torch.no_grad()
def evaluate(directory: str | Path, data: list[str] | None = None, max_batches: int | None = None,
             batch_size: int | None = None, device: str | None = None) -> dict[str, Any]:
    """Held-out metrics of the checkpoint in ``directory``.

    Returns a dict: ``loss`` (mean cross-entropy per predicted token, nats), ``perplexity``,
    ``bits_per_byte`` (text data whose bytes per token are known, else absent), ``accuracy``
    (next-token argmax accuracy over the labelled positions; for MQAR data this is the MQAR
    recall accuracy, also given as ``mqar_accuracy``), ``tokens`` (predicted tokens),
    ``batches``, ``tokens_per_s`` (input tokens through the forward pass per second),
    ``data`` (the data module class) and ``checkpoint``.
    """
    from hybridzoo.training.module import bytes_per_token_of, validation_metrics, validation_sums

    directory = checkpoint_dir(directory)  # the folder, also when given its model.safetensors / config.json
    model = load_model(directory, device)
    datamodule = data_module_for(directory, model.config, data, batch_size)
    if getattr(datamodule, "vocab_size", None) not in (None, model.config.vocab_size):
        raise ValueError(f"the data has vocab_size {datamodule.vocab_size}, the checkpoint "
                         f"{model.config.vocab_size}")
    datamodule.setup("validate")
    device = next(model.parameters()).device
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext())
    sums = torch.zeros(3, dtype=torch.float64, device=device)  # summed validation_sums
    inputs = batches = 0
    elapsed = 0.0
    for batch in datamodule.val_dataloader():
        if max_batches is not None and batches >= max_batches:
            break
        input_ids, labels = batch["input_ids"].to(device), batch["labels"].to(device)
        start = time.perf_counter()
        with autocast:
            logits, _, loss = model(input_ids, labels=labels)
        if device.type == "cuda":
            torch.cuda.synchronize()
        elapsed += time.perf_counter() - start
        sums += validation_sums(logits, labels, loss)
        inputs += input_ids.numel()
        batches += 1
    tokens = int(sums[1])
    if tokens == 0:
        raise ValueError(f"{type(datamodule).__name__}: the held-out split gave no tokens to evaluate")
    result: dict[str, Any] = {"checkpoint": str(directory), "data": type(datamodule).__name__,
                              **validation_metrics(sums, bytes_per_token_of(datamodule))}
    if type(datamodule).__name__ == "MQARDataModule":
        result["mqar_accuracy"] = result["accuracy"]
    result.update(tokens=tokens, batches=batches, tokens_per_s=inputs / elapsed if elapsed else None)
    return result


def tokenizer_for(directory: str | Path, config):
    """The export's tokenizer: its Hugging Face tokenizer files if any, else bytes."""
    from hybridzoo.training.tokenizers import find_tokenizer

    info = training_info(directory)
    class_path = (info.get("data") or {}).get("class_path", "")
    if class_path.endswith("MQARDataModule"):
        raise ValueError(f"{directory} was trained on MQAR (synthetic token ids, no text): "
                         f"use hybridzoo eval for it, generate needs a text model")
    tokenizer = find_tokenizer(directory)
    if tokenizer.vocab_size > config.vocab_size:
        raise ValueError(f"{directory}: the tokenizer has {tokenizer.vocab_size} ids but the model only "
                         f"{config.vocab_size} (a model without its tokenizer files?)")
    return tokenizer


def generate_text(directory: str | Path, prompt: str, max_new_tokens: int = 200, temperature: float = 0.8,
                  top_k: int | None = None, top_p: float | None = None, seed: int = 0,
                  device: str | None = None) -> dict[str, Any]:
    """Continue ``prompt`` with the checkpoint in ``directory``.

    Returns ``{"prompt", "completion", "new_tokens", "tokens_per_s"}`` (tokens/s of the whole
    generate call: prefill and decoding).
    """
    directory = checkpoint_dir(directory)
    model = load_model(directory, device)
    tokenizer = tokenizer_for(directory, model.config)
    ids = tokenizer.encode(prompt)
    if not ids:
        raise ValueError("--prompt must not be empty")
    device = next(model.parameters()).device
    input_ids = torch.tensor([ids], dtype=torch.long, device=device)
    generator = torch.Generator(device=device).manual_seed(seed)
    start = time.perf_counter()
    out = model.generate(input_ids, max_new_tokens=max_new_tokens, temperature=temperature,
                         top_k=top_k, top_p=top_p, generator=generator)
    elapsed = time.perf_counter() - start
    new = out[0, len(ids):].tolist()
    return {"prompt": prompt, "completion": tokenizer.decode(new), "new_tokens": len(new),
            "tokens_per_s": len(new) / elapsed if elapsed else None}


# ---- the two commands (argparse namespaces from hybridzoo.cli) -------------------------------
def eval_command(args) -> int:
    try:
        result = evaluate(args.directory, data=args.data, max_batches=args.max_batches,
                          batch_size=args.batch_size, device=args.device)
    except user_errors(OSError) as error:
        return user_error_exit("eval", error)
    if args.json:
        print(json.dumps(result))
        return 0
    from rich.console import Console
    from rich.table import Table

    console = Console()
    source = ", ".join(args.data) if args.data else "held-out split"
    console.print(f"hybridzoo eval {args.directory}: {result['data']} ({source}), "
                  f"{result['tokens']:,} predicted tokens")
    table = Table()
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key in ("loss", "perplexity", "bits_per_byte", "accuracy", "mqar_accuracy", "tokens_per_s"):
        if result.get(key) is not None:
            table.add_row(key, f"{result[key]:,.1f}" if key == "tokens_per_s" else f"{result[key]:.4f}")
    console.print(table)
    return 0


def generate_command(args) -> int:
    try:
        result = generate_text(args.directory, args.prompt, max_new_tokens=args.max_new_tokens,
                               temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                               seed=args.seed, device=args.device)
    except user_errors(OSError) as error:
        return user_error_exit("generate", error)
    if args.json:
        print(json.dumps(result))
    else:
        print(result["prompt"] + result["completion"])
        print(f"\n[{result['new_tokens']} tokens, {result['tokens_per_s']:.1f} tokens/s]", file=sys.stderr)
    return 0
