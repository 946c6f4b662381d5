"""Run one delta-rule recipe-shape case with the state kernels' launch forced to one setting.

An autotuning candidate that faults (illegal memory access) kills its process, so each setting
runs in a process of its own; this script is one such process. It prints one JSON line: the
case, the forced setting and the relative errors against the float64 reference (or the error).

    python scripts/probe_state_configs.py --recipe mqar-gdn-l --dtype bfloat16 --config 32,4,1
    python scripts/probe_state_configs.py --recipe mqar-gdn-l --dtype bfloat16 --config fixed
    python scripts/probe_state_configs.py --recipe mqar-gdn-l --dtype bfloat16 --config autotune

``--config BV,WARPS,STAGES`` forces both state kernels (``_state_fwd``, ``_state_bwd``), or
only one with ``--kernel fwd|bwd`` (the other keeps the fixed launch); ``fixed`` is the launch
used with autotuning off, ``autotune`` the autotuner's own choice (its pruned candidates).
``--split`` runs the state kernels in 64-row pieces (``delta_rule_split``) and forces those.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", required=True)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--config", default="fixed", help="BV,WARPS,STAGES | fixed | autotune")
    parser.add_argument("--kernel", default="both", choices=("both", "fwd", "bwd"))
    parser.add_argument("--split", action="store_true", help="the state kernels in 64-row pieces (delta_rule_split)")
    args = parser.parse_args()
    os.environ["HYBRIDZOO_AUTOTUNE"] = "1" if args.config == "autotune" else "0"
    os.environ["HYBRIDZOO_SPLIT_STATE"] = "1" if args.split else "0"

    from hybridzoo.kernels.triton import delta_rule_split, launch
    from tests.kernels.triton import recipe_shapes

    (case,) = [c for c in recipe_shapes.cases([args.recipe])
               if c["op"] == "chunk_delta_rule" and c["dtype"] == args.dtype]
    if args.config not in ("fixed", "autotune"):
        bv, warps, stages = (int(x) for x in args.config.split(","))
        forced = {"BV": bv, "num_warps": warps, "num_stages": stages}
        from hybridzoo.kernels.triton import delta_rule, delta_rule_bwd

        fwd, bwd = ((delta_rule_split._state_fwd_split, delta_rule_split._state_bwd_split) if args.split
                    else (delta_rule._state_fwd, delta_rule_bwd._state_bwd))
        targets = {"fwd": [fwd], "bwd": [bwd], "both": [fwd, bwd]}[args.kernel]
        plain_run = launch.run

        def run(kernel, grid, *a, fixed, **consts):
            return plain_run(kernel, grid, *a, fixed=forced if kernel in targets else fixed, **consts)

        launch.run = run  # both kernel modules launch through launch.run
    record = {"recipe": args.recipe, "dtype": args.dtype, "config": args.config, "kernel": args.kernel,
              "split": args.split}
    try:
        result = recipe_shapes.run_case(case)
        record.update(passed=result["passed"], errors=result["errors"])
    except Exception as error:  # noqa: BLE001 - a fault is the finding
        record.update(passed=False, error=f"{type(error).__name__}: {str(error)[:300]}")
    print(json.dumps(record), flush=True)
    return 0 if record["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
