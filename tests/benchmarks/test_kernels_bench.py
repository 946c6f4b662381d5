"""benchmarks/kernels.py: the CPU mode end to end at a tiny size, and the GPU mode's case selection."""

from __future__ import annotations

import json

import pytest

from benchmarks import kernels

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def test_cpu_mode_writes_matching_timings(tmp_path):
    pytest.importorskip("transformers")
    out = tmp_path / "cpu.json"
    assert kernels.main(["--cpu", "--seq-len", "64", "--runs", "1", "--warmup", "0", "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    assert record["shapes"]["T"] == 64 and record["rel_err_output"] < 1e-5
    assert len(record["ours"]["times_s"]) == len(record["anchor"]["times_s"]) == 1
    assert record["ratio_anchor_over_ours"] == pytest.approx(record["anchor"]["median_s"] / record["ours"]["median_s"])
    assert {"commit", "versions"} <= set(record) and record["versions"]["transformers"]


def test_gpu_mode_refuses_without_cuda_and_selects_cases(capsys):
    import torch

    if not torch.cuda.is_available():
        assert kernels.main(["--out", "/nonexistent/never.json"]) == 2
        assert "--cpu" in capsys.readouterr().err
    assert [c[0] for c in kernels.selected_cases("delta")] == [c[0] for c in kernels.CASES if "delta" in c[0]]
    assert len(kernels.selected_cases(None)) == len(kernels.CASES) == 13
