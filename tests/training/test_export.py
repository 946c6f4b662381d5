"""What ``hybridzoo fit`` leaves behind and shows: the safetensors export at every checkpoint (with
the tokenizer's files, loadable), ``train/tokens_per_s`` in the logged metrics, an interrupted
export that leaves the previous one intact, and the Rich progress bar."""

from __future__ import annotations

import csv
import io
import json
import math
import os
import stat
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch.callbacks import Callback

from hybridzoo import HybridLM
from hybridzoo.cli import main
from hybridzoo.training.callbacks import ExportCallback
from tests.training.test_cli import QUIET, ROOT, TINY_MODEL, write_corpus, write_recipe
from tests.zoo.tiny import tiny_config

MAX_STEPS, SEQ_LEN, BATCH = 3, 16, 4


def word_tokenizer(directory: Path, corpus: Path) -> Path:
    """A local Hugging Face tokenizer (word level, trained on ``corpus``) in ``directory``."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    texts = [json.loads(line)["text"] for line in corpus.read_text().splitlines()]
    tokenizer = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator(texts, trainers.WordLevelTrainer(special_tokens=["[UNK]", "</s>"]))
    directory.mkdir()
    tokenizer.save(str(directory / "tokenizer.json"))
    return directory


class ExportSpy(Callback):
    """At the start of each step after the first, reads the export that the previous step's
    checkpoint wrote: its step (training.json) and whether its weights are the module's now."""

    def __init__(self, dirpath: str):
        self.dirpath = Path(dirpath)
        self.seen: list[tuple[int, int, bool]] = []  # (trainer step, exported step, same weights)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == 0:
            return
        if not (self.dirpath / "training.json").is_file():
            self.seen.append((trainer.global_step, None, False))  # no export
        else:
            info = json.loads((self.dirpath / "training.json").read_text())
            exported = HybridLM.from_pretrained(self.dirpath).state_dict()
            same = all(torch.equal(t, exported[n]) for n, t in pl_module.model.state_dict().items())
            self.seen.append((trainer.global_step, info["global_step"], same))
        (self.dirpath.parent / "spy.json").write_text(json.dumps(self.seen))


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    """3 steps with a local word-level tokenizer, a checkpoint (and so an export) after every
    step, a CSV logger."""
    tmp = tmp_path_factory.mktemp("export")
    corpus = write_corpus(tmp / "corpus.jsonl")
    tokenizer = word_tokenizer(tmp / "tokenizer", corpus)
    root = tmp / "run"
    callbacks = [
        {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
         "init_args": {"every_n_train_steps": 1, "save_top_k": -1}},
        {"class_path": "tests.training.test_export.ExportSpy", "init_args": {"dirpath": str(root / "export")}},
    ]
    recipe = write_recipe(tmp, root, corpus, max_steps=MAX_STEPS, seq_len=SEQ_LEN, callbacks=callbacks,
                          limit_val_batches=0, num_sanity_val_steps=0,
                          logger={"class_path": "lightning.pytorch.loggers.CSVLogger",
                                  "init_args": {"save_dir": str(root), "name": "csv"}})
    started = time.perf_counter()
    code = main(["fit", "--config", str(recipe), "--data.init_args.tokenizer", str(tokenizer), *QUIET])
    seconds = time.perf_counter() - started
    assert code == 0
    return SimpleNamespace(root=root, tokenizer=tokenizer, export=root / "export", seconds=seconds)


def _check_export_at_every_checkpoint(fitted):
    seen = json.loads((fitted.root / "spy.json").read_text())
    assert seen == [[step, step, True] for step in range(1, MAX_STEPS)]
    info = json.loads((fitted.export / "training.json").read_text())
    assert info["global_step"] == MAX_STEPS
    checkpoints = sorted(fitted.root.rglob("*.ckpt"))
    assert len(checkpoints) == MAX_STEPS  # one per step, and one export each


def _check_export_holds_the_tokenizer_and_loads(fitted):
    from hybridzoo.training.tokenizers import load_tokenizer

    copied = fitted.export / "tokenizer.json"
    assert copied.read_bytes() == (fitted.tokenizer / "tokenizer.json").read_bytes()
    tokenizer = load_tokenizer(str(fitted.export))  # the export alone is enough to tokenize
    assert tokenizer.files() == [copied]
    model = HybridLM.from_pretrained(fitted.export)
    assert model.config.vocab_size == tokenizer.vocab_size < 256
    ids = torch.tensor([tokenizer.encode("def f3(x): return x")])
    assert model(ids)[0].shape == (1, ids.shape[1], tokenizer.vocab_size)


def _check_tokens_per_second_is_in_the_logged_metrics(fitted):
    (metrics,) = fitted.root.rglob("metrics.csv")
    rows = list(csv.DictReader(metrics.open()))
    rates = [float(row["train/tokens_per_s"]) for row in rows if row.get("train/tokens_per_s")]
    assert len(rates) == MAX_STEPS and all(math.isfinite(r) for r in rates)
    # each step took less than the whole fit: its rate is above one batch's tokens over the fit's time
    assert min(rates) > BATCH * SEQ_LEN / fitted.seconds
    steps = [int(row["step"]) for row in rows if row.get("train/tokens_per_s")]
    assert steps == list(range(MAX_STEPS))


def test_fit_exports_at_every_checkpoint_with_the_tokenizer_and_logs_tokens_per_second(fitted):
    """One test for the one fit (a module-scoped fixture runs inside the first test that asks for
    it, so one test keeps every check attributed to the run that made it)."""
    _check_export_at_every_checkpoint(fitted)
    _check_export_holds_the_tokenizer_and_loads(fitted)
    _check_tokens_per_second_is_in_the_logged_metrics(fitted)
    info = json.loads((fitted.export / "training.json").read_text())
    assert info["data"]["class_path"] == "hybridzoo.training.data.TextDataModule"  # the recipe's section
    assert info["data"]["init_args"]["tokenizer"] == str(fitted.tokenizer)


# ---- interrupted writes ------------------------------------------------------------------------
def _fake_run(tmp_path: Path, model: HybridLM, step: int):
    trainer = SimpleNamespace(is_global_zero=True, sanity_checking=False, default_root_dir=str(tmp_path),
                              datamodule=None, global_step=step)
    return trainer, SimpleNamespace(model=model, val_history=[(step, 1.0)])


def test_an_interrupted_export_leaves_the_previous_one_intact(tmp_path, monkeypatch):
    torch.manual_seed(0)
    old, new = HybridLM(tiny_config("gdn attn")), HybridLM(tiny_config("gdn attn"))
    export = ExportCallback()
    assert export.export(*_fake_run(tmp_path, old, 1)) == tmp_path / "export"
    before = {p.name: p.read_bytes() for p in (tmp_path / "export").iterdir()}
    assert set(before) == {"model.safetensors", "config.json", "training.json"}

    def fail(self, target):
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(Path, "replace", fail)
    monkeypatch.setattr(Path, "rename", fail)
    with pytest.raises(OSError, match="simulated"):
        ExportCallback().export(*_fake_run(tmp_path, new, 2))
    monkeypatch.undo()
    after = {p.name: p.read_bytes() for p in (tmp_path / "export").iterdir()}
    assert after == before  # the old export, byte for byte, and no temporary file left behind
    loaded = HybridLM.from_pretrained(tmp_path / "export").state_dict()
    assert all(torch.equal(t, loaded[n]) for n, t in old.state_dict().items())
    # and without the failure the new export replaces it
    ExportCallback().export(*_fake_run(tmp_path, new, 2))
    loaded = HybridLM.from_pretrained(tmp_path / "export").state_dict()
    assert all(torch.equal(t, loaded[n]) for n, t in new.state_dict().items())
    assert json.loads((tmp_path / "export" / "training.json").read_text())["global_step"] == 2


# ---- the Rich progress bar ---------------------------------------------------------------------
def test_rich_progress_bar_renders_steps_loss_and_tokens_per_second():
    import lightning as L

    from hybridzoo.training.callbacks import TokensPerSecond
    from hybridzoo.training.progress import StepProgressBar
    from hybridzoo.training.module import LanguageModel
    from tests.training.test_module import _Data

    out = io.StringIO()
    bar = StepProgressBar(console_kwargs={"file": out, "force_terminal": True, "width": 200,
                                          "color_system": None})
    torch.manual_seed(0)
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_model_summary=False,
                        max_steps=2, limit_val_batches=0, num_sanity_val_steps=0, callbacks=[bar, TokensPerSecond()])
    trainer.fit(LanguageModel(tiny_config("gdn attn")), datamodule=_Data())
    text = out.getvalue()
    assert "Epoch 0 (max_steps 2)" in text  # StepProgressBar's description, not "Epoch 0/-2"
    assert "2/2" in text and "train/loss" in text and "tok/s" in text


# ---- the callbacks' decisions, one call at a time ---------------------------------------------
def _weights_of(directory: Path) -> dict:
    return HybridLM.from_pretrained(directory).state_dict()


class _FakeData:
    """A data module as the export sees it: saved hyperparameters and tokenizer files."""

    def __init__(self, tokenizer_file: Path):
        self.hparams = {"seq_len": 8, "paths": ["a.txt"], "generator": object()}  # not JSON: left out
        self.file = tokenizer_file

    def tokenizer_files(self):
        return [self.file]


def test_export_rewrites_weights_only_when_they_changed_and_only_on_rank_zero(tmp_path):
    torch.manual_seed(0)
    first, second = HybridLM(tiny_config("gdn attn")), HybridLM(tiny_config("gdn attn"))
    export = ExportCallback(dirpath=tmp_path / "elsewhere")
    trainer, module = _fake_run(tmp_path, first, 1)
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").write_text('{"made": "up"}')
    trainer.datamodule = _FakeData(tmp_path / "tok" / "tokenizer.json")
    export.on_save_checkpoint(trainer, module, {})
    target = tmp_path / "elsewhere"
    assert export.last_export == target and not (tmp_path / "export").exists()  # dirpath wins
    assert (target / "tokenizer.json").read_text() == '{"made": "up"}'
    info = json.loads((target / "training.json").read_text())
    data = {"class_path": f"{__name__}._FakeData", "init_args": {"seq_len": 8, "paths": ["a.txt"]}}
    assert info == {"data": data, "global_step": 1, "val_history": [{"step": 1, "loss": 1.0}]}
    export.data_config = {"class_path": "given.by.the.CLI", "init_args": {"paths": [Path("b.txt")]}}  # it wins
    # the same callback, new weights at the next checkpoint: rewritten
    trainer, module = _fake_run(tmp_path, second, 2)
    export.on_save_checkpoint(trainer, module, {})
    assert json.loads((target / "training.json").read_text())["data"] == {
        "class_path": "given.by.the.CLI", "init_args": {"paths": ["b.txt"]}}  # a Path written as text
    assert all(torch.equal(t, _weights_of(target)[n]) for n, t in second.state_dict().items())
    # fit ends at the step just exported: only training.json is rewritten (same weights file)
    inode = (target / "model.safetensors").stat().st_ino
    module.val_history.append((2, 0.5))
    export.on_fit_end(trainer, module)
    assert (target / "model.safetensors").stat().st_ino == inode
    assert json.loads((target / "training.json").read_text())["val_history"][-1] == {"step": 2, "loss": 0.5}
    # fit ends later than the last checkpoint: the final weights are exported
    trainer, module = _fake_run(tmp_path, first, 3)
    export.on_fit_end(trainer, module)
    assert all(torch.equal(t, _weights_of(target)[n]) for n, t in first.state_dict().items())
    # a module without val_history (not a LanguageModel) exports an empty history
    export.export(trainer, SimpleNamespace(model=first))
    assert json.loads((target / "training.json").read_text())["val_history"] == []
    # other ranks and Lightning's sanity check write nothing
    before = {p.name: p.stat().st_ino for p in target.iterdir()}
    for change in ({"is_global_zero": False}, {"sanity_checking": True}):
        trainer, module = _fake_run(tmp_path, second, 4)
        vars(trainer).update(change)
        assert export.export(trainer, module) is None
    assert {p.name: p.stat().st_ino for p in target.iterdir()} == before


class _Clock:
    def __init__(self, *times):
        self.times = list(times)

    def __call__(self):
        return self.times.pop(0)


def test_tokens_per_second_counts_every_rank_and_skips_validation_time(monkeypatch):
    """The logger gets each step's rate; the bar gets the rate over the last ``window`` steps
    (their tokens over their seconds), not the last step's."""
    from hybridzoo.training import callbacks
    from hybridzoo.training.callbacks import TokensPerSecond

    logged = []
    module = SimpleNamespace(log=lambda name, value, **kwargs: logged.append((name, value, kwargs)))
    trainer = SimpleNamespace(world_size=2)
    batch = {"input_ids": torch.zeros(3, 5, dtype=torch.long)}
    meter = TokensPerSecond(window=2)
    assert meter.smoothed_rate() is None
    monkeypatch.setattr(callbacks.time, "perf_counter", _Clock(10.0, 12.0, 13.0, 100.0, 104.0, 104.0))
    meter.on_train_batch_start(trainer, module, batch, 0)    # 10: the clock starts
    meter.on_train_batch_end(trainer, module, None, batch, 0)  # 12: 3 x 5 tokens x 2 ranks in 2 s
    meter.on_train_batch_start(trainer, module, batch, 1)    # (no clock read: it runs on)
    meter.on_train_batch_end(trainer, module, None, batch, 1)  # 13: in 1 s
    meter.on_validation_start(trainer, module)
    meter.on_validation_end(trainer, module)
    meter.on_train_batch_start(trainer, module, batch, 2)    # 100: restarted after validation
    meter.on_train_batch_end(trainer, module, None, batch, 2)  # 104: in 4 s
    meter.on_train_batch_start(trainer, module, batch, 3)
    meter.on_train_batch_end(trainer, module, None, batch, 3)  # 104: no time passed, nothing logged
    rates = [(name, value) for name, value, _ in logged]
    # the bar: 30 tokens / 2 s; then (30 + 30) / (2 + 1); then the window drops the first step: 60 / (1 + 4)
    assert rates == [("train/tokens_per_s", 15.0), ("tok/s", 15.0), ("train/tokens_per_s", 30.0),
                     ("tok/s", 20.0), ("train/tokens_per_s", 7.5), ("tok/s", 12.0)]
    assert meter.smoothed_rate() == 12.0
    logger_kwargs, bar_kwargs = logged[0][2], logged[1][2]
    assert logger_kwargs == {"on_step": True, "on_epoch": False, "batch_size": 3}
    assert bar_kwargs == {"prog_bar": True, "logger": False, "on_step": True, "on_epoch": False, "batch_size": 3}


# ---- an export is one unit, written once per checkpoint ----------------------------------------
def _files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in directory.iterdir()}


def test_a_failure_between_the_writes_leaves_the_old_export_whole(tmp_path, monkeypatch):
    """The weights of the new export are written, then writing training.json fails: the export
    directory still holds the old export, all of it, and no temporary folder is left."""
    from hybridzoo.training import callbacks

    torch.manual_seed(0)
    old, new = HybridLM(tiny_config("gdn attn")), HybridLM(tiny_config("gdn attn"))
    ExportCallback().export(*_fake_run(tmp_path, old, 1))
    before = _files(tmp_path / "export")
    real = callbacks.replace_directory

    def fail_at_training_json(directory, writers):
        def failing(path):
            assert (path.parent / "model.safetensors").is_file()  # the new weights are written
            raise OSError("disk full (simulated)")
        return real(directory, {**writers, "training.json": failing})

    monkeypatch.setattr(callbacks, "replace_directory", fail_at_training_json)
    with pytest.raises(OSError, match="simulated"):
        ExportCallback().export(*_fake_run(tmp_path, new, 2))
    assert _files(tmp_path / "export") == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]  # no .export.partial


KILL_BETWEEN_RENAMES = """
import os, sys
from pathlib import Path
from hybridzoo.zoo.checkpoint import replace_directory

real = Path.rename
def rename(self, target):  # the old export goes aside, then the process dies: kill -9 at the worst point
    real(self, target)
    if Path(target).name == ".export.old":
        os._exit(9)
Path.rename = rename
names = ("model.safetensors", "config.json", "training.json")
replace_directory(Path(sys.argv[1]) / "export", {name: lambda p: p.write_text("new") for name in names})
"""


def test_a_kill_between_the_renames_loses_nothing(tmp_path):
    """A process killed after moving the old export aside and before renaming the new one in
    leaves the old export complete as .export.old; loading says where it is, and the next
    export puts it back, writes the new one and leaves no temporary folder."""
    from hybridzoo.zoo import CheckpointError

    torch.manual_seed(0)
    old = HybridLM(tiny_config("gdn attn"))
    ExportCallback().export(*_fake_run(tmp_path, old, 1))
    before = _files(tmp_path / "export")
    run = subprocess.run([sys.executable, "-c", KILL_BETWEEN_RENAMES, str(tmp_path)], cwd=ROOT, capture_output=True,
                         text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert run.returncode == 9, run.stderr[-2000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".export.old", ".export.partial"]
    assert _files(tmp_path / ".export.old") == before  # the old export, whole
    assert _files(tmp_path / ".export.partial") == dict.fromkeys(before, b"new")  # the new one, whole too
    with pytest.raises(CheckpointError, match=r"\.export\.old: rename it to"):
        HybridLM.from_pretrained(tmp_path / "export")
    new = HybridLM(tiny_config("gdn attn"))
    ExportCallback().export(*_fake_run(tmp_path, new, 3))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]
    loaded = HybridLM.from_pretrained(tmp_path / "export").state_dict()
    assert all(torch.equal(t, loaded[n]) for n, t in new.state_dict().items())


def test_an_export_is_written_once_per_checkpoint_with_save_last(tmp_path, monkeypatch):
    """ModelCheckpoint(save_last=True) saves every checkpoint twice (the top-k file, then
    last.ckpt): the export is written once per step all the same."""
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    from hybridzoo.training import callbacks
    from hybridzoo.training.module import LanguageModel
    from tests.training.test_module import _Data

    real, writes, saves = callbacks.replace_directory, [], []
    monkeypatch.setattr(callbacks, "replace_directory", lambda d, w: (writes.append(Path(d)), real(d, w)))

    class CountSaves(Callback):
        def on_save_checkpoint(self, trainer, pl_module, checkpoint):
            saves.append(trainer.global_step)

    torch.manual_seed(0)
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
                        max_steps=2, limit_val_batches=0, num_sanity_val_steps=0, default_root_dir=tmp_path,
                        callbacks=[ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=1, save_last=True),
                                   ExportCallback(), CountSaves()])
    trainer.fit(LanguageModel(tiny_config("gdn attn")), datamodule=_Data())
    assert saves == [1, 1, 2, 2]  # Lightning: two saves per checkpoint
    assert writes == [tmp_path / "export"] * 2  # one export per step (and none more at the end of fit)
    assert json.loads((tmp_path / "export" / "training.json").read_text())["global_step"] == 2


def test_exported_files_have_the_same_permissions_and_strict_json(tmp_path):
    """model.safetensors gets the permissions of the other files (0644 under umask 022; the
    safetensors library writes 0600); training.json is strict JSON even for a diverged loss."""
    torch.manual_seed(0)
    model = HybridLM(tiny_config("mamba2 attn"))  # Mamba-2's time_step_limit holds an infinity
    previous = os.umask(0o022)
    try:
        trainer, module = _fake_run(tmp_path, model, 1)
        module.val_history = [(0, float("nan")), (1, float("inf"))]
        ExportCallback().export(trainer, module)
        model.save_pretrained(tmp_path / "saved")
    finally:
        os.umask(previous)
    for directory in (tmp_path / "export", tmp_path / "saved"):
        modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in directory.iterdir()}
        assert set(modes.values()) == {0o644}, modes

    def refuse(name):
        raise AssertionError(f"non-standard JSON literal {name}")

    for path in (tmp_path / "export" / "training.json", tmp_path / "export" / "config.json"):
        json.loads(path.read_text(), parse_constant=refuse)
    info = json.loads((tmp_path / "export" / "training.json").read_text())
    assert info["val_history"] == [{"step": 0, "loss": "nan"}, {"step": 1, "loss": "inf"}]
