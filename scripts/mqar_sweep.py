"""MQAR sweep: train the ``mqar-<kind>-<s|l>`` recipes and plot recall accuracy against state size.

Multi-query associative recall (Zoology, Arora et al. 2023; :mod:`hybridzoo.training.mqar`) for
every mixer kind at two state sizes. Each recipe is trained through the real stack
(``hybridzoo fit --config mqar-... --trainer.max_steps ...``, in this process) and its export is
evaluated with ``hybridzoo eval`` (:func:`hybridzoo.training.evaluate.evaluate`): the accuracy is
the MQAR accuracy over the held-out examples (argmax at every query, exact value id).

    python scripts/mqar_sweep.py --setting cpu --threads 1           # the small CPU setting (~17 min)
    python scripts/mqar_sweep.py --setting gpu --device cuda         # Zoology-like, T = 256
    python scripts/mqar_sweep.py --setting gpu-long --device cuda    # T = 512, 64 pairs
    python scripts/mqar_sweep.py --setting cpu --recipes mqar-gla-s,mqar-attn-* --steps 50
    python scripts/mqar_sweep.py --setting gpu --not-run --append    # record planned, untrained rows
    python scripts/mqar_sweep.py --render-only                       # redo the table and plot

Every explicit argument (``--steps``, ``--seq-len``, ``--num-pairs``, ``--vocab-size``,
``--batch-size``, ``--lr``, ...) overrides the setting's value. Results go to
``<out-dir>/<name>.json`` (rewritten after every trained recipe: date, commit, device, versions,
the exact ``hybridzoo fit`` arguments of each run, steps done, wall time, accuracy), ``<name>.md``
(a table) and ``<name>.png`` (accuracy against state size, one line per mixer kind).

The plot needs matplotlib, which is not a hybridzoo dependency: ``pip install matplotlib``.
Without it the JSON and the table are still written.

State size (:func:`state_size`): floats of recurrent state per sequence per layer, from the
config: mamba1 ``d_inner * N``; mamba2 ``H * N * P``; gla / retnet / gdn ``H * K * V``; attention
``2 * min(window, T) * Hk * D``, the keys and values the query at position ``T - 1`` reads (full
attention: the whole sequence). Short-convolution tails (a few tokens of inputs) are not counted.
"""

from __future__ import annotations

import argparse
import datetime
import fnmatch
import json
import platform
import shutil
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

KINDS = ("mamba1", "mamba2", "gla", "retnet", "gdn", "attn")

# The settings: the recipes' own data section is the "gpu" one (Zoology-like: vocab 8192, T 256,
# 16 pairs); "cpu" is what two shared CPU cores can train for all 12 recipes in ~20-25 minutes:
# a small vocabulary (keys and values are then seen often enough to be learnt in a few hundred
# steps), chunks of 16 (GLA's per-key decay costs C^2 K per chunk on the reference path; the
# result depends on the chunk size only through rounding) and a wall-time cap per recipe (the Mamba-1 reference
# scan materialises [B, chunk, d_inner, N]: at N = 64 a step takes seconds on one core).
SETTINGS: dict[str, dict[str, Any]] = {
    "cpu": dict(device="cpu", steps=800, seq_len=64, num_pairs=4, vocab_size=64, batch_size=32,
                num_val=256, warmup_steps=20, chunk_size=16, max_minutes=2.0),
    "gpu": dict(device="cuda", steps=4000, seq_len=256, num_pairs=16, vocab_size=8192, batch_size=64,
                num_val=1000, warmup_steps=100, chunk_size=None, max_minutes=None),
    "gpu-long": dict(device="cuda", steps=8000, seq_len=512, num_pairs=64, vocab_size=8192, batch_size=64,
                     num_val=1000, warmup_steps=200, chunk_size=None, max_minutes=None),
}
CHUNKED = ("mamba2", "gla", "retnet", "gdn")  # mixers with a chunk_size (it changes speed, not results)
MAX_TRAIN_EXAMPLES = 100_000  # Zoology's training set size; fewer when steps * batch is smaller


# ---- state size ---------------------------------------------------------------------------------
def state_size(config, seq_len: int, kind: str | None = None) -> int:
    """Floats of state per sequence in one ``kind`` layer of ``config`` (a ``HybridConfig``).

    ``kind`` defaults to the single mixer kind of the config's layer pattern. ``seq_len`` (T)
    matters only for attention: ``2 * min(window, T) * Hk * D`` (full attention: ``2 * T * Hk * D``).
    """
    if kind is None:
        kinds = set(config.pattern)
        if len(kinds) != 1:
            raise ValueError(f"state_size: the config mixes {sorted(kinds)}; pass kind=")
        (kind,) = kinds
    d_model = config.d_model
    if kind == "mamba1":
        c = config.mamba1
        return c.expand * d_model * c.d_state
    if kind == "mamba2":
        c = config.mamba2
        d_inner = c.expand * d_model
        heads = d_inner // c.head_dim
        return heads * c.d_state * c.head_dim
    if kind in ("gla", "retnet"):
        c = getattr(config, kind)
        key_dim, value_dim = round(c.expand_k * d_model), round(c.expand_v * d_model)
        return c.num_heads * (key_dim // c.num_heads) * (value_dim // c.num_heads)
    if kind == "gdn":
        c = config.gdn
        return c.num_v_heads * c.head_k_dim * c.head_v_dim
    if kind == "attn":
        c = config.attn
        head_dim = c.head_dim or d_model // c.n_heads
        kv_heads = c.n_kv_heads or c.n_heads
        positions = seq_len if c.window is None else min(c.window, seq_len)
        return 2 * positions * kv_heads * head_dim
    raise ValueError(f"state_size: unknown mixer kind {kind!r}; choose from {list(KINDS)}")


# ---- recipes --------------------------------------------------------------------------------------
def mqar_recipes() -> list[str]:
    """The packaged ``mqar-*`` recipe names, ordered by mixer kind then size (s before l)."""
    from hybridzoo.zoo.recipes import recipe_names

    names = [n for n in recipe_names() if n.startswith("mqar-")]
    return sorted(names, key=lambda n: (_kind_index(recipe_kind(n)), n.endswith("-l"), n))


def recipe_kind(name: str) -> str:
    """``"mqar-gla-s"`` -> ``"gla"``."""
    parts = name.split("-")
    return parts[1] if len(parts) >= 3 else name


def _kind_index(kind: str) -> int:
    return KINDS.index(kind) if kind in KINDS else len(KINDS)


def select_recipes(patterns: str | None) -> list[str]:
    """Recipe names from a comma/space separated list of names or globs (None: all mqar-*)."""
    names = mqar_recipes()
    if not patterns:
        return names
    chosen: list[str] = []
    for pattern in patterns.replace(",", " ").split():
        matches = [n for n in names if fnmatch.fnmatch(n, pattern)]
        if not matches and Path(pattern).suffix in (".yaml", ".yml"):
            matches = [pattern]  # a recipe file path
        if not matches:
            raise SystemExit(f"mqar_sweep: --recipes: {pattern!r} matches none of {names}")
        chosen += [m for m in matches if m not in chosen]
    return chosen


# ---- one run --------------------------------------------------------------------------------------
def fit_arguments(recipe: str, run: dict[str, Any], root_dir: Path) -> list[str]:
    """The ``hybridzoo fit`` argument list that trains ``recipe`` in the setting ``run``."""
    cuda = run["device"].startswith("cuda")
    num_train = run.get("num_train") or min(MAX_TRAIN_EXAMPLES, run["steps"] * run["batch_size"])
    args = [
        "fit", "--config", recipe,
        "--data.init_args.vocab_size", run["vocab_size"],
        "--data.init_args.seq_len", run["seq_len"],
        "--data.init_args.num_pairs", run["num_pairs"],
        "--data.init_args.batch_size", run["batch_size"],
        "--data.init_args.num_train", num_train,
        "--data.init_args.num_val", run["num_val"],
        "--data.init_args.seed", run["seed"],
        "--model.warmup_steps", run["warmup_steps"],
        "--trainer.default_root_dir", root_dir,
        "--trainer.max_steps", run["steps"],
        "--trainer.accelerator", "gpu" if cuda else "cpu",
        "--trainer.devices", 1,
        "--trainer.precision", "bf16-mixed" if cuda else "32-true",
        "--trainer.val_check_interval", max(1, min(run["steps"], num_train // run["batch_size"]) // 4),
        "--trainer.limit_val_batches", 2,
        "--trainer.num_sanity_val_steps", 0,
        "--trainer.enable_checkpointing", "false",
        "--trainer.logger", "false",
        "--trainer.enable_progress_bar", "false",
        "--trainer.enable_model_summary", "false",
        "--seed_everything", run["seed"],
    ]
    if run.get("lr") is not None:
        args += ["--model.learning_rate", run["lr"]]
    kind = recipe_kind(recipe)
    if run.get("chunk_size") and kind in CHUNKED:
        args += [f"--model.config.{kind}.chunk_size", run["chunk_size"]]
    if run.get("max_minutes"):
        seconds = int(round(run["max_minutes"] * 60))
        args += ["--trainer.max_time", f"00:{seconds // 3600:02d}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"]
    return [str(a) for a in args]


def describe(recipe: str, run: dict[str, Any]) -> dict[str, Any]:
    """The static part of a result row: kind, size label, state size, parameters."""
    from hybridzoo.zoo.recipes import count_parameters, load_recipe_config

    config = load_recipe_config(recipe, vocab_size=run["vocab_size"])
    return {
        "recipe": recipe, "kind": recipe_kind(recipe), "size": recipe.rsplit("-", 1)[-1],
        "state_size": state_size(config, run["seq_len"]), "parameters": count_parameters(config),
        "d_model": config.d_model, "n_layers": config.n_layers,
    }


def train_and_evaluate(recipe: str, run: dict[str, Any], runs_dir: Path) -> dict[str, Any]:
    """Train ``recipe`` with ``hybridzoo fit`` (in this process), evaluate its export; one result row."""
    from hybridzoo.training.cli import main as fit_main
    from hybridzoo.training.evaluate import evaluate, training_info

    root = runs_dir / run["setting"] / recipe
    export = root / "export"
    row = {**describe(recipe, run), "setting": run["setting"], "status": "failed",
           "fit_args": fit_arguments(recipe, run, root)}
    if export.is_dir():  # never evaluate an earlier run's export if this fit fails
        shutil.rmtree(export)
    start = time.perf_counter()
    code = fit_main(row["fit_args"])
    row["fit_s"] = round(time.perf_counter() - start, 1)
    if code != 0 or not (export / "model.safetensors").is_file():
        row["error"] = f"hybridzoo fit exited with status {code}"
        return row
    info = training_info(export)
    row["steps"] = info.get("global_step")
    row["val_history"] = info.get("val_history", [])
    start = time.perf_counter()
    metrics = evaluate(export, device="cuda" if run["device"].startswith("cuda") else "cpu")
    row["eval_s"] = round(time.perf_counter() - start, 1)
    row.update(status="ok", accuracy=metrics["mqar_accuracy"], loss=metrics["loss"],
               eval_answers=metrics["tokens"], export=str(export))
    return row


# ---- the table and the plot --------------------------------------------------------------------------
def _fmt_int(value) -> str:
    return f"{value:,}" if isinstance(value, int) else "-"


def results_table(results: dict[str, Any]) -> str:
    """A Markdown table of ``results`` (the JSON object this script writes), one section per setting."""
    lines = [f"# MQAR sweep ({results.get('date', '?')})", ""]
    meta = results.get("meta", {})
    if meta:
        lines += [f"commit `{meta.get('commit', '?')}`{' (uncommitted changes)' if meta.get('dirty') else ''}, "
                  f"torch {meta.get('torch', '?')}, lightning {meta.get('lightning', '?')}", ""]
    rows = results.get("runs", [])
    for setting in dict.fromkeys(r["setting"] for r in rows):
        spec = results.get("settings", {}).get(setting, {})
        lines.append(f"## setting `{setting}`")
        lines.append("")
        if spec:
            device = spec.get("device_name") or spec.get("device", "?")
            cap = f", at most {spec['max_minutes']} min per recipe" if spec.get("max_minutes") else ""
            lines.append(f"T = {spec.get('seq_len')}, {spec.get('num_pairs')} pairs, vocab {spec.get('vocab_size')}, "
                         f"batch {spec.get('batch_size')}, up to {spec.get('steps')} steps{cap}, "
                         f"lr {spec.get('lr') or 'recipe'}, warmup {spec.get('warmup_steps')}, "
                         f"chunk size {spec.get('chunk_size') or 'recipe'}, "
                         f"{spec.get('num_val')} held-out examples; device {device}")
            lines.append("")
        lines.append("| recipe | mixer | state size (floats / layer) | parameters | steps | fit s | "
                     "MQAR accuracy | held-out loss | status |")
        lines.append("|---|---|---:|---:|---:|---:|---:|---:|---|")
        for r in (r for r in rows if r["setting"] == setting):
            accuracy = f"{r['accuracy']:.3f}" if r.get("accuracy") is not None else "-"
            loss = f"{r['loss']:.3f}" if r.get("loss") is not None else "-"
            fit_s = f"{r['fit_s']:.0f}" if r.get("fit_s") is not None else "-"
            lines.append(f"| {r['recipe']} | {r['kind']} | {_fmt_int(r.get('state_size'))} | "
                         f"{_fmt_int(r.get('parameters'))} | {_fmt_int(r.get('steps'))} | {fit_s} | "
                         f"{accuracy} | {loss} | {r['status']} |")
        lines.append("")
    notes = results.get("notes")
    if notes:
        lines += ["## notes", "", *[f"- {n}" for n in notes], ""]
    return "\n".join(lines)


def _stopped_early(row: dict[str, Any], spec: dict[str, Any]) -> bool:
    steps, planned = row.get("steps"), spec.get("steps")
    return isinstance(steps, int) and isinstance(planned, int) and steps < planned


def plot_results(results: dict[str, Any], path: str | Path) -> Path:
    """Save a PNG: MQAR accuracy against state size (log scale), one line per mixer kind, one
    panel per setting that has trained rows. Needs matplotlib (``pip install matplotlib``)."""
    try:
        import matplotlib
    except ImportError as error:
        raise ImportError("the plot needs matplotlib, which hybridzoo does not depend on: "
                          "pip install matplotlib") from error
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in results.get("runs", []) if r.get("status") == "ok" and r.get("accuracy") is not None]
    settings = list(dict.fromkeys(r["setting"] for r in rows)) or ["(nothing trained)"]
    fig, axes = plt.subplots(1, len(settings), figsize=(7.0 * len(settings), 4.4), squeeze=False)
    for ax, setting in zip(axes[0], settings):
        these = [r for r in rows if r["setting"] == setting]
        spec = results.get("settings", {}).get(setting, {})
        capped = False
        for kind in sorted({r["kind"] for r in these}, key=_kind_index):
            points = sorted((r["state_size"], r["accuracy"], _stopped_early(r, spec))
                            for r in these if r["kind"] == kind)
            color = f"C{_kind_index(kind)}"  # the same colour for a kind in every panel
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", color=color, label=kind)
            for x, y, early in points:  # hollow marker: the time cap stopped it before --steps
                if early:
                    capped = True
                    ax.plot([x], [y], marker="o", markersize=9, markerfacecolor="white",
                            markeredgecolor=color, linestyle="none")
        if spec.get("num_pairs"):
            ax.axhline(1 / spec["num_pairs"], color="grey", linestyle=":", linewidth=1,
                       label="1 / pairs (a value of the context)")
        ax.set_xscale("log", base=2)
        ax.set_ylim(-0.02, 1.02)
        ax.set_xlabel("state size (floats per sequence per layer)")
        ax.set_ylabel("MQAR accuracy")
        title = (f"{setting}: T={spec.get('seq_len')}, {spec.get('num_pairs')} pairs, "
                 f"vocab {spec.get('vocab_size')}" if spec else setting)
        if capped:
            title += "\n(hollow: stopped by the time cap before the last step)"
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        if these:
            ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.suptitle(f"MQAR accuracy against state size ({results.get('date', '')})")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# ---- bookkeeping ---------------------------------------------------------------------------------------
def device_name(device: str) -> str:
    import torch

    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()} ({torch.get_num_threads()} threads)"
    except OSError:
        pass
    return platform.processor() or device


def metadata() -> dict[str, Any]:
    from hybridzoo.utils import run_metadata

    run = run_metadata(("lightning",))
    return {"commit": run["commit"], "dirty": run["dirty"], "torch": run["versions"]["torch"],
            "lightning": run["versions"]["lightning"], "python": run["versions"]["python"],
            "platform": platform.platform(), "argv": sys.argv[1:]}


def write_outputs(results: dict[str, Any], out_dir: Path, name: str) -> list[Path]:
    """Write ``<name>.json``, ``<name>.md`` and (with matplotlib) ``<name>.png``; return the paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / f"{name}.json", out_dir / f"{name}.md"]
    paths[0].write_text(json.dumps(results, indent=2) + "\n")
    paths[1].write_text(results_table(results))
    try:
        paths.append(plot_results(results, out_dir / f"{name}.png"))
    except ImportError as error:
        print(f"mqar_sweep: no plot: {error}", file=sys.stderr)
    return paths


def _run_order(row: dict[str, Any]) -> tuple:
    """Sort key of a result row: setting (in :data:`SETTINGS` order), mixer kind, size (s before l), name."""
    setting = list(SETTINGS).index(row["setting"]) if row["setting"] in SETTINGS else 99
    return setting, _kind_index(row["kind"]), row["size"] == "l", row["recipe"]


def _merged_notes(*lists: list[str]) -> list[str]:
    """The notes of ``lists`` in order, each once."""
    return list(dict.fromkeys(note for notes in lists for note in notes))


def merge_results(paths: list[Path], out_dir: Path, name: str, notes: list[str]) -> int:
    """``--merge``: fold the settings, runs and notes of ``paths`` into ``<name>.json`` (created if
    absent), later rows replacing earlier ones of the same setting and recipe, and rewrite the outputs."""
    target = out_dir / f"{name}.json"
    results = json.loads(target.read_text()) if target.is_file() else None
    for path in paths:
        part = json.loads(path.read_text())
        if results is None:
            results = {**part, "runs": [], "settings": {}, "notes": []}
        for setting, spec in part.get("settings", {}).items():
            merged = results["settings"].setdefault(setting, {})
            merged.update({k: v for k, v in spec.items() if k != "argv"})
            merged.setdefault("argv_parts", []).append(spec.get("argv"))
        new = {(r["setting"], r["recipe"]) for r in part.get("runs", [])}
        results["runs"] = [r for r in results["runs"] if (r["setting"], r["recipe"]) not in new] + part.get("runs", [])
        results["notes"] = _merged_notes(results.get("notes", []), part.get("notes", []))
    results["notes"] = _merged_notes(results["notes"], notes)
    results["runs"].sort(key=_run_order)
    print("\n".join(str(p) for p in write_outputs(results, out_dir, name)))
    return 0


def run_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The setting's defaults with the explicit command-line values on top."""
    run = {"setting": args.setting, "seed": args.seed, "lr": args.lr, "num_train": args.num_train,
           **SETTINGS[args.setting]}
    for key in ("device", "steps", "seq_len", "num_pairs", "vocab_size", "batch_size", "num_val",
                "warmup_steps", "chunk_size", "max_minutes"):
        value = getattr(args, key)
        if value is not None:
            run[key] = value
    for key in ("max_minutes", "chunk_size"):
        if run[key] is not None and run[key] <= 0:
            run[key] = None
    return run


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--setting", choices=sorted(SETTINGS), default="cpu",
                        help="defaults for the options below (default: cpu)")
    parser.add_argument("--recipes", default=None,
                        help="comma separated recipe names or globs (default: every mqar-* recipe)")
    parser.add_argument("--device", default=None, help="cpu or cuda")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per recipe")
    parser.add_argument("--seq-len", dest="seq_len", type=int, default=None)
    parser.add_argument("--num-pairs", dest="num_pairs", type=int, default=None)
    parser.add_argument("--vocab-size", dest="vocab_size", type=int, default=None)
    parser.add_argument("--batch-size", dest="batch_size", type=int, default=None)
    parser.add_argument("--num-train", dest="num_train", type=int, default=None,
                        help=f"training examples (default: min({MAX_TRAIN_EXAMPLES:,}, steps * batch))")
    parser.add_argument("--num-val", dest="num_val", type=int, default=None, help="held-out examples")
    parser.add_argument("--lr", type=float, default=None, help="peak learning rate (default: the recipe's)")
    parser.add_argument("--warmup-steps", dest="warmup_steps", type=int, default=None)
    parser.add_argument("--chunk-size", dest="chunk_size", type=int, default=None,
                        help="chunk size of the chunked mixers (mamba2, gla, retnet, gdn); 0 = the recipe's")
    parser.add_argument("--max-minutes", dest="max_minutes", type=float, default=None,
                        help="wall-time cap per recipe (Lightning max_time; 0 = none)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2,
                        help="torch CPU threads (default 2; on a CPU shared with other work 1 is steadier: "
                             "two threads waiting on a busy core made some steps 30x slower)")
    parser.add_argument("--out-dir", dest="out_dir", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--name", default=None, help="file name stem (default: <today>-mqar-sweep)")
    parser.add_argument("--runs-dir", dest="runs_dir", type=Path, default=ROOT / "runs" / "mqar-sweep",
                        help="where checkpoints and exports go")
    parser.add_argument("--append", action="store_true",
                        help="add to the existing <name>.json (rows of the same setting and recipe are replaced)")
    parser.add_argument("--not-run", dest="not_run", action="store_true",
                        help="record the planned rows (state size, parameters, fit arguments) without training")
    parser.add_argument("--render-only", dest="render_only", action="store_true",
                        help="rewrite the table and plot from the existing <name>.json")
    parser.add_argument("--note", action="append", default=[], help="a note for the table (repeatable)")
    parser.add_argument("--merge", nargs="+", type=Path, default=None, metavar="JSON",
                        help="add the runs of these results files (e.g. partial sweeps run side by side, "
                             "one per GPU) to <name>.json and rewrite the table and plot; a later file's row "
                             "replaces an earlier one of the same setting and recipe")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    name = args.name or f"{datetime.date.today().isoformat()}-mqar-sweep"
    json_path = args.out_dir / f"{name}.json"
    if args.merge:
        return merge_results(args.merge, args.out_dir, name, args.note)
    if args.render_only or args.append:
        if not json_path.is_file():
            if args.render_only:
                raise SystemExit(f"mqar_sweep: --render-only: no {json_path}")
            results = None
        else:
            results = json.loads(json_path.read_text())
        if args.render_only:
            results["notes"] = _merged_notes(results.get("notes", []), args.note)
            print("\n".join(str(p) for p in write_outputs(results, args.out_dir, name)))
            return 0
    else:
        results = None

    import torch

    torch.set_num_threads(args.threads)
    run = run_settings(args)
    if run["device"].startswith("cuda") and not args.not_run and not torch.cuda.is_available():
        raise SystemExit(f"mqar_sweep: --setting {args.setting} runs on CUDA and none is available "
                         f"(use --device cpu, or --not-run to record the plan)")
    recipes = select_recipes(args.recipes)
    if results is None:
        results = {"date": name[:10] if name[:4].isdigit() else datetime.date.today().isoformat(),
                   "what": "MQAR accuracy against state size, mqar-* recipes", "settings": {},
                   "runs": [], "notes": []}
    meta = metadata()
    results.setdefault("meta", meta)  # the first run's; each setting also keeps its own command
    results["notes"] = _merged_notes(results.get("notes", []), args.note)
    results["settings"][args.setting] = {
        **{k: v for k, v in run.items() if k != "setting"},
        "device_name": None if args.not_run else device_name(run["device"]),
        "threads": args.threads, "status": "not run" if args.not_run else "run",
        "argv": meta["argv"], "commit": meta["commit"], "dirty": meta["dirty"],
    }
    results["runs"] = [r for r in results["runs"] if not (r["setting"] == args.setting and r["recipe"] in recipes)]

    sweep_start = time.perf_counter()
    for recipe in recipes:
        if args.not_run:
            row = {**describe(recipe, run), "setting": args.setting, "status": "not run",
                   "fit_args": fit_arguments(recipe, run, args.runs_dir / args.setting / recipe)}
        else:
            print(f"mqar_sweep: {recipe} ({args.setting}) ...", flush=True)
            try:
                row = train_and_evaluate(recipe, run, args.runs_dir)
            except Exception as error:  # one failed recipe must not lose the others' results
                row = {**describe(recipe, run), "setting": args.setting, "status": "failed",
                       "error": f"{type(error).__name__}: {error}"}
            print(f"mqar_sweep: {recipe}: {row['status']}, accuracy {row.get('accuracy')}, "
                  f"{row.get('steps')} steps, {row.get('fit_s')} s", flush=True)
        results["runs"].append(row)
        results["runs"].sort(key=_run_order)
        if not args.not_run:  # a trained row is kept even if a later recipe never finishes
            write_outputs(results, args.out_dir, name)
    if not args.not_run:
        results["settings"][args.setting]["sweep_wall_s"] = round(time.perf_counter() - sweep_start, 1)
    paths = write_outputs(results, args.out_dir, name)
    print("\n".join(str(p) for p in paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
