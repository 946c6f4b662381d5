"""Lightning: tiny-hybrid (small overrides) trained with context parallelism on 2 CPU processes
gives the same per-step losses (float64) as the unsharded single-process run."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from lightning.pytorch.callbacks import Callback

from tests.training.test_cli import QUIET, ROOT, write_corpus, write_recipe


class RecordLosses(Callback):
    """Rank 0 writes the per-step losses (the group's sum under context parallelism) and the
    batches to ``path``; with ``replay`` (a file written by a previous run) each step trains on
    that run's batch instead of its own. Listed before the context-parallel callback, it sees the
    whole batch of the group's first rank (the one the group trains on)."""

    def __init__(self, path: str, replay: str | None = None):
        self.path, self.losses, self.batches = path, [], []
        self.replay = json.loads(Path(replay).read_text())["batches"] if replay else None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        import torch

        if self.replay is not None:
            for key, value in self.replay[batch_idx].items():
                batch[key] = torch.tensor(value, dtype=batch[key].dtype)
        self.batches.append({key: batch[key].tolist() for key in ("input_ids", "labels")})

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        from hybridzoo.parallel.lightning import ContextParallelCallback

        cp = [c for c in trainer.callbacks if isinstance(c, ContextParallelCallback)]
        if not cp:
            self.losses.append(float(outputs["loss"]))

    def on_fit_end(self, trainer, pl_module):
        from hybridzoo.parallel.lightning import ContextParallelCallback

        cp = [c for c in trainer.callbacks if isinstance(c, ContextParallelCallback)]
        if cp:
            self.losses = cp[0].losses
        if trainer.global_rank == 0:
            Path(self.path).write_text(json.dumps({"losses": self.losses, "batches": self.batches}))


def _tiny_hybrid_model() -> dict:
    model = yaml.safe_load((ROOT / "hybridzoo/recipes/tiny-hybrid.yaml").read_text())["model"]
    model["config"].update(d_model=32, n_layers=3)
    model["config"]["attn"]["window"] = 6   # shorter than a rank's 8 tokens: crosses ranks
    return model


def _fit(tmp: Path, name: str, corpus: Path, callbacks: list, devices: int, replay=None) -> dict:
    out = tmp / f"{name}.json"
    callbacks = [{"class_path": "tests.parallel.test_lightning.RecordLosses",
                  "init_args": {"path": str(out), "replay": replay}}] + callbacks
    recipe_dir = tmp / name
    recipe_dir.mkdir()
    recipe = write_recipe(recipe_dir, tmp / f"run-{name}", corpus, max_steps=3, seq_len=16,
                          model=_tiny_hybrid_model(), callbacks=callbacks, precision="64-true",
                          limit_val_batches=0, num_sanity_val_steps=0, use_distributed_sampler=False)
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OMP_NUM_THREADS": "1"}
    strategy = ["--trainer.strategy", "ddp"] if devices > 1 else []
    run = subprocess.run([sys.executable, "-m", "hybridzoo.cli", "fit", "--config", str(recipe),
                          *strategy, "--trainer.devices", str(devices), "--seed_everything", "7", *QUIET],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.slow
def test_lightning_context_parallel_with_and_without_seco_same_loss(tmp_path):
    """On 2 CPU processes, context parallelism alone and together with SeCO (each rank's 8 tokens
    in 2 chunks of 4) give the per-step losses of the plain single-process run on the same
    batches: the gradients, hence the trained weights, are the same."""
    corpus = write_corpus(tmp_path / "corpus.jsonl")
    cp = {"class_path": "hybridzoo.parallel.lightning.ContextParallelCallback", "init_args": {"size": 2}}
    seco = {"class_path": "hybridzoo.training.seco.SeCO", "init_args": {"chunk_size": 4, "progress_every_s": None}}
    sharded = {"cp": _fit(tmp_path, "cp", corpus, [cp], 2),
               "cp+seco": _fit(tmp_path, "cp-seco", corpus, [cp, seco], 2)}
    plain = _fit(tmp_path, "plain", corpus, [], 1, replay=str(tmp_path / "cp.json"))
    assert len(plain["losses"]) == 3 and plain["losses"][0] != plain["losses"][-1]  # it trained
    for name, run in sharded.items():
        assert run["batches"] == plain["batches"], name
        assert len(run["losses"]) == 3
        for a, b in zip(plain["losses"], run["losses"]):
            assert abs(a - b) < 1e-10 * abs(a), (name, plain["losses"], run["losses"])
