"""DDP through Lightning's own strategy: 2 CPU processes (gloo) run two steps on different data
and end with identical weights on both ranks."""

import os
import subprocess
import sys
from pathlib import Path

import torch
from lightning.pytorch.callbacks import Callback

from hybridzoo import HybridLM
from tests.training.test_cli import QUIET, ROOT, write_corpus, write_recipe


class SaveRankWeights(Callback):
    """Each rank writes its final weights, initial embedding, first training batch and step count to
    ``<dirpath>/rank<r>.safetensors``."""

    def __init__(self, dirpath: str):
        self.dirpath = dirpath
        self.first_batch = self.initial = None

    def on_train_start(self, trainer, pl_module):
        self.initial = pl_module.model.embed.weight.detach().clone()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.first_batch is None:
            self.first_batch = batch["input_ids"].clone()

    def on_fit_end(self, trainer, pl_module):
        from safetensors.torch import save_file

        tensors = {name: t.detach().clone() for name, t in pl_module.model.state_dict().items()}
        tensors["_first_batch"] = self.first_batch
        tensors["_initial_embed"] = self.initial
        tensors["_global_step"] = torch.tensor(trainer.global_step)
        tensors["_world_size"] = torch.tensor(trainer.world_size)
        save_file(tensors, str(Path(self.dirpath) / f"rank{trainer.global_rank}.safetensors"))


def test_ddp_two_cpu_processes_keep_identical_weights(tmp_path):
    from safetensors.torch import load_file

    corpus = write_corpus(tmp_path / "corpus.jsonl")
    callbacks = [{"class_path": "tests.training.test_ddp.SaveRankWeights",
                  "init_args": {"dirpath": str(tmp_path)}}]
    recipe = write_recipe(tmp_path, tmp_path / "run", corpus, max_steps=2, callbacks=callbacks,
                          precision="32-true", limit_val_batches=0, num_sanity_val_steps=0)
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-m", "hybridzoo.cli", "fit", "--config", str(recipe),
                          "--trainer.strategy", "ddp", "--trainer.accelerator", "cpu", "--trainer.devices", "2",
                          *QUIET], cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr[-3000:]
    ranks = [load_file(str(tmp_path / f"rank{r}.safetensors")) for r in (0, 1)]
    for rank in ranks:
        assert int(rank.pop("_global_step")) == 2 and int(rank.pop("_world_size")) == 2
    first0, first1 = ranks[0].pop("_first_batch"), ranks[1].pop("_first_batch")
    initial0, initial1 = ranks[0].pop("_initial_embed"), ranks[1].pop("_initial_embed")
    assert torch.equal(initial0, initial1)
    assert not torch.equal(first0, first1)  # each rank trains on its own slice of the data
    assert ranks[0].keys() == ranks[1].keys()
    for name in ranks[0]:
        assert torch.equal(ranks[0][name], ranks[1][name]), name
    # rank 0 exported the final weights, which moved away from the initial ones
    exported = HybridLM.from_pretrained(tmp_path / "run" / "export").state_dict()
    for name, tensor in exported.items():
        assert torch.equal(tensor, ranks[0][name]), name
    assert not torch.equal(initial0, ranks[0]["embed.weight"])
