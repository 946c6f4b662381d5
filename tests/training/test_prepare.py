"""``hybridzoo prepare``: documents in, Arrow shards and a manifest out; bad input named by file
and line; an interrupted prepare resumes or refuses; a finished set is never overwritten silently."""

import json
from pathlib import Path

import pytest

from hybridzoo.cli import main
from hybridzoo.training import prepare as prep
from hybridzoo.training.manifest import PreparedSet
from hybridzoo.training.prepare import PrepareError, prepare

datasets = pytest.importorskip("datasets")


def docs_of(n: int, seed: int = 0) -> list[str]:
    """``n`` distinct documents of varied length (3 to ~200 characters), some non-ASCII."""
    return [f"doc {i} é{seed} " + "word%d " % (i * 7 % 13) * (i % 29) for i in range(n)]


def write_jsonl(path: Path, texts: list[str], field: str = "text") -> Path:
    path.write_text("".join(json.dumps({field: t, "id": i}) + "\n" for i, t in enumerate(texts)))
    return path


def read_split(out: Path, split: str) -> list[bytes]:
    """The documents of a split, read back through Hugging Face datasets (the engine's own reader)."""
    manifest = json.loads((out / "manifest.json").read_text())
    docs = []
    for shard in manifest["splits"][split]["shards"]:
        for row in datasets.Dataset.from_file(str(out / shard["file"]))["input_ids"]:
            docs.append(bytes(row))
    return docs


def test_jsonl_txt_parquet_and_saved_dataset_round_trip(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    src = tmp_path / "src"
    src.mkdir()
    texts = docs_of(120)
    write_jsonl(src / "a.jsonl", texts[:60])
    (src / "b.txt").write_text(texts[60])
    pq.write_table(pa.table({"text": texts[61:90]}), src / "c.parquet", row_group_size=7)
    datasets.Dataset.from_dict({"text": texts[90:]}).save_to_disk(str(src / "saved"))
    out = tmp_path / "out"
    manifest = prepare([src], out, shard_bytes=700, workers=1, val_fraction=0.1, progress=False)

    train, val = read_split(out, "train"), read_split(out, "val")
    expected = sorted(t.encode() + b"\0" for t in texts)  # each document, then the NUL end-of-document id
    assert sorted(train + val) == expected
    assert not set(train) & set(val)
    assert 0 < len(val) < len(train)
    assert len(manifest["splits"]["train"]["shards"]) > 4  # the work was cut into several tasks
    assert manifest["dtype"] == "uint8" and manifest["tokenizer"]["name"] == "bytes"
    assert manifest["splits"]["train"]["tokens"] == sum(map(len, train))
    assert manifest["splits"]["val"]["documents"] == len(val)
    assert {Path(s["path"]).name for s in manifest["sources"]} == {"a.jsonl", "b.txt", "c.parquet", "saved"}
    assert not (out / ".prepare").exists()


def test_two_workers_write_the_same_shards_as_one(tmp_path):
    corpus = write_jsonl(tmp_path / "c.jsonl", docs_of(200))
    prepare([corpus], tmp_path / "one", shard_bytes=2000, workers=1, progress=False)
    prepare([corpus], tmp_path / "two", shard_bytes=2000, workers=2, progress=False)
    for split in ("train", "val"):
        assert read_split(tmp_path / "one", split) == read_split(tmp_path / "two", split)


def test_hugging_face_tokenizer(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers, trainers

    texts = docs_of(80)
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    (tmp_path / "tok").mkdir()
    tok.save(str(tmp_path / "tok" / "tokenizer.json"))
    out = tmp_path / "out"
    manifest = prepare([write_jsonl(tmp_path / "c.jsonl", texts)], out, str(tmp_path / "tok"), workers=1,
                       progress=False)
    assert manifest["dtype"] == "uint16" and manifest["tokenizer"]["vocab_size"] == tok.get_vocab_size()
    eos = tok.token_to_id("<|endoftext|>")
    rows = [list(r) for split in ("train", "val") for s in manifest["splits"][split]["shards"]
            for r in datasets.Dataset.from_file(str(out / s["file"]))["input_ids"]]
    assert sorted(rows) == sorted(tok.encode(t, add_special_tokens=False).ids + [eos] for t in texts)
    # the bytes per token of the held-out text are known (bits per byte)
    assert manifest["splits"]["val"]["text_bytes"] > manifest["splits"]["val"]["tokens"]


def test_malformed_line_and_missing_field_name_file_and_line(tmp_path):
    lines = [json.dumps({"text": t}) for t in docs_of(300)]
    bad = list(lines)
    bad[237] = '{"text": "unterminated'
    corpus = tmp_path / "bad.jsonl"
    corpus.write_text("\n".join(bad) + "\n")
    with pytest.raises(PrepareError, match=rf"{corpus}, line 238: not valid JSON"):
        prepare([corpus], tmp_path / "out", shard_bytes=3000, workers=1, progress=False)
    missing = list(lines)
    missing[41] = json.dumps({"body": "x"})
    corpus.write_text("\n".join(missing) + "\n")
    with pytest.raises(PrepareError, match=rf"{corpus}, line 42: expected an object with a 'text' string"):
        prepare([corpus], tmp_path / "out2", shard_bytes=3000, workers=2, progress=False)
    # through the command: one line, exit status 2, no manifest (nothing looks complete)
    assert main(["prepare", str(corpus), str(tmp_path / "out3"), "--workers", "1"]) == 2
    assert not (tmp_path / "out3" / "manifest.json").exists()


def test_tokenizer_larger_than_the_model_is_refused(tmp_path, capsys):
    corpus = write_jsonl(tmp_path / "c.jsonl", docs_of(10))
    with pytest.raises(PrepareError, match="has 256 ids, more than the model's vocab_size 200"):
        prepare([corpus], tmp_path / "out", vocab_size=200, progress=False)
    assert not (tmp_path / "out").exists()


def test_interrupted_prepare_resumes_or_refuses(tmp_path, monkeypatch):
    corpus = write_jsonl(tmp_path / "c.jsonl", docs_of(300))
    reference = tmp_path / "reference"
    prepare([corpus], reference, shard_bytes=2000, workers=1, progress=False)

    out, real, calls = tmp_path / "out", prep._run_task, []

    def interrupted(item):
        if len(calls) == 3:
            raise KeyboardInterrupt
        calls.append(item[0])
        return real(item)

    monkeypatch.setattr(prep, "_run_task", interrupted)
    with pytest.raises(PrepareError, match="interrupted: .* rerun the same command"):
        prepare([corpus], out, shard_bytes=2000, workers=1, progress=False)
    monkeypatch.setattr(prep, "_run_task", real)
    assert not (out / "manifest.json").exists()
    with pytest.raises(ValueError, match="unfinished"):
        PreparedSet(out)
    # another command into the unfinished set is refused, naming --overwrite
    with pytest.raises(PrepareError, match="--overwrite"):
        prepare([corpus], out, shard_bytes=4000, workers=1, progress=False)
    done_before = {p.name: p.stat().st_mtime_ns for p in (out / "train").glob("*.arrow")}
    assert len(done_before) == 3
    # the same command resumes: the finished shards are kept, the result is the reference
    prepare([corpus], out, shard_bytes=2000, workers=1, progress=False)
    for name, mtime in done_before.items():
        assert (out / "train" / name).stat().st_mtime_ns == mtime
    for split in ("train", "val"):
        assert read_split(out, split) == read_split(reference, split)
    # a finished set is not rewritten without --overwrite
    with pytest.raises(PrepareError, match="already holds a prepared set; pass --overwrite"):
        prepare([corpus], out, shard_bytes=2000, workers=1, progress=False)
    prepare([corpus], out, shard_bytes=2000, workers=1, progress=False, overwrite=True)
    # --overwrite never deletes a directory that is not a prepared set
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(PrepareError, match="not a prepared set"):
        prepare([corpus], other, progress=False, overwrite=True)
    assert (other / "notes.txt").read_text() == "mine"


def test_command_line(tmp_path, capsys):
    corpus = write_jsonl(tmp_path / "c.jsonl", docs_of(50))
    assert main(["prepare", str(corpus), str(tmp_path / "out"), "--workers", "1", "--val-fraction", "0.2"]) == 0
    printed = capsys.readouterr()
    assert "--data.prepared" in printed.out
    assert "shard 1/1" in printed.err  # plain progress lines when not on a terminal
    assert PreparedSet(tmp_path / "out").manifest["val_fraction"] == 0.2
    assert main(["prepare", str(corpus), str(tmp_path / "out")]) == 2
    assert "--overwrite" in capsys.readouterr().err


def test_default_path_imports_no_shard_engine():
    """``import hybridzoo``, the embedded corpus's data module and ``hybridzoo --help`` import
    neither datasets nor pyarrow (the ``data`` extra is optional)."""
    import subprocess
    import sys

    code = ("import sys, hybridzoo\n"
            "from hybridzoo.training.data import TextDataModule\n"
            "TextDataModule(max_files=3, seq_len=32).vocab_size\n"
            "from hybridzoo.cli import _parser; _parser()\n"
            "import hybridzoo.training.prepare\n"
            "print(sorted(m for m in ('datasets', 'pyarrow', 'litdata') if m in sys.modules))\n")
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root, timeout=120,
                         env={**__import__("os").environ, "PYTHONPATH": str(root)})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"
