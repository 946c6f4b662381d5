"""Resuming: N steps in one run == N/2 steps, then a resume from the Lightning checkpoint for the
rest (same data order, same optimizer and schedule state); and a run killed after its first
checkpoint resumes with ``--ckpt_path last`` and finishes. float32 on CPU, within 1e-6."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import Callback

from hybridzoo.cli import main
from tests.training.test_cli import QUIET, ROOT, write_corpus, write_recipe

N, HALF = 6, 3
KILL_CODE = 17


class StopAt(Callback):
    """Ends fit gracefully once ``step`` optimizer steps are done (after that step's checkpoint)."""

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step >= self.step:
            trainer.should_stop = True


class KillAt(Callback):
    """Kills the process (no cleanup, like SIGKILL) when step ``step + 1`` is about to start, i.e.
    after step ``step`` and its checkpoint were written."""

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step >= self.step:
            os._exit(KILL_CODE)


def _recipe(tmp: Path, root: Path, extra_callbacks=()) -> Path:
    # 6 short training documents of ~150 bytes, rows of 64 bytes, batches of 4: an epoch is 4
    # batches, so the N = 6 steps cross an epoch boundary and HALF = 3 is mid-epoch.
    corpus = write_corpus(tmp / "corpus.jsonl", n_docs=8)
    callbacks = [{"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                  "init_args": {"save_last": True, "every_n_train_steps": 1}}, *extra_callbacks]
    return write_recipe(tmp, root, corpus, max_steps=N, seq_len=64, callbacks=callbacks,
                        precision="32-true", limit_val_batches=0, num_sanity_val_steps=0)


def _last_checkpoint(root: Path) -> dict:
    newest = max(root.rglob("last.ckpt"), key=lambda p: p.stat().st_mtime_ns)
    return torch.load(newest, map_location="cpu", weights_only=True)


def _assert_same_weights(a: dict, b: dict):
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == torch.float32
        assert (a[name] - b[name]).abs().max().item() <= 1e-6, name


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The final weights of the uninterrupted N-step run."""
    tmp = tmp_path_factory.mktemp("reference")
    assert main(["fit", "--config", str(_recipe(tmp, tmp / "run")), *QUIET]) == 0
    ckpt = _last_checkpoint(tmp / "run")
    assert ckpt["global_step"] == N
    return ckpt["state_dict"]


def test_half_then_resume_equals_one_run(reference, tmp_path):
    recipe = _recipe(tmp_path, tmp_path / "run",
                     [{"class_path": "tests.training.test_resume.StopAt", "init_args": {"step": HALF}}])
    assert main(["fit", "--config", str(recipe), *QUIET]) == 0
    first = _last_checkpoint(tmp_path / "run")
    assert first["global_step"] == HALF
    half_path = next((tmp_path / "run").rglob("last.ckpt"))
    moved = max((first["state_dict"][k] - reference[k]).abs().max().item() for k in reference)
    assert moved > 1e-4  # the second half of the run still changes the weights

    resume = _recipe(tmp_path, tmp_path / "run")  # the same run without the stop
    assert main(["fit", "--config", str(resume), "--ckpt_path", str(half_path), *QUIET]) == 0
    final = _last_checkpoint(tmp_path / "run")
    assert final["global_step"] == N
    _assert_same_weights(final["state_dict"], reference)
    # the optimizer and schedule went on too: the learning rate is the one of step N
    assert final["lr_schedulers"][0]["last_epoch"] == N


def test_killed_run_resumes_with_ckpt_path_last(reference, tmp_path):
    killed = _recipe(tmp_path, tmp_path / "run",
                     [{"class_path": "tests.training.test_resume.KillAt", "init_args": {"step": HALF}}])
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    run = subprocess.run([sys.executable, "-m", "hybridzoo.cli", "fit", "--config", str(killed), *QUIET],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == KILL_CODE, run.stderr[-2000:]
    assert _last_checkpoint(tmp_path / "run")["global_step"] == HALF

    resume = _recipe(tmp_path, tmp_path / "run")
    assert main(["fit", "--config", str(resume), "--ckpt_path", "last", *QUIET]) == 0
    final = _last_checkpoint(tmp_path / "run")
    assert final["global_step"] == N
    _assert_same_weights(final["state_dict"], reference)
