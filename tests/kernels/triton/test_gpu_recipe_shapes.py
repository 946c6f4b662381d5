"""Every Triton op, forward and backward, at the shapes of every packaged recipe (MQAR ones
included), bf16 and fp32, a length no chunk divides, with autotuning ON, one process per case
(``recipe_shapes.run_case``): an autotuning candidate that faults would end a training run, so it
must end only its case here. Compared with the float64 reference on the same inputs (fp32 <= 1e-4,
bf16 <= 1e-2; NaN never passes). Writes a JSON record (its path is printed) to
``$HYBRIDZOO_RECORD_DIR`` (default: the test's tmp folder), to commit to benchmarks/results/; the
record is rewritten after every case, so a run cut short keeps the cases it finished.

``HYBRIDZOO_GPU_JOBS`` (default 1) cases run side by side, each in its own process; the largest
shapes start first.
"""

from __future__ import annotations

import concurrent.futures
import datetime
import json
import math
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
import triton

from tests.kernels.triton import recipe_shapes

ROOT = Path(__file__).resolve().parents[3]


def _commit() -> str:
    result = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return result.stdout.strip() or "unknown"


def _size(case: dict) -> int:
    """Elements of the case's inputs (to start the largest cases first)."""
    return sum(math.prod(v["shape"]) for v in case["args"].values() if isinstance(v, dict))


def _run(case: dict, env: dict) -> dict:
    proc = subprocess.run([sys.executable, "-m", "tests.kernels.triton.recipe_shapes", "--case", json.dumps(case)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    lines = proc.stdout.strip().splitlines()
    try:
        return json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        return {**case, "passed": False, "returncode": proc.returncode, "error": proc.stderr[-2000:]}


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.timeout(7200)
def test_gpu_every_op_at_every_recipe_shape_autotuned(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["HYBRIDZOO_AUTOTUNE"] = "1"
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    jobs = max(1, int(os.environ.get("HYBRIDZOO_GPU_JOBS", "1")))
    cases = sorted(recipe_shapes.cases(), key=_size, reverse=True)
    date = datetime.date.today().isoformat()
    out = Path(os.environ.get("HYBRIDZOO_RECORD_DIR", tmp_path)) / f"{date}-gpu-recipe-shapes.json"
    header = {
        "what": "every Triton op forward+backward at every packaged recipe's shapes, autotuning on, "
                "one process per case, vs the float64 reference",
        "date": date, "commit": _commit(), "device": torch.cuda.get_device_name(),
        "torch": torch.__version__, "triton": triton.__version__, "jobs": jobs,
    }
    records: list[dict] = []
    lock = threading.Lock()

    def finish(record: dict) -> None:
        with lock:
            records.append(record)
            print(f"{record['op']} {record['dtype']} {'/'.join(record['recipes'])}: "
                  f"{'ok' if record['passed'] else 'FAILED'} {record.get('errors', record.get('error', ''))}",
                  flush=True)
            out.write_text(json.dumps({**header, "passed": sum(r["passed"] for r in records),
                                       "cases": len(records), "of": len(cases), "records": records}, indent=1))

    with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        for future in concurrent.futures.as_completed([pool.submit(_run, case, env) for case in cases]):
            finish(future.result())
    print(f"\nrecord: {out}")
    assert len(records) == len(cases)
    failed = [f"{r['op']} {r['dtype']} {r['recipes']}: {r.get('errors') or r.get('error')}"
              for r in records if not r["passed"]]
    assert not failed, "\n".join(failed)
