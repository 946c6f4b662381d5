"""lm_eval stays optional: importing hybridzoo (and its CLI, evaluation and scoring modules)
never imports it, and ``hybridzoo eval --tasks`` without it is one clear error line."""

from __future__ import annotations

import subprocess
import sys

from tests.eval.tiny_export import REPO


def test_importing_hybridzoo_does_not_import_lm_eval():
    code = ("import sys, hybridzoo, hybridzoo.cli, hybridzoo.zoo, hybridzoo.zoo.scoring, "
            "hybridzoo.training.evaluate; hybridzoo.HybridLM; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('lm_eval', 'datasets')))")
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]"


def test_eval_tasks_without_lm_eval_is_a_clear_error(tmp_path, monkeypatch, capsys):
    from hybridzoo.cli import main

    for name in ["lm_eval", *(m for m in sys.modules if m.startswith("lm_eval."))]:
        monkeypatch.setitem(sys.modules, name, None)  # importing it now raises ModuleNotFoundError
    monkeypatch.delitem(sys.modules, "hybridzoo.eval_harness", raising=False)
    assert main(["eval", str(tmp_path), "--tasks", "hellaswag"]) == 2
    error = capsys.readouterr().err
    assert "lm-evaluation-harness" in error and "pip install 'hybridzoo[lm-eval]'" in error
