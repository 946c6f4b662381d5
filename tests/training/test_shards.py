"""Streaming a prepared set: the token stream equals the documents, rows (stream and packed with
boundaries), a seeded order, disjoint ranks (also in 2 DDP processes), loader workers, validation
apart from training, exact resume from a Lightning checkpoint in both packings, and clear errors
(another tokenizer, a model too small for the vocabulary, too little data)."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from lightning.pytorch.callbacks import Callback

from hybridzoo.cli import main
from hybridzoo.training.data import TextDataModule
from hybridzoo.training.manifest import PreparedSet
from hybridzoo.training.prepare import prepare
from hybridzoo.training.shards import ShardRows, ShardSampler, open_split
from tests.training.test_cli import QUIET, ROOT, write_recipe
from tests.training.test_prepare import docs_of, read_split, write_jsonl

pytest.importorskip("datasets")
SEQ = 16


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("prepared")
    corpus = write_jsonl(tmp / "c.jsonl", docs_of(400))
    prepare([corpus], tmp / "out", shard_bytes=3000, workers=1, val_fraction=0.1, progress=False)
    return tmp / "out"


def documents(out, split) -> list[bytes]:
    return read_split(out, split)


def test_stream_reads_the_documents_in_order(prepared):
    docs = documents(prepared, "train")
    expected = np.frombuffer(b"".join(docs), dtype=np.uint8)
    stream = open_split(PreparedSet(prepared), "train")
    assert len(stream) == len(expected) and stream.num_documents == len(docs)
    assert np.array_equal(stream.read(0, len(stream)), expected)
    rng = np.random.default_rng(0)
    for lo in rng.integers(0, len(expected) - 500, 50):  # ranges across record batches and shards
        hi = int(lo + rng.integers(0, 500))
        assert np.array_equal(stream.read(int(lo), hi), expected[lo:hi])
    starts = np.cumsum([0] + [len(d) for d in docs[:-1]])
    assert np.array_equal(stream.document_starts(), starts)


def test_rows_stream_and_documents(prepared):
    docs = documents(prepared, "train")
    tokens = torch.tensor(list(b"".join(docs)), dtype=torch.int64)
    starts = set(np.cumsum([0] + [len(d) for d in docs]).tolist())
    stream = open_split(PreparedSet(prepared), "train")
    plain, packed = ShardRows(stream, SEQ, "stream"), ShardRows(stream, SEQ, "documents")
    assert len(plain) == len(packed) == len(tokens) // SEQ
    for i in (0, 1, 7, len(plain) - 1):
        row = tokens[i * SEQ:(i + 1) * SEQ]
        assert torch.equal(plain[i]["input_ids"], row) and torch.equal(plain[i]["labels"], row)
        item = packed[i]
        assert torch.equal(item["input_ids"], row)
        # expected positions: count from the last document start (or the row start)
        position, expected_pos, expected_labels = 0, [], []
        for t in range(SEQ):
            start = t == 0 or i * SEQ + t in starts
            position = 0 if start else position + 1
            expected_pos.append(position)
            expected_labels.append(-100 if start else int(row[t]))
        assert item["position_ids"].tolist() == expected_pos
        assert item["labels"].tolist() == expected_labels
    assert any(0 in packed[i]["position_ids"][1:].tolist() for i in range(20))  # boundaries inside rows


def test_order_is_seeded_per_epoch_and_ranks_are_disjoint():
    rows = 103
    one = ShardSampler(rows, seed=3)
    epoch0 = list(one)
    assert sorted(epoch0) == list(range(rows)) and epoch0 != list(range(rows))
    assert list(ShardSampler(rows, seed=3)) == epoch0
    one.set_epoch(1)
    assert list(one) != epoch0 and sorted(one) == list(range(rows))
    for world in (2, 3):
        parts = [list(ShardSampler(rows, seed=3, num_replicas=world, rank=r)) for r in range(world)]
        seen = [i for p in parts for i in p]
        assert len(seen) == len(set(seen)) == rows - rows % world  # disjoint, all but the remainder
        assert all(len(p) == rows // world for p in parts)
    resumed = ShardSampler(rows, seed=3)
    resumed.start = 40
    assert list(resumed) == epoch0[40:]


def _rows_of(loader) -> list[tuple]:
    return [tuple(r) for batch in loader for r in batch["input_ids"].tolist()]


def test_data_module_ranks_workers_and_validation(prepared):
    def module(**kw):
        return TextDataModule(prepared=str(prepared), seq_len=SEQ, batch_size=4, **kw)

    dm = module()
    dm.setup("fit")
    single = _rows_of(dm.train_dataloader())
    assert len(single) == len(dm._train_set)
    # loader workers give the same batches in the same order
    assert _rows_of(module(num_workers=2).train_dataloader()) == single
    # two ranks: disjoint rows that together cover the epoch (one row dropped at most)
    positions = []
    for rank in (0, 1):
        ranked = module()
        ranked._ranks = lambda rank=rank: (2, rank)
        loader = ranked.train_dataloader()
        indices = list(loader.sampler)
        rows = _rows_of(loader)
        assert rows == [tuple(ranked._train_set[i]["input_ids"].tolist()) for i in indices]
        positions.append(set(indices))
    assert not positions[0] & positions[1]
    assert len(positions[0] | positions[1]) >= len(single) - 1
    # validation: whole held-out documents, none of them in training
    train_docs, val_docs = set(documents(prepared, "train")), set(documents(prepared, "val"))
    assert val_docs and not train_docs & val_docs
    val_tokens = bytes(t for row in _rows_of(dm.val_dataloader()) for t in row)
    assert val_tokens == b"".join(documents(prepared, "val"))[:len(val_tokens)]
    assert dm.vocab_size == 256 and dm.bytes_per_token == 1.0


def test_documents_batches_restart_positions_at_each_document(prepared):
    """A batch of the data module's loader (packing="documents"): position_ids count from the
    last document start (or the row start) and labels are -100 there, checked against the
    documents read back through Hugging Face datasets."""
    tokens = b"".join(documents(prepared, "train"))
    starts = set(np.cumsum([0] + [len(d) for d in documents(prepared, "train")]).tolist())
    dm = TextDataModule(prepared=str(prepared), seq_len=SEQ, batch_size=32, packing="documents")
    loader = dm.train_dataloader()
    batch, indices = next(iter(loader)), list(loader.sampler)[:32]
    assert set(batch) == {"input_ids", "labels", "position_ids"}
    assert all(t.shape == (32, SEQ) and t.dtype == torch.int64 for t in batch.values())
    boundaries = 0
    for b, i in enumerate(indices):
        assert bytes(batch["input_ids"][b].tolist()) == tokens[i * SEQ:(i + 1) * SEQ]
        position = -1
        for t in range(SEQ):
            start = t == 0 or i * SEQ + t in starts
            boundaries += start and t > 0
            position = 0 if start else position + 1
            assert int(batch["position_ids"][b, t]) == position
            assert int(batch["labels"][b, t]) == (-100 if start else tokens[i * SEQ + t])
    assert boundaries  # some document starts inside a row


def test_wrong_tokenizer_small_model_and_small_corpus(prepared, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(docs_of(50), trainers.BpeTrainer(vocab_size=280, special_tokens=["<|endoftext|>"]))
    (tmp_path / "tok").mkdir()
    tok.save(str(tmp_path / "tok" / "tokenizer.json"))
    with pytest.raises(ValueError, match=r"manifest.json: the set was prepared with tokenizer 'bytes' .* this run "
                                         r"uses '.*tok'"):
        TextDataModule(prepared=str(prepared), tokenizer=str(tmp_path / "tok")).vocab_size
    with pytest.raises(ValueError, match="vocab_size is 100: set model.config.vocab_size to at least 256"):
        PreparedSet(prepared).check_vocab(100)
    with pytest.raises(ValueError, match="paths .* or as prepared"):
        TextDataModule(paths=[str(prepared)], prepared=str(prepared))
    small = prepare([write_jsonl(tmp_path / "s.jsonl", ["tiny"] * 3)], tmp_path / "small", val_fraction=0.4,
                    progress=False)
    assert small["splits"]["train"]["tokens"] == 10
    with pytest.raises(ValueError, match=r"the training split has 10 tokens; one row of seq_len=16"):
        TextDataModule(prepared=str(tmp_path / "small"), seq_len=16).setup("fit")
    with pytest.raises(ValueError, match="no manifest.json: not a prepared set"):
        TextDataModule(prepared=str(tmp_path))


N, HALF = 6, 3


def _prepared_recipe(tmp, root, prepared, callbacks, packing="stream"):
    path = write_recipe(tmp, root, tmp / "unused.jsonl", max_steps=N, seq_len=SEQ, callbacks=callbacks,
                        precision="32-true", limit_val_batches=0, num_sanity_val_steps=0)
    recipe = yaml.safe_load(path.read_text())
    recipe["data"]["init_args"] = {"prepared": str(prepared), "seq_len": SEQ, "batch_size": 4, "num_workers": 0,
                                   "packing": packing}
    path.write_text(yaml.safe_dump(recipe))
    return path


def _last(root):
    newest = max(root.rglob("last.ckpt"), key=lambda p: p.stat().st_mtime_ns)
    return torch.load(newest, map_location="cpu", weights_only=True)


@pytest.mark.parametrize("packing", ["stream", "documents"])
def test_half_then_resume_is_bit_for_bit(prepared, tmp_path, packing):
    checkpoint = {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                  "init_args": {"save_last": True, "every_n_train_steps": 1}}
    stop = {"class_path": "tests.training.test_resume.StopAt", "init_args": {"step": HALF}}
    def recipe(root, callbacks):
        return str(_prepared_recipe(tmp_path, root, prepared, callbacks, packing))

    assert main(["fit", "--config", recipe(tmp_path / "ref", [checkpoint]), *QUIET]) == 0
    reference = _last(tmp_path / "ref")
    assert reference["global_step"] == N

    assert main(["fit", "--config", recipe(tmp_path / "run", [checkpoint, stop]), *QUIET]) == 0
    half = next((tmp_path / "run").rglob("last.ckpt"))
    at_half = _last(tmp_path / "run")
    assert at_half["global_step"] == HALF
    assert main(["fit", "--config", recipe(tmp_path / "run", [checkpoint]), "--ckpt_path", str(half), *QUIET]) == 0
    final = _last(tmp_path / "run")
    assert final["global_step"] == N
    for name, value in reference["state_dict"].items():
        assert torch.equal(final["state_dict"][name], value), name
    # the second half mattered: the weights at HALF differ from the final ones
    assert any(not torch.equal(at_half["state_dict"][k], v) for k, v in final["state_dict"].items())


class SaveRankRows(Callback):
    """Each rank writes the ``input_ids`` rows it trained on, in order, to ``<dirpath>/rows<r>.pt``
    (int64 ``[rows, T]``), with the keys of its batches."""

    def __init__(self, dirpath: str):
        self.dirpath, self.rows, self.keys = dirpath, [], set()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.rows.append(batch["input_ids"].clone())
        self.keys.update(batch)

    def on_fit_end(self, trainer, pl_module):
        torch.save({"rows": torch.cat(self.rows), "keys": sorted(self.keys), "world_size": trainer.world_size},
                   Path(self.dirpath) / f"rows{trainer.global_rank}.pt")


def test_ddp_two_cpu_processes_read_disjoint_rows_covering_the_epoch(tmp_path):
    """``hybridzoo fit`` with Lightning's DDP over 2 CPU processes (gloo) on a prepared set in
    packing="documents" for one epoch: the ranks' rows are disjoint and together are every row
    of the training split but the ``rows % 2`` remainder."""
    texts = [" ".join(f"{i:02d}{j:03d}" for j in range(4 + i % 7)) for i in range(14)]  # words unique
    prepare([write_jsonl(tmp_path / "c.jsonl", texts)], tmp_path / "set", workers=1, val_fraction=0.2,
            progress=False)
    expected = [tuple(r["input_ids"].tolist())
                for r in ShardRows(open_split(PreparedSet(tmp_path / "set"), "train"), SEQ, "documents")]
    assert len(set(expected)) == len(expected) >= 8  # distinct rows: a row's content names its index
    callbacks = [{"class_path": "tests.training.test_shards.SaveRankRows", "init_args": {"dirpath": str(tmp_path)}}]
    recipe = _prepared_recipe(tmp_path, tmp_path / "run", tmp_path / "set", callbacks, packing="documents")
    recipe_dict = yaml.safe_load(recipe.read_text())
    recipe_dict["trainer"].update(max_steps=-1, max_epochs=1)
    recipe.write_text(yaml.safe_dump(recipe_dict))
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-m", "hybridzoo.cli", "fit", "--config", str(recipe),
                          "--trainer.strategy", "ddp", "--trainer.accelerator", "cpu", "--trainer.devices", "2",
                          *QUIET], cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr[-3000:]
    seen = []
    for rank in (0, 1):
        saved = torch.load(tmp_path / f"rows{rank}.pt", weights_only=True)
        assert saved["world_size"] == 2
        assert saved["keys"] == ["input_ids", "labels", "position_ids"]
        rows = [tuple(r) for r in saved["rows"].tolist()]
        assert len(rows) == len(expected) // 2
        seen.append({expected.index(r) for r in rows})  # ValueError: a row not in the split
    assert not seen[0] & seen[1]
    assert len(seen[0] | seen[1]) == len(expected) - len(expected) % 2
