"""Every Triton op, forward and backward, at the shapes of every packaged recipe (MQAR ones
included), bf16 and fp32, a length no chunk divides, with autotuning ON, one process per case
(``recipe_shapes.run_case``): an autotuning candidate that faults would end a training run, so it
must end only its case here. Compared with the float64 reference on the same inputs (fp32 <= 1e-4,
bf16 <= 1e-2; NaN never passes). Writes a JSON record (its path is printed) to
``$HYBRIDZOO_RECORD_DIR`` (default: the test's tmp folder), to commit to benchmarks/results/."""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton

from tests.kernels.triton import recipe_shapes

ROOT = Path(__file__).resolve().parents[3]


def _commit() -> str:
    result = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return result.stdout.strip() or "unknown"


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.timeout(7200)
def test_gpu_every_op_at_every_recipe_shape_autotuned(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["HYBRIDZOO_AUTOTUNE"] = "1"
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    records = []
    for case in recipe_shapes.cases():
        proc = subprocess.run([sys.executable, "-m", "tests.kernels.triton.recipe_shapes", "--case", json.dumps(case)],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
        lines = proc.stdout.strip().splitlines()
        try:
            record = json.loads(lines[-1])
        except (IndexError, json.JSONDecodeError):
            record = {**case, "passed": False, "returncode": proc.returncode, "error": proc.stderr[-2000:]}
        records.append(record)
        print(f"{case['op']} {case['dtype']} {'/'.join(case['recipes'])}: "
              f"{'ok' if record['passed'] else 'FAILED'} {record.get('errors', record.get('error', ''))}")
    date = datetime.date.today().isoformat()
    out = Path(os.environ.get("HYBRIDZOO_RECORD_DIR", tmp_path)) / f"{date}-gpu-recipe-shapes.json"
    out.write_text(json.dumps({
        "what": "every Triton op forward+backward at every packaged recipe's shapes, autotuning on, "
                "one process per case, vs the float64 reference",
        "date": date, "commit": _commit(), "device": torch.cuda.get_device_name(),
        "torch": torch.__version__, "triton": triton.__version__,
        "passed": sum(r["passed"] for r in records), "cases": len(records), "records": records,
    }, indent=1))
    print(f"\nrecord: {out}")
    failed = [f"{r['op']} {r['dtype']} {r['recipes']}: {r.get('errors') or r.get('error')}"
              for r in records if not r["passed"]]
    assert not failed, "\n".join(failed)
