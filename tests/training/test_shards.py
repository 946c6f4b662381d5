"""Streaming a prepared set: the token stream equals the documents, rows (stream and packed with
boundaries), a seeded order, disjoint ranks, loader workers, validation apart from training, exact
resume from a Lightning checkpoint, and clear errors (another tokenizer, a model too small for
the vocabulary, too little data)."""

import numpy as np
import pytest
import torch
import yaml

from hybridzoo.cli import main
from hybridzoo.training.data import TextDataModule
from hybridzoo.training.manifest import PreparedSet
from hybridzoo.training.prepare import prepare
from hybridzoo.training.shards import ShardRows, ShardSampler, open_split
from tests.training.test_cli import QUIET, write_recipe
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


def test_half_then_resume_is_bit_for_bit(prepared, tmp_path):
    checkpoint = {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                  "init_args": {"save_last": True, "every_n_train_steps": 1}}
    stop = {"class_path": "tests.training.test_resume.StopAt", "init_args": {"step": HALF}}
    assert main(["fit", "--config", str(_prepared_recipe(tmp_path, tmp_path / "ref", prepared, [checkpoint])),
                 *QUIET]) == 0
    reference = _last(tmp_path / "ref")
    assert reference["global_step"] == N

    assert main(["fit", "--config", str(_prepared_recipe(tmp_path, tmp_path / "run", prepared, [checkpoint, stop])),
                 *QUIET]) == 0
    half = next((tmp_path / "run").rglob("last.ckpt"))
    at_half = _last(tmp_path / "run")
    assert at_half["global_step"] == HALF
    assert main(["fit", "--config", str(_prepared_recipe(tmp_path, tmp_path / "run", prepared, [checkpoint])),
                 "--ckpt_path", str(half), *QUIET]) == 0
    final = _last(tmp_path / "run")
    assert final["global_step"] == N
    for name, value in reference["state_dict"].items():
        assert torch.equal(final["state_dict"][name], value), name
    # the second half mattered: the weights at HALF differ from the final ones
    assert any(not torch.equal(at_half["state_dict"][k], v) for k, v in final["state_dict"].items())
