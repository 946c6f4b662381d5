"""``scripts/profile_kernels.py`` keeps what it measured: each table goes to ``--out`` as soon as
it is taken, so a run cut short (a time limit) leaves the cases it finished. No GPU needed: the
profiler and the cases are stand-ins."""

import runpy
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "profile_kernels.py"


class Cut(BaseException):
    """What a time limit's signal does to the script: not an ``Exception``, nothing catches it."""


def test_tables_are_written_as_they_are_taken(tmp_path, monkeypatch):
    script = runpy.run_path(str(SCRIPT))
    main = script["main"]
    glb = main.__globals__

    def failing():
        raise RuntimeError("no such kernel")

    def cut():
        raise Cut()

    cases = [("delta", "B2 T16", lambda: ("ours", "anchor", None, None, None)),
             ("broken", "B1", failing), ("last", "B1", cut)]
    monkeypatch.setitem(glb, "selected_cases", lambda only: cases)
    monkeypatch.setitem(glb, "kernel_times", lambda fn, grads, inputs, iters: {f"{fn}_kernel": (2.0, 1.5)})
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "a stand-in GPU")
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    out = tmp_path / "sub" / "profile.txt"
    monkeypatch.setattr(sys, "argv", ["profile_kernels.py", "--out", str(out)])
    with pytest.raises(Cut):
        main()
    text = out.read_text()
    assert text.startswith("device: a stand-in GPU")
    assert "delta B2 T16 -- ours: 1.500 ms" in text and "ours_kernel" in text
    assert "delta B2 T16 -- anchor: 1.500 ms" in text and "anchor_kernel" in text
    assert "broken B1: RuntimeError: no such kernel" in text
