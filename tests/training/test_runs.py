"""A run's life on the command line: a new run never overwrites another run's export or
checkpoints unless asked; a resumed run reports this invocation's steps and the whole held-out
history; progress goes out as plain lines when the output is not a terminal."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from hybridzoo.cli import main
from tests.training.test_cli import snapshot, write_corpus, write_recipe

NO_SUMMARY = ["--trainer.enable_model_summary", "false"]
# one attention layer: the cheapest model on a CPU (these tests are about the run, not the model)
ATTN = {"config": {"d_model": 16, "n_layers": 1, "layers": "attn", "d_mlp": 32, "attn": {"n_heads": 2, "window": 8}},
        "learning_rate": 1e-2, "warmup_steps": 2}


def _run(args, capsys):
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def _history(root: Path) -> list[int]:
    return [h["step"] for h in json.loads((root / "export" / "training.json").read_text())["val_history"]]


def test_a_new_run_refuses_an_existing_one_resume_continues_and_overwrite_starts_over(tmp_path, capsys):
    # 2 steps, a validation at steps 0 (the sanity check) and 2, a checkpoint and export at step 2
    root = tmp_path / "run"
    recipe = write_recipe(tmp_path, root, write_corpus(tmp_path / "c.jsonl", n_docs=12), max_steps=2, model=ATTN,
                          val_check_interval=2, limit_val_batches=2)
    code, out, err = _run(["fit", "--config", recipe, "--progress.every_n_steps", "1"], capsys)
    assert code == 0, err
    # stdout is not a terminal here: plain progress lines, and no v_num nor FLOPs anywhere
    lines = out.splitlines()
    assert "step 0/2  held-out loss" in out
    step_lines = [line for line in lines if line.startswith(("step 1/2 (", "step 2/2 ("))]
    assert len(step_lines) == 2 and all(" loss " in line and "tok/s " in line and "ETA " in line
                                        for line in step_lines)
    assert "Total params" in out and "FLOPs" not in out and "v_num" not in out + err
    assert _history(root) == [0, 2]
    # hybridzoo eval given the weights file evaluates its folder (the same held-out split)
    results = []
    for target in (root / "export", root / "export" / "model.safetensors"):
        code, out, err = _run(["eval", target, "--json", "--max-batches", "1"], capsys)
        assert code == 0, err
        results.append({k: v for k, v in json.loads(out).items() if k != "tokens_per_s"})
    assert results[0] == results[1] and results[0]["checkpoint"] == str(root / "export")

    # the same command again: refused in one line, nothing written
    before = snapshot(root)
    code, out, err = _run(["fit", "--config", recipe], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert f"{root} already holds a run" in err and "an export" in err
    assert "--overwrite true" in err and "--trainer.default_root_dir DIR" in err and "--ckpt_path last" in err
    assert snapshot(root) == before and sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["run", "c.jsonl", "recipe.yaml"])

    # resume to step 4: this invocation's 2 steps, the total, the history from before the restart
    code, out, err = _run(["fit", "--config", recipe, "--ckpt_path", "last", "--trainer.max_steps", "4",
                           *NO_SUMMARY], capsys)
    assert code == 0, err
    assert "hybridzoo fit: 2 steps in " in out and "resumed at step 2: 4 steps in total" in out
    assert "held-out loss:" in out and "(step 0) ->" in out and "(step 4), 3 validations" in out
    assert _history(root) == [0, 2, 4]
    assert json.loads((root / "export" / "training.json").read_text())["global_step"] == 4
    # resuming the finished run: no step, said so, and the export keeps its whole history
    code, out, err = _run(["fit", "--config", recipe, "--ckpt_path", "last", "--trainer.max_steps", "4",
                           *NO_SUMMARY], capsys)
    assert code == 0, err
    assert "hybridzoo fit: 0 steps in " in out and "max_steps 4 was already reached" in out
    assert _history(root) == [0, 2, 4]

    # asked for: a new run over the old one
    code, out, err = _run(["fit", "--config", recipe, "--overwrite", "true", *NO_SUMMARY], capsys)
    assert code == 0, err
    assert "hybridzoo fit: 2 steps in " in out and "resumed" not in out
    assert json.loads((root / "export" / "training.json").read_text())["global_step"] == 2
    assert _history(root) == [0, 2]


def test_checkpoints_alone_are_a_run_too(tmp_path, capsys):
    root = tmp_path / "run"
    (root / "lightning_logs" / "version_0" / "checkpoints").mkdir(parents=True)
    (root / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt").write_bytes(b"a checkpoint")
    recipe = write_recipe(tmp_path, root, write_corpus(tmp_path / "c.jsonl"), max_steps=1, model=ATTN)
    before = snapshot(root)
    code, _, err = _run(["fit", "--config", recipe, *NO_SUMMARY], capsys)
    assert code == 2 and "already holds a run (1 checkpoint)" in err
    assert snapshot(root) == before
    # an export folder that holds other files is refused up front, even with --overwrite true
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.md").write_text("my notes")
    code, _, err = _run(["fit", "--config", recipe, "--overwrite", "true", "--export.dirpath", tmp_path / "mine",
                         *NO_SUMMARY], capsys)
    assert code == 2 and "not an export" in err and "--export.dirpath" in err
    assert snapshot(root) == before and (tmp_path / "mine" / "notes.md").read_text() == "my notes"


def test_an_export_dir_holding_other_files_is_refused(tmp_path):
    from hybridzoo.training.callbacks import check_export_dir

    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.md").write_text("my notes")
    with pytest.raises(ValueError, match=r"mine holds \['notes.md'\], not an export.*--export.dirpath"):
        check_export_dir(tmp_path / "mine")
    check_export_dir(tmp_path / "new")  # absent, empty or an export: fine
    (tmp_path / "export").mkdir()
    check_export_dir(tmp_path / "export")
    (tmp_path / "export" / "config.json").write_text("{}")
    check_export_dir(tmp_path / "export")


# ---- the lines themselves -------------------------------------------------------------------------
def test_fit_summary_says_when_no_validation_ran_and_counts_this_invocation():
    from hybridzoo.training.progress import fit_summary

    assert fit_summary(0, 100, 12.3, []) == ["hybridzoo fit: 100 steps in 12 s", "held-out loss: no validation ran"]
    assert fit_summary(0, 100, 12.3, [(0, 5.50531)])[1] == (
        "held-out loss: 5.5053 (step 0); no validation ran after step 0")
    assert fit_summary(40, 200, 686.0, [(0, 5.5), (100, 3.0), (200, 2.0)], max_steps=200) == [
        "hybridzoo fit: 160 steps in 686 s, resumed at step 40: 200 steps in total",
        "held-out loss: 5.5000 (step 0) -> 2.0000 (step 200), 3 validations"]
    first = fit_summary(200, 200, 1.0, [(0, 5.5), (200, 2.0)], max_steps=200)[0]
    assert first.startswith("hybridzoo fit: 0 steps in 1 s, resumed at step 200") and "max_steps 200" in first


def test_the_bar_shows_no_v_num(tmp_path):
    from lightning.pytorch.callbacks import RichProgressBar
    from lightning.pytorch.loggers import CSVLogger

    from hybridzoo.training.progress import StepProgressBar

    trainer = SimpleNamespace(loggers=[CSVLogger(tmp_path)], progress_bar_metrics={"tok/s": 1.0})
    assert "v_num" in RichProgressBar().get_metrics(trainer, None)  # Lightning's own shows it
    assert StepProgressBar().get_metrics(trainer, None) == {"tok/s": 1.0}


def test_log_lines_every_n_steps_with_loss_rate_and_eta(monkeypatch):
    import io

    import torch

    from hybridzoo.training import progress
    from hybridzoo.training.progress import LogLines, log_interval

    assert [log_interval(n) for n in (5, 100, 300, 10_000, float("inf"))] == [1, 10, 30, 50, 50]
    out = io.StringIO()
    lines = LogLines(every_n_steps=2, stream=out)
    meter = SimpleNamespace(smoothed_rate=lambda: 12345.6)
    trainer = SimpleNamespace(global_step=10, max_steps=16, callbacks=[meter])
    clock = iter([100.0, 110.0, 120.0])  # read at the start and at each line
    monkeypatch.setattr(progress.time, "perf_counter", lambda: next(clock))
    lines.on_train_start(trainer, None)  # resumed at step 10, t = 100
    for step in (11, 12, 13):
        trainer.global_step = step
        lines.on_train_batch_end(trainer, None, {"loss": torch.tensor(2.5 + step)}, None, 0)
    trainer.global_step = 16
    lines.on_train_batch_end(trainer, None, torch.tensor(1.0), None, 0)  # the last step is always logged
    # step 12: 2 steps in 10 s -> 4 steps left take 20 s; step 16: 6 steps in 20 s, none left
    assert out.getvalue().splitlines() == [
        "step 12/16 (75%)  loss 14.5000  tok/s 12,346  elapsed 10s  ETA 20s",
        "step 16/16 (100%)  loss 1.0000  tok/s 12,346  elapsed 20s  ETA 0s"]
    lines.on_validation_end(trainer, SimpleNamespace(val_history=[(16, 0.75)]))
    assert out.getvalue().splitlines()[-1] == "step 16/16  held-out loss 0.7500"
