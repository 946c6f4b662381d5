"""The MQAR benchmark's results: the best learning rate's median per row, the Markdown tables
(side by side, and paired runs) and the plot (:mod:`benchmarks.mqar`)."""

from __future__ import annotations

import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any

from benchmarks.mqar_reference import KINDS, REFERENCE_NAMES


def counted(row: dict[str, Any]) -> bool:
    """Whether a run counts in the results: it finished (status ``ok``) and no time limit cut it
    (``--run-seconds``)."""
    return row.get("status") == "ok" and not row.get("stopped")


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per (setting, recipe, impl): the best learning rate by median accuracy over the
    seeds, its median, min and max, the seeds counted and how many of them diverged (ended on a
    non-finite held-out loss; such a run stops there and keeps its best accuracy). Runs stopped
    by the time limit (``--run-seconds``) are left out."""
    groups: dict[tuple, dict[float, list[dict]]] = {}
    for row in rows:
        if counted(row):
            groups.setdefault((row["setting"], row["recipe"] + row.get("variant", ""), row["impl"]), {}).setdefault(row["lr"], []).append(row)
    out = []
    for (setting, recipe, impl), by_lr in groups.items():
        medians = {lr: statistics.median(r["accuracy"] for r in rs) for lr, rs in by_lr.items()}
        # a learning rate competes only with as many finished seeds as the best-covered one: a
        # median of one lucky seed must not beat a median of three
        full = max(len(rs) for rs in by_lr.values())
        lr = max((k for k in medians if len(by_lr[k]) == full), key=lambda k: (medians[k], -k))
        rs = by_lr[lr]
        out.append(dict(setting=setting, recipe=recipe, kind=rs[0]["kind"], size=rs[0]["size"], impl=impl,
                        state_size=rs[0]["state_size"], parameters=rs[0]["parameters"], best_lr=lr,
                        median_accuracy=medians[lr], min_accuracy=min(r["accuracy"] for r in rs),
                        max_accuracy=max(r["accuracy"] for r in rs), seeds=sorted(r["seed"] for r in rs),
                        median_steps=statistics.median(r["steps"] for r in rs),
                        diverged=sum(1 for r in rs if not math.isfinite(r.get("val_loss", 0.0))),
                        medians_by_lr={f"{k:g}": v for k, v in sorted(medians.items())},
                        seeds_by_lr={f"{k:g}": len(by_lr[k]) for k in sorted(by_lr)}))
    order = {k: i for i, k in enumerate(KINDS)}
    out.sort(key=lambda s: (s["setting"], order.get(s["kind"], 99), s["size"] == "l", s["impl"]))
    return out


def results_table(results: dict[str, Any]) -> str:
    """Markdown: per setting, one line per recipe with hybridzoo's and the reference's medians."""
    lines = [f"# MQAR, hybridzoo beside reference layers ({results.get('date', '')})", ""]
    meta = results.get("meta", {})
    commits = list(dict.fromkeys(str(r["commit"])[:7] for r in results.get("runs", []) if r.get("commit")))
    if len(commits) > 1:
        lines += [f"commits {', '.join(f'`{c}`' for c in commits)} (each run's in the JSON), torch {meta.get('torch')}", ""]
    elif meta:
        lines += [f"commit `{meta.get('commit')}`{' (uncommitted changes)' if meta.get('dirty') else ''}, "
                  f"torch {meta.get('torch')}", ""]
    summary = results.get("summary", [])
    for setting, spec in results.get("settings", {}).items():
        lines += [f"## setting `{setting}`", "",
                  f"T = {spec['seq_len']}, {spec['num_pairs']} pairs, vocab {spec['vocab_size']}, batch "
                  f"{spec['batch_size']}, at most {spec['max_steps']} steps ({_stopping(spec)}), learning rates "
                  f"{', '.join(f'{lr:g}' for lr in spec.get('lrs', []))}, seeds {spec.get('seeds')}; "
                  f"device {spec.get('device_name', '?')}", "",
                  "| recipe | state size | hybridzoo median (min-max) | lr | reference | reference median (min-max) | lr |",
                  "|---|---:|---:|---:|---|---:|---:|"]
        rows = [s for s in summary if s["setting"] == setting]
        for recipe in dict.fromkeys(s["recipe"] for s in rows):
            cell = {s["impl"]: s for s in rows if s["recipe"] == recipe}
            hz, ref = cell.get("hybridzoo"), cell.get("reference")
            fmt = lambda s: (f"{s['median_accuracy']:.3f} ({s['min_accuracy']:.3f}-{s['max_accuracy']:.3f})"  # noqa: E731
                             + (f", {s['diverged']} of {len(s['seeds'])} diverged" if s.get("diverged") else "")
                             if s else "-")
            any_row = hz or ref
            lines.append(f"| {recipe} | {any_row['state_size']:,} | {fmt(hz)} | {hz['best_lr'] if hz else '-'} | "
                         f"{REFERENCE_NAMES.get(any_row['kind'], '?')} | {fmt(ref)} | {ref['best_lr'] if ref else '-'} |")
        lines.append("")
    lines += paired_summary(results.get("runs", []))
    lines += paired_table(results.get("runs", []))
    for note in results.get("notes", []):
        lines.append(f"- {note}")
    return "\n".join(lines) + "\n"


def _stopping(spec: dict[str, Any]) -> str:
    """When a run of ``spec`` stops before its step cap, in words."""
    rule = (f", or after {spec['patience']} evaluations without a higher accuracy" if spec.get("patience") else "")
    return f"evaluated every {spec['eval_every']} steps; a run ends there or at accuracy 0.999{rule}"


def paired_summary(rows: list[dict[str, Any]]) -> list[str]:
    """Markdown lines: per (setting, recipe, lr), the seeds that both implementations finished
    (no ``--set`` variant, none cut by a time limit), how many of them hybridzoo's run ended
    higher on, and the mean of hybridzoo's best accuracy minus the reference's. With 3 seeds a
    median can hide that one implementation is ahead seed by seed, or show a gap that is one
    seed's luck; the pairs start from the same weights, so their differences compare like with like."""
    done = {(r["setting"], r["recipe"], r["lr"], r["seed"], r["impl"]): r["accuracy"] for r in rows
            if r.get("status") == "ok" and not r.get("variant") and not r.get("stopped")}
    groups: dict[tuple, list[float]] = {}
    for (setting, recipe, lr, seed, impl), accuracy in done.items():
        if impl == "hybridzoo" and (setting, recipe, lr, seed, "reference") in done:
            groups.setdefault((setting, recipe, lr), []).append(accuracy - done[(setting, recipe, lr, seed, "reference")])
    if not groups:
        return []
    order = {k: i for i, k in enumerate(KINDS)}
    key = lambda g: (g[0], order.get(g[1].split("-")[1], 99), g[1].endswith("-l"), g[2])  # noqa: E731
    lines = ["## seed by seed (pairs both implementations finished)", "",
             "| setting | recipe | lr | pairs | hybridzoo higher | mean of hybridzoo − reference |",
             "|---|---|---:|---:|---:|---:|"]
    for group in sorted(groups, key=key):
        diffs = groups[group]
        lines.append(f"| {group[0]} | {group[1]} | {group[2]:g} | {len(diffs)} | {sum(d > 0 for d in diffs)} "
                     f"| {sum(diffs) / len(diffs):+.3f} |")
    return lines + [""]


def paired_table(rows: list[dict[str, Any]]) -> list[str]:
    """Markdown lines: each (setting, recipe, lr, seed) run by both implementations (no ``--set``
    variant), side by side with the loss of their first step (equal when they start from the
    same weights) and the accuracy at each evaluation."""
    runs = {(r["setting"], r["recipe"], r["lr"], r["seed"], r["impl"]): r for r in rows
            if r.get("status") == "ok" and not r.get("variant")}
    pairs = sorted({k[:4] for k in runs if k[4] == "hybridzoo" and (*k[:4], "reference") in runs})
    if not pairs:
        return []
    curve = lambda r: " ".join(f"{p['accuracy']:.2f}" for p in r.get("curve", []))  # noqa: E731
    lines = ["## paired runs (same seed, same data)", "",
             "| setting | recipe | lr | seed | first loss hybridzoo / reference | best accuracy hybridzoo / reference "
             "| accuracy per evaluation, hybridzoo | reference |", "|---|---|---:|---:|---|---|---|---|"]
    for key in pairs:
        hz, ref = runs[(*key, "hybridzoo")], runs[(*key, "reference")]
        cut = lambda r: f" (cut at {r['steps']} steps: {r['stopped']})" if r.get("stopped") else ""  # noqa: E731
        lines.append(f"| {key[0]} | {key[1]} | {key[2]:g} | {key[3]} | {hz.get('first_loss') or '-'} / {ref.get('first_loss') or '-'} "
                     f"| {hz['accuracy']:.3f}{cut(hz)} / {ref['accuracy']:.3f}{cut(ref)} | {curve(hz)} | {curve(ref)} |")
    return lines + [""]


def plot_results(results: dict[str, Any], path: Path) -> Path:
    """Median accuracy against state size, one panel per setting, per mixer a colour, hybridzoo
    solid with filled circles and the reference dashed with open squares, drawn a little to the
    right of the same state size so that equal results stay visible. Needs matplotlib."""
    try:
        import matplotlib
    except ImportError as error:
        raise ImportError("the plot needs matplotlib: pip install matplotlib") from error
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = list(results.get("settings", {}))
    fig, axes = plt.subplots(1, max(1, len(settings)), figsize=(6.5 * max(1, len(settings)), 4.5), squeeze=False)
    for ax, setting in zip(axes[0], settings):
        rows = [s for s in results.get("summary", []) if s["setting"] == setting]
        for kind in KINDS:
            for impl, style, marker, shift in (("hybridzoo", "-", "o", 1.0), ("reference", "--", "s", 1.08)):
                points = sorted((s["state_size"] * shift, s["median_accuracy"]) for s in rows
                                if s["kind"] == kind and s["impl"] == impl)
                if points:
                    colour = f"C{KINDS.index(kind)}"
                    ax.plot(*zip(*points), style, marker=marker, color=colour, label=f"{kind} ({impl})",
                            markerfacecolor=colour if impl == "hybridzoo" else "none")
        ax.set_xscale("log", base=2)
        ax.set_ylim(-0.02, 1.02)
        ax.set_xlabel("state size (floats per sequence per layer)")
        ax.set_ylabel("MQAR accuracy (median over seeds, best lr)")
        ax.set_title(setting)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)


def write_outputs(results: dict[str, Any], out_dir: Path, name: str) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / f"{name}.json", out_dir / f"{name}.md"]
    paths[0].write_text(json.dumps(results, indent=1) + "\n")
    paths[1].write_text(results_table(results))
    try:
        paths.append(plot_results(results, out_dir / f"{name}.png"))
    except ImportError as error:
        print(f"mqar: no plot: {error}", file=sys.stderr)
    return paths


def collect(results: dict[str, Any], runs_dir: Path) -> dict[str, Any]:
    """Fold every run file of ``runs_dir`` into ``results`` (runs and summary). Without that
    folder (a results file kept without its run files) the runs already in ``results`` stay, and
    the summary is computed from them."""
    if runs_dir.is_dir():
        results["runs"] = [json.loads(p.read_text()) for p in sorted(runs_dir.glob("*.json"))]
    rows = results.setdefault("runs", [])
    results["summary"] = summarize(rows)
    return results
