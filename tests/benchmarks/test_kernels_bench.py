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
    _stub_gpu(monkeypatch, [case], timed)
    out = tmp_path / "k.json"
    argv = ["--out", str(out)] + (["--no-anchor"] if no_anchor else [])
    assert kernels.main(argv) == 0
    row = json.loads(out.read_text())["rows"][0]
    assert row["ours_fwdbwd_ms"] == row["ours_fixed_fwdbwd_ms"] == 2.0
    if no_anchor:
        assert timed == [ours, ours] and not any(key.startswith(("anchor", "ratio", "rel_err")) for key in row)
    else:
        assert timed == [ours, ours, anchor] and row["ratio_fwdbwd"] == 1.0 and row["rel_err_vs_anchor"] > 0.4


def _stub_gpu(monkeypatch, cases, timed):
    """The GPU loop with its device, timing and metadata stubbed; ``timed`` collects what ran."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(kernels, "copy_bandwidth", lambda: 1e9)
    monkeypatch.setattr(kernels, "results_header", lambda bandwidth: {"commit": "abc", "device": "stub", "versions": {}})
    monkeypatch.setattr(kernels, "CASES", cases)
    monkeypatch.setattr(kernels, "bench", lambda fn, grads, inputs: timed.append(fn) or (1.0, 2.0))


def _case(name, value):
    import torch

    fn = lambda: torch.full((3,), float(value))  # noqa: E731
    return (name, "B1", lambda: (fn, fn, (), (), 12)), fn


def test_resume_runs_only_the_cases_not_finished(tmp_path, monkeypatch):
    """--resume keeps finished rows untouched and re-runs a row with an error or no anchor time, and
    the cases not in the file at all."""
    (done, done_fn), (failed, failed_fn), (untimed, untimed_fn), (new, new_fn) = (
        _case(n, i) for i, n in enumerate(("done op", "failed op", "untimed anchor op", "new op"), 1))
    out = tmp_path / "k.json"
    rows = [{"case": "done op", "shape": "B1", "ours_fwdbwd_ms": 7.0, "anchor_fwdbwd_ms": 7.0, "marker": 1},
            {"case": "failed op", "shape": "B1", "ours_fwdbwd_ms": 7.0, "anchor_fwdbwd_ms": 7.0, "anchor_error": "x"},
            {"case": "untimed anchor op", "shape": "B1", "ours_fwdbwd_ms": 7.0}]
    out.write_text(json.dumps({"commit": "abc", "device": "stub", "versions": {}, "rows": rows}))
    timed = []
    _stub_gpu(monkeypatch, [done, failed, untimed, new], timed)
    assert kernels.main(["--out", str(out), "--resume"]) == 0
    assert done_fn not in timed and {failed_fn, untimed_fn, new_fn} <= set(timed)
    by_case = {r["case"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(by_case) == {"done op", "failed op", "untimed anchor op", "new op"}
    assert by_case["done op"]["marker"] == 1  # kept as it was
    assert "anchor_error" not in by_case["failed op"] and by_case["failed op"]["anchor_fwdbwd_ms"] == 2.0
    # with --no-anchor a row whose hybridzoo side is timed counts as finished
    timed.clear()
    assert kernels.main(["--out", str(out), "--resume", "--no-anchor"]) == 0
    assert timed == []


def test_resume_refuses_rows_of_another_device_or_commit(tmp_path, monkeypatch, capsys):
    (case, fn) = _case("op", 1)
    out = tmp_path / "k.json"
    out.write_text(json.dumps({"commit": "old", "device": "stub", "versions": {}, "rows": []}))
    timed = []
    _stub_gpu(monkeypatch, [case], timed)
    assert kernels.main(["--out", str(out), "--resume"]) == 2
    assert "commit" in capsys.readouterr().err and timed == []
    assert json.loads(out.read_text())["commit"] == "old"  # the file is left as it was


def test_all_compile_threads_reach_every_autotuner(tmp_path, monkeypatch, capsys):
    import contextlib

    seen = []

    @contextlib.contextmanager
    def precompiled(threads):
        seen.append(threads)
        yield

    (case, fn) = _case("op", 1)
    timed = []
    _stub_gpu(monkeypatch, [case], timed)
    monkeypatch.setattr(kernels, "every_autotuner_precompiled", precompiled)
    assert kernels.main(["--out", str(tmp_path / "k.json"), "--all-compile-threads", "6"]) == 0
    assert seen == [6] and timed == [fn, fn, fn]
    with pytest.raises(SystemExit):
        kernels.parse_args(["--all-compile-threads", "-1"])
    assert "0 or more" in capsys.readouterr().err
