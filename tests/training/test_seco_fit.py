"""SeCO through the real path: ``hybridzoo fit --config recipe.yaml`` with the SeCO callback in
``trainer.callbacks``, float64, gradient clipping and accumulation on.

Ground truth: the same run without SeCO (full backprop). The weights after the run, and the
unclipped gradient norm of every optimizer step, must agree to float64 rounding. A recorder proves
SeCO really ran: with it every forward that builds a graph sees one chunk, never the sequence.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import Callback

from hybridzoo.cli import main
from hybridzoo.utils import rel_err
from tests.training.test_cli import QUIET, ROOT, write_corpus, write_recipe

SEQ_LEN, CHUNK, CLIP = 16, 4, 0.05

# tiny-hybrid's three mixer kinds (Gated DeltaNet, Mamba-2, attention), shrunk; the attention is
# full (window null) so that SeCO's K/V store and its prefix gradients are used
MODEL = {
    "config": {
        "d_model": 16, "n_layers": 3, "layers": "gdn mamba2 attn", "d_mlp": 32,
        "gdn": {"num_k_heads": 2, "num_v_heads": 2, "head_k_dim": 8, "head_v_dim": 8, "chunk_size": 4},
        "mamba2": {"d_state": 8, "head_dim": 8, "chunk_size": 4},
        "attn": {"n_heads": 2, "window": None},
    },
    "learning_rate": 1e-2,
    "warmup_steps": 1,
}


class RecordRun(Callback):
    """Writes ``<dirpath>/rank<r>.safetensors`` (final weights) and ``rank<r>.json``: the unclipped
    gradient norm of each optimizer step, the length and grad mode of every model forward during
    training, and the SeCO callback's call count (None without one)."""

    def __init__(self, dirpath: str):
        self.dirpath = dirpath
        self.norms: list[float] = []
        self.forwards: list[tuple[int, bool]] = []

    def on_train_start(self, trainer, pl_module):
        self.initial = pl_module.model.embed.weight.detach().clone()

        def spy(module, args, kwargs):
            ids = kwargs.get("input_ids", args[0] if args else None)
            self.forwards.append((int(ids.shape[1]), torch.is_grad_enabled()))

        pl_module.model.register_forward_pre_hook(spy, with_kwargs=True)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):  # before Lightning clips
        norms = [p.grad.norm() for p in pl_module.parameters() if p.grad is not None]
        self.norms.append(float(torch.linalg.vector_norm(torch.stack(norms))))

    def on_fit_end(self, trainer, pl_module):
        from safetensors.torch import save_file

        from hybridzoo.training.seco import SeCO

        seco = next((c for c in trainer.callbacks if isinstance(c, SeCO)), None)
        rank = trainer.global_rank
        tensors = {n: t.detach().clone() for n, t in pl_module.model.state_dict().items()}
        tensors["_initial_embed"] = self.initial
        save_file(tensors, str(Path(self.dirpath) / f"rank{rank}.safetensors"))
        record = {"norms": self.norms, "forwards": self.forwards, "global_step": trainer.global_step,
                  "seco_calls": None if seco is None else seco.calls,
                  "num_chunks": None if seco is None else seco.last_result.num_chunks}
        (Path(self.dirpath) / f"rank{rank}.json").write_text(json.dumps(record))


def seco_recipe(tmp: Path, name: str, seco: bool, max_steps: int = 2) -> tuple[Path, Path]:
    """A tiny float64 recipe with clipping and accumulation; ``(recipe, record directory)``."""
    out = tmp / name
    out.mkdir()
    callbacks = [{"class_path": "tests.training.test_seco_fit.RecordRun", "init_args": {"dirpath": str(out)}}]
    if seco:
        callbacks.append({"class_path": "hybridzoo.training.seco.SeCO",
                          "init_args": {"chunk_size": CHUNK, "check": True, "progress_every_s": None}})
    corpus = tmp / "corpus.jsonl"
    if not corpus.exists():
        write_corpus(corpus)
    recipe = write_recipe(out, out / "run", corpus, max_steps=max_steps, seq_len=SEQ_LEN, model=MODEL,
                          callbacks=callbacks, precision="64-true", gradient_clip_val=CLIP,
                          accumulate_grad_batches=2, limit_val_batches=0, num_sanity_val_steps=0)
    return recipe, out


def load_run(out: Path, rank: int = 0) -> tuple[dict, dict]:
    from safetensors.torch import load_file

    return load_file(str(out / f"rank{rank}.safetensors")), json.loads((out / f"rank{rank}.json").read_text())


def assert_same_run(seco_out: Path, plain_out: Path, rank: int = 0, batches: int = 4):
    weights, record = load_run(seco_out, rank)
    ref_weights, ref_record = load_run(plain_out, rank)
    # SeCO ran: every graph-building forward saw one chunk (k per batch); none saw the sequence
    k = SEQ_LEN // CHUNK
    assert record["seco_calls"] == batches and record["num_chunks"] == k
    with_grad = [length for length, grad in record["forwards"] if grad]
    assert with_grad == [CHUNK] * (k * batches), record["forwards"]
    assert [length for length, grad in ref_record["forwards"] if grad] == [SEQ_LEN] * batches
    # clipping was active (the unclipped norm is far above the limit) and saw the same gradients
    assert record["global_step"] == ref_record["global_step"] == batches // 2
    assert len(record["norms"]) == batches // 2 and min(ref_record["norms"]) > 10 * CLIP
    for norm, ref in zip(record["norms"], ref_record["norms"]):
        assert abs(norm - ref) <= 1e-10 * ref, (norm, ref)
    assert weights.keys() == ref_weights.keys()
    assert torch.equal(weights["_initial_embed"], ref_weights["_initial_embed"])  # the same start
    assert not torch.equal(weights["_initial_embed"], weights["embed.weight"])  # ... and it trained
    for name, ref in ref_weights.items():
        assert weights[name].dtype == torch.float64
        assert rel_err(weights[name], ref) <= 1e-9, (name, rel_err(weights[name], ref))


def test_fit_with_seco_callback_equals_full_backprop(tmp_path, capsys):
    recipe, seco_out = seco_recipe(tmp_path, "seco", seco=True)
    assert main(["fit", "--config", str(recipe), *QUIET]) == 0, capsys.readouterr().err[-3000:]
    recipe, plain_out = seco_recipe(tmp_path, "plain", seco=False)
    assert main(["fit", "--config", str(recipe), *QUIET]) == 0, capsys.readouterr().err[-3000:]
    assert_same_run(seco_out, plain_out)


def _fit_ddp(recipe: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "hybridzoo.cli", "fit", "--config", str(recipe),
                           "--trainer.strategy", "ddp", "--trainer.accelerator", "cpu", "--trainer.devices", "2",
                           *QUIET], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_fit_with_seco_under_two_process_ddp_equals_full_backprop(tmp_path):
    """2 CPU processes (gloo): SeCO's one gradient sync per batch gives DDP's all-reduced
    gradients; both ranks end equal to the run without SeCO."""
    runs = {}
    for name, seco in (("seco", True), ("plain", False)):
        recipe, runs[name] = seco_recipe(tmp_path, name, seco=seco)
        run = _fit_ddp(recipe)
        assert run.returncode == 0, run.stderr[-3000:]
    for rank in (0, 1):
        assert_same_run(runs["seco"], runs["plain"], rank=rank)
    rank0, _ = load_run(runs["seco"], 0)
    rank1, _ = load_run(runs["seco"], 1)
    for name in rank0:
        assert torch.equal(rank0[name], rank1[name]), name
