"""One way for every benchmark to record its run: commit, dirty flag, date, device and versions.

    from benchmarks.meta import run_metadata, write_json
    header = run_metadata(peers=("fla", "mamba_ssm"))
    write_json("out.json", {**header, "rows": rows})

``run_metadata`` returns ``{"date", "commit", "dirty", "device", "device_count", "versions",
"settings"}``; ``settings`` holds the ``HYBRIDZOO_*`` environment variables that change which
kernels run (``HYBRIDZOO_AUTOTUNE``, ``HYBRIDZOO_FUSED``, ``HYBRIDZOO_SPLIT_STATE``) as set;
``versions`` holds python, torch, triton and CUDA (``torch.version.cuda``; None on a CPU build)
and, for each name in ``peers``, that package's version, or None where it is not installed.
``HYBRIDZOO_COMMIT`` overrides the commit (for a copy of the checkout without git metadata).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

from hybridzoo.utils import run_metadata as _base_metadata

PEERS = ("fla", "mamba_ssm", "causal_conv1d", "transformers")
SETTINGS = ("HYBRIDZOO_AUTOTUNE", "HYBRIDZOO_FUSED", "HYBRIDZOO_SPLIT_STATE")


def run_metadata(peers: tuple[str, ...] = ()) -> dict:
    """The fields above; ``peers``: the packages this run compares against (their versions). The
    known peers (:data:`PEERS`) that this process has already imported are recorded too."""
    imported = tuple(name for name in PEERS if name in sys.modules)
    meta = _base_metadata(tuple(dict.fromkeys(("triton", *peers, *imported))))
    meta["versions"]["cuda"] = torch.version.cuda
    meta["device_count"] = torch.cuda.device_count() if torch.cuda.is_available() else 0
    meta["settings"] = {name: os.environ[name] for name in SETTINGS if name in os.environ}
    return meta


def write_json(path: str | Path, record: dict) -> Path:
    """Write ``record`` as indented JSON (parent folders created); returns the path. Benchmarks call
    it after every row, so a run that is cut short keeps the rows it finished."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2) + "\n")
    return path
