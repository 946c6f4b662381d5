"""``python -m benchmarks packed``: the document lengths it draws and its CPU smoke run."""

from __future__ import annotations

import json

import torch

from benchmarks import packed


def test_rows_of_documents_fill_each_row_and_cut_long_documents():
    rows = packed.document_lengths(3 * 512, 512, median=100, sigma=1.5, seed=1)
    assert len(rows) == 3 and all(sum(row) == 512 for row in rows)
    assert all(n >= 1 for row in rows for n in row)
    lengths = [n for row in rows for n in row]
    cu = packed.cu_seqlens_of(rows, "cpu")
    assert cu.dtype == torch.int32 and cu[0] == 0 and cu[-1] == 3 * 512 and len(cu) == len(lengths) + 1
    # every row start is a document start: 512 and 1024 are boundaries
    assert {512, 1024} <= set(cu.tolist())
    pos = packed.position_ids_of(rows, "cpu")
    assert pos.shape == (3, 512)
    starts = (pos == 0).nonzero()[:, 1].tolist()
    assert len(starts) == len(lengths) and all(pos[:, 0] == 0)


def test_the_same_seed_draws_the_same_documents_and_another_seed_others():
    a = packed.document_lengths(4096, 1024, 600, 1.2, seed=0)
    assert a == packed.document_lengths(4096, 1024, 600, 1.2, seed=0)
    assert a != packed.document_lengths(4096, 1024, 600, 1.2, seed=1)


def test_cpu_smoke_runs_every_side(tmp_path):
    out = tmp_path / "models.json"
    assert packed.main(["models", "--cpu-smoke", "--recipes", "gla-340m", "--out", str(out)]) == 0
    row = json.loads(out.read_text())["rows"][0]
    assert "errors" not in row and len(row["packed"]) == len(row["unpacked"]) == 1
    assert row["ratio_packed_over_unpacked"]["median"] > 0
    out = tmp_path / "ops.json"
    assert packed.main(["ops", "--cpu-smoke", "--cases", "scalar mamba2-130m", "--out", str(out)]) == 0
    row = json.loads(out.read_text())["rows"][0]
    assert row["ours_varlen_ms"] > 0 and row["ours_unpacked_ms"] > 0  # fla needs CUDA: its side is an error
