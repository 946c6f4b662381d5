"""Small helpers shared by tests, benchmarks and the demo."""

from __future__ import annotations

import datetime
import importlib
import os
import platform
import subprocess
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``‖out − ref‖ / ‖ref‖`` in float64; ``inf`` if either holds a NaN or an inf.

    A reference of norm 0 gives the absolute error ``‖out‖`` instead.
    """
    out = out.detach().to(torch.float64)
    ref = ref.detach().to(device=out.device, dtype=torch.float64)
    if out.shape != ref.shape:
        raise ValueError(f"rel_err: shapes differ, {tuple(out.shape)} vs {tuple(ref.shape)}")
    if not (torch.isfinite(out).all() and torch.isfinite(ref).all()):
        return float("inf")
    denom = ref.norm()
    num = (out - ref).norm()
    return float(num / denom) if denom > 0 else float(num)


def _git(*args: str) -> str | None:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def run_metadata(packages: tuple[str, ...] = ("triton",)) -> dict:
    """What a benchmark result records about its run: ``date``, ``commit`` (``HYBRIDZOO_COMMIT``
    if set: a copied checkout, such as the device machine's, can carry stale git metadata; else
    ``git rev-parse HEAD``, or ``"unknown"``), ``dirty`` (uncommitted changes; None without
    git or with ``HYBRIDZOO_COMMIT``), ``versions`` (python, torch and each of ``packages``;
    None where not installed) and ``device`` (the CUDA device's name, else the CPU model)."""
    commit = os.environ.get("HYBRIDZOO_COMMIT")
    status = None if commit else _git("status", "--porcelain")
    versions = {"python": platform.python_version(), "torch": torch.__version__}
    for name in packages:
        try:
            versions[name] = importlib.import_module(name).__version__
        except Exception:  # not installed, or broken: recorded as absent
            versions[name] = None
    if torch.cuda.is_available():
        device = torch.cuda.get_device_name()
    else:
        device = platform.processor() or "cpu"
        try:
            for line in Path("/proc/cpuinfo").read_text().splitlines():
                if line.startswith("model name"):
                    device = line.split(":", 1)[1].strip()
                    break
        except OSError:
            pass
    return {"date": str(datetime.date.today()), "commit": commit or _git("rev-parse", "HEAD") or "unknown",
            "dirty": None if status is None else bool(status), "versions": versions, "device": device}
