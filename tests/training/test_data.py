"""Data modules: embedded corpus split, packing, seeded order and resuming, file formats and their
errors, Hugging Face tokenizer directories, MQAR structure and accuracy."""

from __future__ import annotations

import importlib.util
import json
import sysconfig
from pathlib import Path

import lightning as L
import sys

import pytest
import torch

from hybridzoo.training.data import (
    DEFAULT_CORPUS_BYTES,
    DataError,
    MQARDataModule,
    ResumableSampler,
    TextDataModule,
    stdlib_files,
)
from hybridzoo.training.mqar import multiquery_ar, mqar_accuracy
from hybridzoo.training.tokenizers import ByteTokenizer, HFTokenizer, find_tokenizer

HAS_PYARROW = importlib.util.find_spec("pyarrow") is not None


def rows_of(dataset) -> list[torch.Tensor]:
    return [dataset[i]["input_ids"] for i in range(len(dataset))]


def epoch_order(dm, epoch: int) -> list[list[int]]:
    """First token ids of every row of one training epoch, batch by batch."""
    loader = dm.train_dataloader()
    loader.sampler.set_epoch(epoch)
    return [b["input_ids"][:, :8].tolist() for b in loader]


# ----------------------------------------------------------------------------- embedded corpus


def test_stdlib_corpus_files_and_split_by_file():
    files = stdlib_files(max_files=60)
    root = Path(sysconfig.get_paths()["stdlib"])
    rel = [f.relative_to(root) for f in files]
    assert len(files) == 60 and rel == sorted(rel)
    assert all(f.suffix == ".py" for f in files)
    assert not any({"test", "tests", "idle_test", "site-packages"} & set(r.parts[:-1]) for r in rel)

    dm = TextDataModule(max_files=60, seq_len=64, val_fraction=0.05)
    dm.setup("fit")
    # ground truth built here: every 20th file held out, documents joined with the NUL separator
    val_files = [f for i, f in enumerate(files) if i % 20 == 19]
    train_files = [f for i, f in enumerate(files) if i % 20 != 19]
    assert len(val_files) == 3 and not set(val_files) & set(train_files)
    for files_, ds in ((train_files, dm._train_set), (val_files, dm._val_set)):
        stream = b"".join(f.read_bytes() + b"\0" for f in files_)
        n = len(stream) // 64 * 64
        assert len(ds) == len(stream) // 64
        assert bytes(torch.cat(rows_of(ds)).tolist()) == stream[:n]


def test_stdlib_default_budget():
    files = stdlib_files()
    total = sum(f.stat().st_size for f in files)
    largest = max(f.stat().st_size for f in files)
    assert DEFAULT_CORPUS_BYTES <= total < DEFAULT_CORPUS_BYTES + largest
    assert files == stdlib_files()  # deterministic


# ----------------------------------------------------------------------------- packing


def test_packing_round_trip_txt_and_jsonl(tmp_path):
    texts = [f"document {i}: " + "héllo wörld " * (5 + 3 * i) for i in range(12)]
    (tmp_path / "a.txt").write_text(texts[0], encoding="utf-8")
    (tmp_path / "b.jsonl").write_text(
        "\n".join(json.dumps({"text": t, "id": i}) for i, t in enumerate(texts[1:])) + "\n\n", encoding="utf-8"
    )
    dm = TextDataModule(paths=[str(tmp_path / "a.txt"), str(tmp_path / "b.jsonl")], seq_len=16, val_fraction=0.25)
    dm.setup("fit")
    assert dm.vocab_size == 256 and dm.tokenizer_files() == []
    held_out = [t for i, t in enumerate(texts) if i % 4 == 3]
    kept = [t for i, t in enumerate(texts) if i % 4 != 3]
    for docs, ds in ((kept, dm._train_set), (held_out, dm._val_set)):
        stream = "".join(t + "\0" for t in docs).encode("utf-8")
        rows = rows_of(ds)
        assert len(rows) == len(stream) // 16
        assert b"".join(bytes(r.tolist()) for r in rows) == stream[: len(rows) * 16]
        assert all(torch.equal(ds[i]["labels"], ds[i]["input_ids"]) for i in range(len(ds)))
    batch = next(iter(dm.train_dataloader()))
    assert batch["input_ids"].dtype == torch.long and batch["input_ids"].shape == (8, 16)
    assert dm.decode(dm.encode("héllo")) == "héllo"


def test_single_file_holds_out_the_end_of_the_stream(tmp_path):
    text = "".join(f"line {i}\n" for i in range(400))
    (tmp_path / "one.txt").write_text(text)
    dm = TextDataModule(paths=[str(tmp_path / "one.txt")], seq_len=32, val_fraction=0.1)
    dm.setup("fit")
    stream = (text + "\0").encode()
    n_val = -(-len(stream) // 10)
    train, val = stream[:-n_val], stream[-n_val:]
    assert bytes(torch.cat(rows_of(dm._train_set)).tolist()) == train[: len(train) // 32 * 32]
    assert bytes(torch.cat(rows_of(dm._val_set)).tolist()) == val[: len(val) // 32 * 32]


def test_directory_is_read_recursively_by_extension(tmp_path):
    (tmp_path / "sub" / "deeper").mkdir(parents=True)
    (tmp_path / "sub" / "deeper" / "b.txt").write_text("B" * 100)
    (tmp_path / "a.txt").write_text("A" * 100)
    (tmp_path / "sub" / "c.jsonl").write_text(json.dumps({"text": "C" * 100}))
    (tmp_path / "ignored.py").write_text("P" * 100)
    dm = TextDataModule(paths=[str(tmp_path)], seq_len=8, val_fraction=0.5)
    assert dm.documents() == [b"A" * 100, "C" * 100, b"B" * 100]  # sorted paths: a.txt, sub/c, sub/deeper/b


# ----------------------------------------------------------------------------- order and resume


def test_seeded_shuffle_is_deterministic_and_a_permutation():
    kwargs = dict(vocab_size=64, seq_len=16, num_pairs=2, num_train=50, num_val=4, batch_size=4)
    a, b, c = MQARDataModule(seed=3, **kwargs), MQARDataModule(seed=3, **kwargs), MQARDataModule(seed=4, **kwargs)
    for dm in (a, b, c):
        dm.setup("fit")
    assert epoch_order(a, 0) == epoch_order(b, 0)
    assert epoch_order(a, 1) == epoch_order(b, 1)
    assert epoch_order(a, 0) != epoch_order(a, 1)
    assert epoch_order(a, 0) != epoch_order(c, 0)
    # each epoch visits every row exactly once
    rows = {tuple(a._train_set[i]["input_ids"][:8].tolist()) for i in range(50)}
    seen = [tuple(r) for batch in epoch_order(a, 1) for r in batch]
    assert len(seen) == 50 and set(seen) == rows


def test_sampler_slices_ranks_disjointly():
    ranks = [list(ResumableSampler(40, seed=1, num_replicas=2, rank=r)) for r in range(2)]
    assert len(ranks[0]) == len(ranks[1]) == 20
    assert sorted(ranks[0] + ranks[1]) == list(range(40))
    g = torch.Generator().manual_seed(1)  # seed + epoch 0
    assert ranks[0] == torch.randperm(40, generator=g)[0::2].tolist()


@pytest.mark.parametrize("stop_after", [0, 5, 13])
def test_resume_continues_the_same_order(stop_after):
    def make():
        dm = TextDataModule(max_files=30, seq_len=128, batch_size=4, seed=7)
        dm.setup("fit")
        return dm

    reference = make()
    loader = reference.train_dataloader()
    loader.sampler.set_epoch(2)
    uninterrupted = [b["input_ids"] for b in loader]

    first = make()
    loader = first.train_dataloader()
    loader.sampler.set_epoch(2)
    it = iter(loader)
    head = [next(it)["input_ids"] for _ in range(stop_after)]
    state = first.state_dict()
    assert state["epoch"] == 2 and state["samples_done"] == 4 * stop_after

    resumed = make()
    resumed.load_state_dict(state)  # before the loader exists, as Lightning does
    tail = [b["input_ids"] for b in resumed.train_dataloader()]
    assert len(head) + len(tail) == len(uninterrupted)
    assert all(torch.equal(x, y) for x, y in zip(head + tail, uninterrupted))


class _Recorder(L.LightningModule):
    """Records the batches it trains on; the schedule asks for estimated_stepping_batches."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(()))
        self.seen = []

    def training_step(self, batch, batch_idx):
        self.seen.append(batch["input_ids"].tolist())
        return self.weight * batch["input_ids"].float().mean()

    def validation_step(self, batch, batch_idx):
        pass

    def configure_optimizers(self):
        assert self.trainer.estimated_stepping_batches > 0
        return torch.optim.SGD(self.parameters(), lr=0.0)


def test_lightning_resume_mid_epoch_continues_the_same_order(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    # one data module for every run: a loaded position must not leak into a later fresh run
    data = MQARDataModule(vocab_size=64, seq_len=16, num_pairs=2, num_train=40, num_val=8, batch_size=4)

    def fit(steps, ckpt_path=None, callbacks=()):  # 10 batches an epoch
        model = _Recorder()
        trainer = L.Trainer(
            max_steps=steps, accelerator="cpu", logger=False, enable_progress_bar=False,
            enable_model_summary=False, default_root_dir=tmp_path, val_check_interval=4,
            num_sanity_val_steps=0, callbacks=list(callbacks), enable_checkpointing=bool(callbacks),
        )
        trainer.fit(model, datamodule=data, ckpt_path=ckpt_path)
        return model.seen

    uninterrupted = fit(24)  # crosses two epoch boundaries
    head = fit(13, callbacks=[ModelCheckpoint(dirpath=tmp_path / "ck", every_n_train_steps=13, save_last=True)])
    last = tmp_path / "ck" / "last.ckpt"
    assert torch.load(last, weights_only=False)["global_step"] == 13  # mid-epoch: batch 3 of epoch 1
    tail = fit(24, ckpt_path=str(last))
    assert len(head) == 13 and len(tail) == 11
    assert fit(14) == uninterrupted[:14]
    assert head + tail == uninterrupted


# ----------------------------------------------------------------------------- errors


def test_missing_path_names_it(tmp_path):
    missing = str(tmp_path / "nope.txt")
    with pytest.raises(FileNotFoundError, match="nope.txt"):
        TextDataModule(paths=[missing])


@pytest.mark.parametrize("name,content", [("empty.txt", ""), ("empty.jsonl", "\n\n"), ("blank.jsonl", '{"text": ""}\n')])
def test_empty_file_names_it(tmp_path, name, content):
    (tmp_path / name).write_text(content)
    dm = TextDataModule(paths=[str(tmp_path / name)])
    with pytest.raises(ValueError, match=name):
        dm.setup("fit")


def test_directory_without_data_names_it(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "x.py").write_text("print()")
    dm = TextDataModule(paths=[str(tmp_path / "data")])
    with pytest.raises(ValueError, match="data"):
        dm.setup("fit")


@pytest.mark.parametrize(
    "lines,pattern",
    [
        (['{"text": "ok"}', '{"txt": "wrong field"}'], r'line 2: expected an object with a "text"'),
        (['{"text": "ok"}', "", '{"text": 3}'], r"line 3: expected"),
        (['{"text": "ok"}', "{not json"], r"line 2: not valid JSON"),
    ],
)
def test_bad_jsonl_line_is_named(tmp_path, lines, pattern):
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines))
    dm = TextDataModule(paths=[str(path)])
    with pytest.raises(ValueError, match=pattern) as info:
        dm.setup("fit")
    assert "bad.jsonl" in str(info.value)


def binary_file(path: Path) -> Path:
    """A copy of a real executable (``/bin/ls`` where there is one) under a text name."""
    source = Path("/bin/ls")
    path.write_bytes(source.read_bytes() if source.is_file() else b"\x7fELF\x02\x01\x01\x00" + bytes(range(256)))
    return path


@pytest.mark.parametrize("name,content,pattern", [
    ("ls.txt", None, r"ls\.txt: NUL byte at offset \d+: a binary file"),
    ("latin1.txt", "caf\u00e9 au lait\n".encode("latin-1"), r"latin1\.txt: not UTF-8 text \(byte 0xe9 at offset 3\)"),
    ("nul.txt", b"text with a \x00 inside", r"nul\.txt: NUL byte at offset 12"),
    ("bytes.jsonl", b'{"text": "ok"}\n{"text": "caf\xe9"}\n', r"bytes\.jsonl, line 2: not UTF-8 text"),
    ("nul.jsonl", b'{"text": "ok"}\n{"text": "a\\u0000b"}\n', r"nul\.jsonl, line 2: holds a NUL character"),
    ("surrogate.jsonl", b'{"text": "ok"}\n\n{"text": "a\\ud800b"}\n', r"surrogate\.jsonl, line 3: not valid Unicode"),
    ("deep.jsonl", b'{"text": "ok"}\n' + b"[" * 100_000 + b"]" * 100_000, r"deep\.jsonl, line 2: not valid JSON"),
    ("huge.jsonl", b'{"text": ' + b"9" * 5000 + b"}", r"huge\.jsonl, line 1: not valid JSON"),
])
def test_a_file_that_is_not_utf8_text_is_an_error_naming_it(tmp_path, name, content, pattern):
    """Data files are UTF-8 text (errors="strict"): a binary file, invalid UTF-8, a NUL (the
    end-of-document id) or text that cannot be encoded is a DataError naming the file, the offset
    or line, never a document of garbage bytes nor a UnicodeDecodeError/RecursionError from inside."""
    path = tmp_path / name
    binary_file(path) if content is None else path.write_bytes(content)
    dm = TextDataModule(paths=[str(path)], seq_len=4)
    with pytest.raises(DataError, match=pattern):
        dm.setup("fit")


def test_seq_len_the_data_cannot_fill(tmp_path):
    (tmp_path / "small.txt").write_text("x" * 999)  # 1000 tokens with the separator
    dm = TextDataModule(paths=[str(tmp_path / "small.txt")], seq_len=256, val_fraction=0.1)
    with pytest.raises(ValueError, match=r"has 1000 tokens.*seq_len=256.*validation split \(100 tokens\)"):
        dm.setup("fit")
    dm = TextDataModule(paths=[str(tmp_path / "small.txt")], seq_len=64, val_fraction=0.1)
    dm.setup("fit")  # 900 / 100 tokens: fits
    assert len(dm._train_set) == 900 // 64 and len(dm._val_set) == 1


def test_bad_arguments():
    with pytest.raises(ValueError, match="val_fraction"):
        TextDataModule(val_fraction=0.0)
    with pytest.raises(ValueError, match="seq_len"):
        TextDataModule(seq_len=1)
    with pytest.raises(FileNotFoundError, match="no_such_tokenizer"):
        TextDataModule(tokenizer="/no_such_tokenizer").vocab_size


def test_parquet_without_pyarrow_says_install_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # import pyarrow now raises ImportError
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    (tmp_path / "d.parquet").write_bytes(b"PAR1")
    dm = TextDataModule(paths=[str(tmp_path / "d.parquet")])
    with pytest.raises(ImportError, match="install pyarrow"):
        dm.setup("fit")


@pytest.mark.skipif(not HAS_PYARROW, reason="pyarrow is not installed")
def test_parquet_text_column(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = [f"parquet row {i} " * 20 for i in range(8)]
    pq.write_table(pa.table({"text": texts, "n": list(range(8))}), tmp_path / "d.parquet")
    pq.write_table(pa.table({"body": texts}), tmp_path / "bad.parquet")
    dm = TextDataModule(paths=[str(tmp_path / "d.parquet")], seq_len=16, val_fraction=0.5)
    assert dm.documents() == texts
    with pytest.raises(ValueError, match="bad.parquet.*text"):
        TextDataModule(paths=[str(tmp_path / "bad.parquet")]).setup("fit")


# ----------------------------------------------------------------------------- tokenizers


def test_hf_tokenizer_directory(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    corpus = ["the cat sat on the mat", "a dog ate the bone", "the bird sang"]
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(corpus, trainers.WordLevelTrainer(special_tokens=["[UNK]", "</s>"]))
    (tmp_path / "tok").mkdir()
    tok.save(str(tmp_path / "tok" / "tokenizer.json"))
    for i, text in enumerate(corpus * 30):
        (tmp_path / "docs").mkdir(exist_ok=True)
        (tmp_path / "docs" / f"{i:03d}.txt").write_text(text)

    dm = TextDataModule(paths=[str(tmp_path / "docs")], tokenizer=str(tmp_path / "tok"), seq_len=8, val_fraction=0.1)
    assert dm.vocab_size == tok.get_vocab_size()
    assert dm.tokenizer_files() == [tmp_path / "tok" / "tokenizer.json"]
    assert dm.encode("the cat") == tok.encode("the cat").ids
    assert dm.decode(tok.encode("the dog").ids) == "the dog"
    dm.setup("fit")
    eos = tok.token_to_id("</s>")
    assert dm.tokenizer.eos_id == eos
    kept = [t for i, t in enumerate(corpus * 30) if i % 10 != 9]
    stream = [i for t in kept for i in tok.encode(t).ids + [eos]]
    assert torch.cat(rows_of(dm._train_set)).tolist() == stream[: len(stream) // 8 * 8]
    # bits per byte need bytes per token: held-out UTF-8 bytes (+1 separator each) over tokens
    held_out = [t for i, t in enumerate(corpus * 30) if i % 10 == 9]
    n_bytes = sum(len(t.encode()) + 1 for t in held_out)
    n_tokens = sum(len(tok.encode(t).ids) + 1 for t in held_out)
    assert dm.bytes_per_token == pytest.approx(n_bytes / n_tokens)

    assert isinstance(find_tokenizer(tmp_path / "tok"), HFTokenizer)
    assert isinstance(find_tokenizer(tmp_path / "docs"), ByteTokenizer)


def test_byte_tokenizer():
    tok = ByteTokenizer()
    assert tok.vocab_size == 256 and tok.files() == [] and tok.eos_id == 0
    assert tok.encode("é") == [0xC3, 0xA9] and tok.decode(torch.tensor([0xC3, 0xA9])) == "é"


# ----------------------------------------------------------------------------- MQAR


@pytest.mark.parametrize("seq_len,num_pairs,random_fill", [(64, 8, True), (33, 4, False), (128, 32, True)])
def test_mqar_structure(seq_len, num_pairs, random_fill):
    vocab = 256
    x, y = multiquery_ar(64, seq_len, vocab, num_pairs, seed=5, random_non_queries=random_fill)
    assert x.shape == y.shape == (64, seq_len) and x.dtype == y.dtype == torch.long
    assert int(x.min()) >= 0 and int(x.max()) < vocab
    context = 2 * num_pairs
    for inputs, labels in zip(x.tolist(), y.tolist()):
        keys, values = inputs[0:context:2], inputs[1:context:2]
        assert all(1 <= k < vocab // 2 for k in keys) and all(vocab // 2 <= v < vocab for v in values)
        assert len(set(keys)) == num_pairs and len(set(values)) == num_pairs
        pairs = dict(zip(keys, values))
        scored = [t for t, lab in enumerate(labels) if lab != -100]
        assert len(scored) == num_pairs
        queried = [inputs[t - 1] for t in scored]
        assert sorted(queried) == sorted(keys)  # every key queried once
        for t in scored:
            assert t - 1 >= context and (t - 1 - context) % 2 == 0
            assert labels[t] == pairs[inputs[t - 1]]


def test_mqar_determinism_and_power_law():
    a = multiquery_ar(200, 128, 512, 8, seed=1)
    b = multiquery_ar(200, 128, 512, 8, seed=1)
    c = multiquery_ar(200, 128, 512, 8, seed=2)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0])

    def mean_query_position(power_a):
        _, labels = multiquery_ar(400, 256, 512, 8, seed=0, power_a=power_a)
        return (labels != -100).nonzero()[:, 1].float().mean()

    assert mean_query_position(0.01) < mean_query_position(1.0) - 20  # queries close to the context

    dm = MQARDataModule(vocab_size=512, seq_len=64, num_pairs=4, num_train=30, num_val=10, seed=3)
    dm.setup("fit")
    assert not torch.equal(dm._train_set.input_ids[:10], dm._val_set.input_ids)
    again = MQARDataModule(vocab_size=512, seq_len=64, num_pairs=4, num_train=30, num_val=10, seed=3)
    again.setup("fit")
    assert torch.equal(dm._val_set.input_ids, again._val_set.input_ids)
    assert dm.vocab_size == 512 and dm.tokenizer_files() == []
    assert dm.encode(dm.decode(torch.tensor([5, 300]))) == [5, 300]


@pytest.mark.parametrize(
    "kwargs,pattern",
    [
        (dict(vocab_size=8192, seq_len=31, num_pairs=8), r"seq_len=31 is too short.*>= 4 \* num_pairs = 32"),
        (dict(vocab_size=16, seq_len=64, num_pairs=8), r"vocab_size=16 is too small.*>= 18"),
        (dict(vocab_size=8192, seq_len=64, num_pairs=0), r"num_pairs must be >= 1"),
    ],
)
def test_mqar_bad_settings(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        MQARDataModule(**kwargs)


def test_mqar_accuracy_counts_answer_positions():
    torch.manual_seed(0)
    x, y = multiquery_ar(6, 32, 64, 4, seed=0)
    logits = torch.randn(6, 32, 64, dtype=torch.float64)
    # ground truth by a loop: position t predicts labels[t + 1]
    correct = total = 0
    for b in range(6):
        for t in range(31):
            if y[b, t + 1] != -100:
                total += 1
                correct += int(logits[b, t].argmax() == y[b, t + 1])
    assert mqar_accuracy(logits, y) == (correct, total) and total == 24
    perfect = logits.clone()
    b, t = (y[:, 1:] != -100).nonzero(as_tuple=True)
    perfect[b, t, y[b, t + 1]] = 100.0
    assert mqar_accuracy(perfect, y) == (24, 24)
    perfect[b[0], t[0], y[b[0], t[0] + 1]] = -100.0
    assert mqar_accuracy(perfect, y)[0] == 23
