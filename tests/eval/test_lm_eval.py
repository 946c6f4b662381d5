"""The lm-evaluation-harness model ``hybridzoo`` on a tiny export (random weights, byte tokenizer)
and the task YAMLs shipped in tests/eval/tasks (local data, no download), run three ways:
``lm_eval.simple_evaluate``, lm_eval's command line (``python -m hybridzoo.eval_harness``) and
``hybridzoo eval DIR --tasks``. Every loglikelihood is checked against one full forward of
context + continuation in float64, every is_greedy against its argmax, every generation against
greedy decoding by full forwards cut at the task's stop strings."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import pytest
import torch

from hybridzoo import HybridLM
from tests.eval.tiny_export import (REPO, TASKS, full_forward_logprobs, greedy_tokens, reference_loglikelihood,
                                    tiny_export)

lm_eval = pytest.importorskip("lm_eval", reason="the lm-eval extra is not installed")

TOL = 1e-10
GENERATE_UNTIL = ["\n", ".", "h"]  # hybridzoo_tiny_generate.yaml
MAX_GEN_TOKS = 16


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    return tiny_export(tmp_path_factory.mktemp("tiny") / "export")


@pytest.fixture(scope="module")
def reference(export):
    return HybridLM.from_pretrained(export).double()


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """Run from the repository root (the task data paths are relative to it), offline, with the
    datasets cache in tmp_path."""
    monkeypatch.chdir(REPO)
    env = {"OMP_NUM_THREADS": "1", "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_CACHE": str(tmp_path / "datasets"),
           "TOKENIZERS_PARALLELISM": "false"}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return env


def _split(context: str, continuation: str) -> tuple[list[int], list[int]]:
    """Byte ids as lm_eval's TemplateLM splits them: trailing spaces of the context move to the
    continuation; an empty context becomes the end-of-document byte 0."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    return (list(context.encode()) or [0]), list(continuation.encode())


def _expected_generation(model, context: str, until, max_tokens: int) -> str:
    """Greedy bytes by full forwards, stopped at the end-of-document byte 0, decoded, cut before
    the earliest stop string."""
    tokens = greedy_tokens(model, list(context.encode()), max_tokens)
    if 0 in tokens:
        tokens = tokens[:tokens.index(0)]
    text = bytes(tokens).decode("utf-8", errors="replace")
    hits = [text.index(s) for s in until if s in text]
    return text[:min(hits)] if hits else text


def check_samples(samples: dict[str, list[dict]], model) -> None:
    """Each logged request's response against the full-forward reference."""
    assert samples, "no samples were logged"
    cuts = 0
    for task, rows in samples.items():
        assert rows, task
        for row in rows:
            arguments_ = row["arguments"]
            if isinstance(arguments_, dict):  # samples files: {"gen_args_0": {"arg_0": ..., "arg_1": ...}, ...}
                arguments_ = [tuple(a[f"arg_{j}"] for j in range(len(a))) for a in arguments_.values()]
            assert len(arguments_) == len(row["resps"]) > 0
            for arguments, response in zip(arguments_, row["resps"]):
                if task.endswith("_choice"):
                    (context, continuation), (logprob, greedy) = arguments[:2], response[0]
                    if isinstance(greedy, str):  # lm_eval's samples files hold them as strings
                        logprob, greedy = float(logprob), greedy == "True"
                    want, want_greedy = reference_loglikelihood(model, *_split(context, continuation))
                    assert abs(logprob - want) <= TOL * abs(want), (task, context, continuation)
                    assert greedy == want_greedy
                elif task.endswith("_rolling"):
                    document = list(arguments[0].encode())
                    rows_ = full_forward_logprobs(model, [0] + document)
                    want = float(rows_.gather(-1, torch.tensor(document)[:, None]).sum())
                    logprob = float(response[0][0] if isinstance(response[0], (list, tuple)) else response[0])
                    assert abs(logprob - want) <= TOL * abs(want), (task, document)
                else:
                    context = arguments[0]
                    assert response[0] == _expected_generation(model, context, GENERATE_UNTIL, MAX_GEN_TOKS)
                    cuts += response[0] != _expected_generation(model, context, [], MAX_GEN_TOKS)
    assert "hybridzoo_tiny_generate" not in samples or cuts > 0, "no generation was cut by a stop string"


def test_simple_evaluate_matches_full_forwards(export, reference, offline):
    from lm_eval.tasks import TaskManager

    from hybridzoo.eval_harness import register

    register()
    results = lm_eval.simple_evaluate(
        model="hybridzoo", model_args={"pretrained": str(export), "dtype": "float64"}, tasks=["hybridzoo_tiny"],
        batch_size=3, log_samples=True, task_manager=TaskManager(include_path=str(TASKS), include_defaults=False))
    assert set(results["results"]) >= {"hybridzoo_tiny_choice", "hybridzoo_tiny_rolling", "hybridzoo_tiny_generate"}
    assert 0.0 <= results["results"]["hybridzoo_tiny_choice"]["acc,none"] <= 1.0
    assert results["results"]["hybridzoo_tiny_rolling"]["bits_per_byte,none"] > 0
    check_samples(results["samples"], reference)


def test_generate_until_stops_at_stop_strings_and_budget(export, reference):
    from lm_eval.api.instance import Instance

    from hybridzoo.eval_harness import HybridLMEval

    lm = HybridLMEval(pretrained=str(export), dtype="float64", batch_size=2)
    contexts = ["Once upon a time", "def f(x):\n    return", "The capital of France is"]
    greedy = [bytes(greedy_tokens(reference, list(c.encode()), 12)) for c in contexts]
    # a stop string that the model's own greedy output holds: its first ASCII character after
    # byte 2 (an ASCII byte ends any multi-byte character, so the cut text is well defined)
    cut = next(i for i in range(2, 12) if 32 <= greedy[0][i] < 127)
    stops = [[chr(greedy[0][cut]), "\u2603"], ["\u2603"], []]  # the snowman never occurs
    requests = [Instance("generate_until", {}, (c, {"until": u, "max_gen_toks": 12}), i)
                for i, (c, u) in enumerate(zip(contexts, stops))]
    got = lm.generate_until(requests, disable_tqdm=True)
    for context, until, text in zip(contexts, stops, got):
        assert text == _expected_generation(reference, context, until, 12)
    full = _expected_generation(reference, contexts[0], [], 12)
    assert len(got[0]) < len(full) and full.startswith(got[0])  # it was cut
    with pytest.raises(ValueError, match="num_beams"):
        lm.generate_until([Instance("generate_until", {}, ("x", {"num_beams": 2}), 0)])


def _samples_from(path) -> dict[str, list[dict]]:
    samples = {}
    for file in glob.glob(str(path / "**" / "samples_*.jsonl"), recursive=True):
        task = os.path.basename(file)[len("samples_"):].rsplit("_", 1)[0]
        samples[task] = [json.loads(line) for line in open(file, encoding="utf-8")]
    return samples


@pytest.mark.slow
def test_lm_eval_command_line(export, reference, offline, tmp_path):
    out = tmp_path / "out"
    command = [sys.executable, "-m", "hybridzoo.eval_harness", "--model", "hybridzoo",
               "--model_args", f"pretrained={export},dtype=float64", "--tasks", "hybridzoo_tiny_choice",
               "--include_path", str(TASKS), "--batch_size", "4", "--output_path", str(out), "--log_samples"]
    run = subprocess.run(command, cwd=REPO, env={**os.environ, **offline, "PYTHONPATH": str(REPO)},
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "hybridzoo_tiny_choice" in run.stdout
    samples = _samples_from(out)
    assert set(samples) == {"hybridzoo_tiny_choice"}
    check_samples(samples, reference)


def test_hybridzoo_eval_tasks(export, reference, offline, tmp_path, capsys):
    from hybridzoo.cli import main

    output = tmp_path / "results.json"
    code = main(["eval", str(export), "--tasks", "hybridzoo_tiny_generate,hybridzoo_tiny_rolling",
                 "--include-path", str(TASKS), "--dtype", "float64", "--batch-size", "2", "--output", str(output)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "hybridzoo_tiny_generate" in printed and "bits_per_byte" in printed
    results = json.loads(output.read_text())
    check_samples(results["samples"], reference)


def test_hybridzoo_eval_tasks_errors(export, offline, capsys):
    from hybridzoo.cli import main

    assert main(["eval", str(export), "--tasks", "no_such_task_anywhere", "--include-path", str(TASKS)]) == 2
    assert "no_such_task_anywhere" in capsys.readouterr().err
    assert main(["eval", str(export), "--tasks", "hybridzoo_tiny_choice", "--max-batches", "2"]) == 2
    assert "--max-batches" in capsys.readouterr().err
