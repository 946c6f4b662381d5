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
    assert len(kernels.selected_cases(None)) == len(kernels.CASES) == 15


@pytest.mark.parametrize("no_anchor", [False, True])
def test_gpu_mode_times_the_anchor_unless_told_not_to(no_anchor, tmp_path, monkeypatch):
    """The GPU loop with its timing and device stubbed: --no-anchor leaves the anchor untimed."""
    import torch

    timed = []
    ours, anchor = (lambda: torch.ones(3)), (lambda: torch.full((3,), 2.0))
    case = ("fake op vs anchor", "B1", lambda: (ours, anchor, (), (), 12))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(kernels, "copy_bandwidth", lambda: 1e9)
    monkeypatch.setattr(kernels, "results_header", lambda bandwidth: {"device": "stub"})
    monkeypatch.setattr(kernels, "CASES", [case])
    monkeypatch.setattr(kernels, "bench", lambda fn, grads, inputs: timed.append(fn) or (1.0, 2.0))
    out = tmp_path / "k.json"
    argv = ["--out", str(out)] + (["--no-anchor"] if no_anchor else [])
    assert kernels.main(argv) == 0
    row = json.loads(out.read_text())["rows"][0]
    assert row["ours_fwdbwd_ms"] == row["ours_fixed_fwdbwd_ms"] == 2.0
    if no_anchor:
        assert timed == [ours, ours] and not any(key.startswith(("anchor", "ratio", "rel_err")) for key in row)
    else:
        assert timed == [ours, ours, anchor] and row["ratio_fwdbwd"] == 1.0 and row["rel_err_vs_anchor"] > 0.4
