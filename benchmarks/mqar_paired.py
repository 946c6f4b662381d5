"""MQAR runs compared pair by pair: each hybridzoo run beside the reference run of the same recipe,
setting, learning rate, seed and variant tag (the same initial weights and the same data), per
recipe and tag: in how many pairs hybridzoo ends higher, lower or level (within ``--tol``), the
mean and median difference of best held-out accuracy, and the two-sided exact sign test's p
(level pairs left out). With ``--take-off T`` it also counts the pairs where only one side takes
off (its best accuracy reaches T, the other's does not) and gives McNemar's exact p on those
counts; ``--pool`` adds a row over every pair shown.

Where a median of 3 seeds at the best learning rate differs by a few hundredths, the pairs over
every learning rate and seed say whether one implementation ends higher more often than chance
would make it. Inputs as for ``python -m benchmarks mqar_takeoff``: results files of
:mod:`benchmarks.mqar` or folders of its run files. A seed run more than once on a side (a rerun)
is left out of the pairs and counted as such; one run read twice (the same id, commit, steps and
accuracy, as where a results file merged another) counts once.

    python -m benchmarks mqar_paired benchmarks/results/2026-12-03-mqar-gpu-3000-h200.json \\
        --recipe mqar-gla-s,mqar-gdn-s
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any

from benchmarks.mqar_takeoff import load_runs, matches


def sign_test(higher: int, lower: int) -> float:
    """Two-sided exact sign test: the probability, under a fair coin per non-level pair, of a
    split at least as uneven as ``higher`` against ``lower`` (1.0 with no such pair)."""
    if higher < 0 or lower < 0:
        raise ValueError(f"sign_test: counts {higher}, {lower} must not be negative")
    n, k = higher + lower, min(higher, lower)
    if n == 0:
        return 1.0
    return min(1.0, 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n)


def pairs_of(runs: list[dict[str, Any]], recipes: list[str] | None = None, setting: str | None = None,
             lr: float | None = None) -> tuple[dict[tuple[str, str, str], list[dict[str, Any]]], int]:
    """``({(recipe, setting, variant): [pair, ...]}, reruns)``: each pair ``{lr, seed, hybridzoo,
    reference, difference}`` (best accuracies, hybridzoo minus reference) where each side has
    exactly one finished run; ``reruns``: the (recipe, setting, variant, lr, seed) cells left out
    because a side has more than one. A run read twice (same id, commit, steps and accuracy)
    counts once."""
    cells: dict[tuple, dict[str, list[float]]] = {}
    seen = set()
    for r in runs:
        if not matches(r, recipes, lr, setting):
            continue
        same = (r.get("id"), r.get("commit"), r["accuracy"], r.get("steps"))
        if r.get("id") is not None and same in seen:
            continue  # one run read twice (a results file and a file that merged it), not a rerun
        seen.add(same)
        key = (r["recipe"], r["setting"], r.get("variant") or "", r["lr"], r["seed"])
        cells.setdefault(key, {}).setdefault(r["impl"], []).append(r["accuracy"])
    out: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    reruns = 0
    for (recipe, st, variant, rate, seed), sides in sorted(cells.items()):
        ours, ref = sides.get("hybridzoo", []), sides.get("reference", [])
        if not ours or not ref:
            continue
        if len(ours) > 1 or len(ref) > 1:
            reruns += 1
            continue
        out.setdefault((recipe, st, variant), []).append(
            dict(lr=rate, seed=seed, hybridzoo=ours[0], reference=ref[0], difference=ours[0] - ref[0]))
    return out, reruns


def summary_rows(pairs: dict[tuple[str, str, str], list[dict[str, Any]]], tol: float,
                 take_off: float | None = None, pool: bool = False) -> list[dict[str, Any]]:
    """Per (recipe, setting, variant): pairs, higher / lower / level (``|difference| <= tol``),
    mean and median difference, and :func:`sign_test`'s p. With ``take_off``: the pairs where
    only hybridzoo's run reaches it (``only_hybridzoo``) and where only the reference's does
    (``only_reference``), and McNemar's exact p (the sign test on those discordant pairs). With
    ``pool``, a last row (recipe ``all``) over every pair."""
    groups = sorted(pairs.items())
    if pool:
        groups.append((("all", "", ""), [p for _, ps in groups for p in ps]))
    rows = []
    for (recipe, st, variant), ps in groups:
        diffs = [p["difference"] for p in ps]
        higher = sum(d > tol for d in diffs)
        lower = sum(d < -tol for d in diffs)
        row = dict(recipe=recipe, setting=st, variant=variant, pairs=len(ps), higher=higher, lower=lower,
                   level=len(ps) - higher - lower, mean_difference=statistics.fmean(diffs),
                   median_difference=statistics.median(diffs), sign_p=sign_test(higher, lower),
                   learning_rates=sorted({p["lr"] for p in ps}))
        if take_off is not None:
            ours = sum(p["hybridzoo"] >= take_off > p["reference"] for p in ps)
            theirs = sum(p["reference"] >= take_off > p["hybridzoo"] for p in ps)
            row.update(take_off=take_off, only_hybridzoo=ours, only_reference=theirs,
                       mcnemar_p=sign_test(ours, theirs))
        rows.append(row)
    return rows


def markdown(rows: list[dict[str, Any]], tol: float) -> str:
    take_off = next((r["take_off"] for r in rows if "take_off" in r), None)
    extra = "" if take_off is None else (f" | only hybridzoo takes off (>= {take_off:g}) | only the reference "
                                         "| McNemar p")
    lines = [f"| recipe | setting | pairs | hybridzoo higher | lower | level (within {tol:g}) | mean difference "
             f"| median difference | sign test p{extra} |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:" + ("" if take_off is None else "|---:|---:|---:") + "|"]
    for r in rows:
        name = r["recipe"] + (f" {r['variant']}" if r["variant"] else "")
        cells = "" if take_off is None else f" | {r['only_hybridzoo']} | {r['only_reference']} | {r['mcnemar_p']:.3f}"
        lines.append(f"| {name} | {r['setting']} | {r['pairs']} | {r['higher']} | {r['lower']} | {r['level']} "
                     f"| {r['mean_difference']:+.3f} | {r['median_difference']:+.3f} | {r['sign_p']:.3f}{cells} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="+", type=Path, help="results JSON files or run folders")
    parser.add_argument("--recipe", default=None, help="comma-separated recipes (default: every recipe)")
    parser.add_argument("--setting", default=None)
    parser.add_argument("--lr", type=float, default=None, help="one learning rate (default: every rate)")
    parser.add_argument("--tol", type=float, default=0.001,
                        help="a pair whose accuracies differ by at most this much is level (default 0.001)")
    parser.add_argument("--take-off", dest="take_off", type=float, default=None, metavar="T",
                        help="also count the pairs where only one side's best accuracy reaches T (McNemar's test)")
    parser.add_argument("--pool", action="store_true", help="add a row over every pair shown")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows and every pair here")
    args = parser.parse_args(argv)
    if args.tol < 0:
        parser.error("--tol must not be negative")
    if args.take_off is not None and not 0 < args.take_off <= 1:
        parser.error("--take-off must be an accuracy in (0, 1]")
    missing = [str(p) for p in args.paths if not p.exists()]
    if missing:
        parser.error(f"not found: {missing}")
    recipes = [r for r in (args.recipe or "").split(",") if r] or None
    pairs, reruns = pairs_of(load_runs(args.paths), recipes, args.setting, args.lr)
    if not pairs:
        print("mqar_paired: no seed has a finished run of both implementations", file=sys.stderr)
        return 1
    rows = summary_rows(pairs, args.tol, args.take_off, args.pool)
    print(markdown(rows, args.tol))
    if reruns:
        print(f"\n{reruns} cell(s) with a seed run more than once on a side left out")
    if args.json:
        args.json.write_text(json.dumps(dict(rows=rows, reruns=reruns, pairs={" ".join(k): v for k, v in pairs.items()}),
                                        indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
