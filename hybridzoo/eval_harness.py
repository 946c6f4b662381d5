"""lm-evaluation-harness model ``hybridzoo``: any exported checkpoint directory, with its tokenizer.

    hybridzoo eval DIR --tasks hellaswag,lambada_openai           # runs lm_eval.simple_evaluate
    python -m hybridzoo.eval_harness --model hybridzoo --model_args pretrained=DIR --tasks ...

The second line is lm_eval's own command line (every ``lm_eval`` option works), run after
registering the model: lm-eval 0.4 looks models up only in its own registry and loads no
entry points, so the plain ``lm_eval`` script cannot see a model that another package defines.
From Python, call :func:`register` and then ``lm_eval.simple_evaluate(model="hybridzoo", ...)``,
or pass a :class:`HybridLMEval` instance as ``model``.

How the requests run (see :mod:`hybridzoo.zoo.scoring`): a context is run once, its per-layer
state kept, and every continuation of it scored from that state; long inputs are prefilled in
pieces of ``prefill_chunk`` tokens with the state carried; ``loglikelihood_rolling`` scores each
token once with the whole document before it (no windows); ``generate_until`` decodes from the
carried state. Nothing is truncated. The empty context and the rolling documents start from the
tokenizer's end-of-document id, the token that precedes every document in training.

This module imports ``lm_eval``; ``import hybridzoo`` never imports it.
"""

from __future__ import annotations

import functools
import json
import logging
import sys
from pathlib import Path
from typing import Any

import torch
from lm_eval.api.model import TemplateLM
from tqdm import tqdm

from hybridzoo.zoo.scoring import GenerationRequest, continuation_logprobs, generate_until, rolling_logprobs

MODEL_NAME = "hybridzoo"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "float64": torch.float64}
GENERATION_KEYS = ("until", "max_gen_toks", "do_sample", "temperature", "top_k", "top_p")
DEFAULT_BATCH_SIZE = 16


class HybridLMEval(TemplateLM):
    """A hybridzoo checkpoint as an lm-eval ``LM``.

    Args (``--model_args``; lm_eval adds ``batch_size``, ``max_batch_size`` and ``device``):
        pretrained: an export directory (``model.safetensors`` + ``config.json``, tokenizer
            files if not byte-level): ``HybridLM.from_pretrained`` and its tokenizer.
        device: ``cpu``, ``cuda``, ``cuda:1`` ... (default: CUDA if available; a CUDA device
            on a machine without CUDA falls back to the CPU with a warning, since lm_eval's
            command line asks for ``cuda:0`` by default).
        dtype: ``float32``, ``bfloat16``, ``float16``, ``float64`` or ``auto`` (as saved).
        batch_size: rows per forward (an int; ``auto`` means the default, 16).
        prefill_chunk: tokens per forward when running a long input (state carried).
        max_gen_toks: the default token budget of ``generate_until``.
    """

    def __init__(self, pretrained: str, device: str | None = None, dtype: str | None = "auto",
                 batch_size: int | str | None = DEFAULT_BATCH_SIZE, max_batch_size: int | None = None,
                 prefill_chunk: int | str = 4096, max_gen_toks: int | str = 256):
        super().__init__()
        from hybridzoo.training.evaluate import load_model, tokenizer_for

        if dtype not in (None, "auto") and dtype not in DTYPES:
            raise ValueError(f"hybridzoo: dtype={dtype!r}; give one of {sorted(DTYPES)} or auto")
        self.model = load_model(pretrained, _available(device))
        if dtype not in (None, "auto"):
            self.model = self.model.to(DTYPES[dtype])
        self.tokenizer = tokenizer_for(pretrained, self.model.config)
        self.pretrained = str(pretrained)
        self._device = next(self.model.parameters()).device
        self.batch_size = _batch_size(batch_size, max_batch_size)
        self.prefill_chunk = _positive_int("prefill_chunk", prefill_chunk)
        self.max_gen_toks = _positive_int("max_gen_toks", max_gen_toks)

    # ---- tokenization (TemplateLM) --------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        eos = self.tokenizer.eos_id
        if eos is None:
            raise ValueError(f"hybridzoo: the tokenizer of {self.pretrained} has no end-of-document token; "
                             f"an empty context and loglikelihood_rolling start from it")
        return eos

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return self.tokenizer.encode(string)

    def tok_decode(self, tokens) -> str:
        return self.tokenizer.decode(tokens)

    @property
    def tokenizer_name(self) -> str:
        return f"hybridzoo:{self.pretrained}"

    # ---- the three request types ----------------------------------------------------------
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """``requests``: ``((context, continuation), context_ids, continuation_ids)``."""
        bar = tqdm(total=len(requests), desc="hybridzoo loglikelihood", disable=disable_tqdm)

        def done(i: int, result: tuple[float, bool]) -> None:
            self.cache_hook.add_partial("loglikelihood", requests[i][0], result)
            bar.update(1)

        pairs = [(context, continuation) for _, context, continuation in requests]
        results = continuation_logprobs(self.model, pairs, self.batch_size, self.prefill_chunk, on_result=done)
        bar.close()
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """``requests[i].args == (text,)``: log p(text) from the end-of-document token."""
        texts = [request.args[0] for request in requests]
        documents = [self.tok_encode(text) for text in tqdm(texts, desc="hybridzoo rolling", disable=disable_tqdm)]
        results = rolling_logprobs(self.model, documents, self.eot_token_id, self.batch_size, self.prefill_chunk)
        for text, result in zip(texts, results):
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), result)
        return results

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """``requests[i].args == (context, gen_kwargs)``; gen_kwargs keys: ``until`` (a string or
        a list), ``max_gen_toks``, ``do_sample``, ``temperature``, ``top_k``, ``top_p``."""
        prepared = [self._generation_request(*request.args) for request in requests]
        results = generate_until(self.model, prepared, self.tok_decode, eos_id=self.tokenizer.eos_id,
                                 batch_size=self.batch_size, prefill_chunk=self.prefill_chunk)
        for request, result in zip(requests, results):
            self.cache_hook.add_partial("generate_until", request.args, result)
        return results

    def _generation_request(self, context: str, gen_kwargs: dict[str, Any]) -> GenerationRequest:
        kwargs = dict(gen_kwargs or {})
        unknown = sorted(set(kwargs) - set(GENERATION_KEYS))
        if unknown:
            raise ValueError(f"hybridzoo: generation settings {unknown} are not supported "
                             f"(supported: {', '.join(GENERATION_KEYS)})")
        until = kwargs.get("until") or []
        until = [until] if isinstance(until, str) else list(until)
        temperature = float(kwargs.get("temperature", 0.0) or 0.0)
        if not kwargs.get("do_sample", False):
            temperature = 0.0
        elif temperature == 0.0:
            temperature = 1.0
        ids = self.tok_encode(context) or [self.eot_token_id]
        return GenerationRequest(ids, until=until, max_new_tokens=int(kwargs.get("max_gen_toks", self.max_gen_toks)),
                                 temperature=temperature, top_k=kwargs.get("top_k"), top_p=kwargs.get("top_p"))


def _available(device: str | None) -> str | None:
    """``device``, or None (CUDA if available, else the CPU) for a CUDA device on a machine
    without CUDA: lm_eval's command line passes ``cuda:0`` when ``--device`` is not given."""
    if device is not None and str(device).startswith("cuda") and not torch.cuda.is_available():
        logging.getLogger(__name__).warning("hybridzoo: device %s is not available, running on the CPU", device)
        return None
    return device


def _positive_int(name: str, value) -> int:
    try:
        number = int(value)
    except (TypeError, ValueError):
        number = 0
    if number < 1:
        raise ValueError(f"hybridzoo: {name} must be a positive integer, got {value!r}")
    return number


def _batch_size(batch_size, max_batch_size) -> int:
    """lm_eval gives an int, a digit string or ``auto`` / ``auto:N``; ``auto`` takes the default
    (capped by ``max_batch_size``): the batch size is not searched for."""
    if batch_size is None or str(batch_size).startswith("auto"):
        return min(DEFAULT_BATCH_SIZE, int(max_batch_size or DEFAULT_BATCH_SIZE))
    return _positive_int("batch_size", batch_size)


# ---- registration and the two command lines ---------------------------------------------------
def register() -> None:
    """Register the model name ``hybridzoo`` in lm_eval's model registry (idempotent)."""
    import lm_eval.models  # noqa: F401  lm_eval adds its own models only while its registry is empty
    from lm_eval.api.registry import MODEL_REGISTRY, register_model

    if MODEL_NAME not in MODEL_REGISTRY:
        register_model(MODEL_NAME)(HybridLMEval)


def evaluate_tasks(directory: str | Path, tasks: list[str], include_path: str | None = None,
                   num_fewshot: int | None = None, limit: float | None = None,
                   batch_size: int | None = None, device: str | None = None, dtype: str | None = None,
                   log_samples: bool = False) -> dict[str, Any]:
    """``lm_eval.simple_evaluate`` of the checkpoint in ``directory`` on ``tasks`` (task or group
    names; ``include_path`` adds a folder of task YAML files). Returns lm_eval's results dict."""
    import lm_eval

    register()
    model_args: dict[str, Any] = {"pretrained": str(directory)}
    if dtype is not None:
        model_args["dtype"] = dtype
    return lm_eval.simple_evaluate(
        model=MODEL_NAME, model_args=model_args, tasks=list(tasks), num_fewshot=num_fewshot, limit=limit,
        batch_size=batch_size or DEFAULT_BATCH_SIZE, device=device, log_samples=log_samples,
        task_manager=_task_manager(None if include_path is None else str(include_path)))


@functools.lru_cache(maxsize=4)
def _task_manager(include_path: str | None):
    """lm_eval's task index (its own tasks and ``include_path``'s), built once per process: it
    reads thousands of YAML files."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=include_path)


def tasks_command(args) -> int:
    """``hybridzoo eval DIR --tasks ...`` (argparse namespace from :mod:`hybridzoo.cli`)."""
    from lm_eval.utils import handle_non_serializable, make_table

    from hybridzoo.cli_errors import user_error_exit, user_errors

    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    try:
        if not tasks:
            raise ValueError("--tasks: give one or more task names, separated by commas")
        results = evaluate_tasks(args.directory, tasks, include_path=args.include_path,
                                 num_fewshot=args.num_fewshot, limit=args.limit, batch_size=args.batch_size,
                                 device=args.device, dtype=args.dtype, log_samples=args.output is not None)
    except user_errors(OSError, KeyError) as error:
        return user_error_exit("eval", error)
    if args.output is not None:
        Path(args.output).write_text(json.dumps(results, default=handle_non_serializable, indent=2) + "\n")
    if args.json:
        print(json.dumps({"results": results["results"], "groups": results.get("groups", {})},
                         default=handle_non_serializable))
        return 0
    print(f"hybridzoo eval {args.directory}: lm-evaluation-harness, tasks {', '.join(tasks)}")
    print(make_table(results))
    if results.get("groups"):
        print(make_table(results, "groups"))
    return 0


def main(argv: list[str] | None = None) -> None:
    """lm_eval's command line with the ``hybridzoo`` model registered."""
    from lm_eval.__main__ import cli_evaluate

    register()
    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    cli_evaluate()


if __name__ == "__main__":
    main()
