"""How often MQAR runs take off: count, per implementation and variant, the runs whose best
held-out accuracy reaches a threshold, and compare each group with a baseline group by a
two-sided Fisher exact test.

Where a small model's outcome is bimodal (a run either learns recall or stays near chance, as
``mqar-mamba2-s`` at lr 1e-2 does), the median over a few seeds swings with the seeds; the
take-off count over many seeds is the figure to compare.

Inputs are results files of :mod:`benchmarks.mqar` (their ``runs``) or folders of its run
files (``<name>-runs/*.json``), in any mix. Runs of one group may repeat a seed (a rerun); each
run counts.

    python -m benchmarks mqar_takeoff benchmarks/results/2026-12-03-mqar-gpu-3000-h200.json \\
        benchmarks/results/investigations/2026-12-04-mqar-mamba2-s-bisect-h200.json --recipe mqar-mamba2-s --lr 0.01
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any

from benchmarks.mqar_report import counted


def load_runs(paths: list[Path]) -> list[dict[str, Any]]:
    """The finished runs (status ``ok``, not cut by a time limit) of every results file or run folder."""
    runs: list[dict[str, Any]] = []
    for path in paths:
        if path.is_dir():
            runs += [json.loads(p.read_text()) for p in sorted(path.glob("*.json"))]
        else:
            data = json.loads(path.read_text())
            runs += data["runs"] if isinstance(data, dict) and "runs" in data else [data]
    return [r for r in runs if counted(r)]


def fisher_exact(a: int, n1: int, b: int, n2: int) -> float:
    """Two-sided Fisher exact p for ``a`` successes of ``n1`` against ``b`` of ``n2``: the
    probability, with the margins fixed, of a table no more likely than the one observed."""
    if not (0 <= a <= n1 and 0 <= b <= n2):
        raise ValueError(f"fisher_exact: counts {a}/{n1}, {b}/{n2} out of range")
    k, n = a + b, n1 + n2

    def prob(x: int) -> float:
        return math.comb(n1, x) * math.comb(n2, k - x) / math.comb(n, k)

    observed = prob(a)
    xs = range(max(0, k - n2), min(k, n1) + 1)
    return min(1.0, sum(p for p in map(prob, xs) if p <= observed * (1 + 1e-9)))


def matches(run: dict[str, Any], recipes: list[str] | None = None, lr: float | None = None,
            setting: str | None = None) -> bool:
    """Whether ``run`` is of one of ``recipes``, at learning rate ``lr`` and in ``setting`` (each
    None: any)."""
    return (not recipes or run["recipe"] in recipes) and (lr is None or math.isclose(run["lr"], lr)) \
        and (not setting or run["setting"] == setting)


def groups_of(runs: list[dict[str, Any]], recipe: str | None = None, lr: float | None = None,
              setting: str | None = None) -> dict[str, list[dict[str, Any]]]:
    """Runs grouped by ``impl`` + variant tag (``hybridzoo``, ``hybridzoo+ssd-kernel``,
    ``reference-fp32``, ...), filtered by recipe, learning rate and setting (:func:`matches`)."""
    out: dict[str, list[dict[str, Any]]] = {}
    for r in runs:
        if not matches(r, [recipe] if recipe else None, lr, setting):
            continue
        out.setdefault(r["impl"] + (r.get("variant") or ""), []).append(r)
    return out


def take_off_rows(groups: dict[str, list[dict[str, Any]]], threshold: float, baseline: str
                  ) -> list[dict[str, Any]]:
    """Per group: runs, seeds, take-offs (best accuracy >= ``threshold``), median accuracy, and
    Fisher's p against the ``baseline`` group (None for the baseline itself or where it is absent)."""
    def count(rs):
        return sum(r["accuracy"] >= threshold for r in rs)

    base = groups.get(baseline)
    rows = []
    for name, rs in sorted(groups.items()):
        rs = sorted(rs, key=lambda r: r["seed"])
        took = count(rs)
        p = None if base is None or name == baseline else fisher_exact(took, len(rs), count(base), len(base))
        rows.append(dict(group=name, runs=len(rs), seeds=[r["seed"] for r in rs], took_off=took,
                         median=statistics.median(r["accuracy"] for r in rs), p_vs_baseline=p))
    return rows


def markdown(rows: list[dict[str, Any]], threshold: float, baseline: str) -> str:
    lines = [f"| group | runs | take off (>= {threshold:g}) | median | Fisher p against {baseline} |",
             "|---|---:|---:|---:|---:|"]
    for r in rows:
        p = "-" if r["p_vs_baseline"] is None else f"{r['p_vs_baseline']:.3f}"
        lines.append(f"| {r['group']} | {r['runs']} | {r['took_off']} of {r['runs']} | {r['median']:.3f} | {p} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="+", type=Path, help="results JSON files or run folders")
    parser.add_argument("--recipe", default=None, help="e.g. mqar-mamba2-s (default: every recipe)")
    parser.add_argument("--lr", type=float, default=None)
    parser.add_argument("--setting", default=None)
    parser.add_argument("--threshold", type=float, default=0.07, help="best accuracy that counts as take-off")
    parser.add_argument("--baseline", default="hybridzoo", help="the group the others are tested against")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = parser.parse_args(argv)
    missing = [str(p) for p in args.paths if not p.exists()]
    if missing:
        parser.error(f"not found: {missing}")
    groups = groups_of(load_runs(args.paths), args.recipe, args.lr, args.setting)
    if not groups:
        print("mqar_takeoff: no finished runs match", file=sys.stderr)
        return 1
    rows = take_off_rows(groups, args.threshold, args.baseline)
    print(markdown(rows, args.threshold, args.baseline))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
