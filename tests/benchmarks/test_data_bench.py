"""``python -m benchmarks data`` at a tiny size: the corpus it generates is valid jsonl, and a run
writes its JSON and markdown record with every figure."""

import json

import pytest

pytest.importorskip("datasets")
from benchmarks import data as bench  # noqa: E402


def test_generated_corpus_is_jsonl_of_the_size(tmp_path):
    path = tmp_path / "c.jsonl"
    written = bench.generate_corpus(path, 300_000)
    assert written == path.stat().st_size >= 300_000
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert all(isinstance(r["text"], str) and r["text"] for r in records)
    assert len({r["id"] for r in records}) == len(records)  # repetitions get their own ids


def test_tiny_run_writes_the_record(tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "stream_in_fresh_process", bench.stream)  # spawning takes seconds
    out = tmp_path / "record"
    assert bench.main(["--size", "0.0003", "--compare-size", "0", "--batches", "2", "--seq-len", "64",
                       "--workers", "0", "--prepare-workers", "1", "--bpe-mb", "0", "--tmp", str(tmp_path),
                       "--out", str(out)]) == 0
    record = json.loads(out.with_suffix(".json").read_text())
    row = record["rows"][0]
    assert row["byte_prepare"]["train_tokens"] > 0
    assert {(s["packing"], s["workers"]) for s in row["stream"]} == {("stream", 0), ("documents", 0)}
    assert all(s["tokens"] == 2 * 8 * 64 and s["peak_rss_gb"] > 0 for s in row["stream"])
    assert "Targets:" in out.with_suffix(".md").read_text()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("hybridzoo-data-bench")] == []  # cleaned up
