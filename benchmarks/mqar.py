"""MQAR side by side: every hybridzoo mixer and an independent implementation of the same layer.

Multi-query associative recall (Zoology, Arora et al. 2023; :mod:`hybridzoo.training.mqar`). For
each mixer kind and state size (the ``mqar-<kind>-<s|l>`` recipes), two models are trained in the
same plain loop, on the same data, with the same budget: the recipe's ``HybridLM``, and the same
2-block model whose mixers are the reference layer of that kind:

======== =================================================================
mixer    reference layer
======== =================================================================
gdn      fla ``GatedDeltaNet``          (needs CUDA: fla's Triton kernels)
gla      fla ``GatedLinearAttention``   (needs CUDA)
retnet   fla ``MultiScaleRetention``    (needs CUDA)
mamba1   mamba_ssm ``Mamba``            (needs CUDA and a mamba_ssm build)
mamba2   mamba_ssm ``Mamba2``           (needs CUDA and a mamba_ssm build)
attn     transformers ``LlamaAttention`` (SDPA, a window mask for sliding windows; CPU too)
======== =================================================================

Embedding, norms, MLPs and head are hybridzoo's in both models, built from the same seed; each
reference layer is built where the block builds its mixer, with the initialisation its own model
class gives it: its constructor's, then for Llama transformers' ``normal(0, 0.02)`` of the
projections (``LlamaPreTrainedModel``) and for fla's GLA and RetNet fla's ``normal(0,
initializer_range)`` of linear and conv weights with zero biases (``FLAPreTrainedModel``).
hybridzoo's layers draw torch's RNG as those do, so under one seed both models start from the
same weights (a paired comparison; tested for every kind that runs on a CPU). Zoology's protocol: every learning rate of ``--lrs`` (default 1e-3, 3e-3, 1e-2) and
every seed of ``--seeds`` (at least 3); a run trains to ``--max-steps`` (the stated step cap) or
until its held-out accuracy reaches 0.999. ``--patience N`` also stops a run whose accuracy has
not risen for ``N`` evaluations; it is off in the GPU settings, since MQAR runs sit on a loss
plateau at zero accuracy for a thousand steps or more before recall appears, and stopping there
stopped runs just before they took off, in one implementation and not the other. A row reports
the best learning rate's median accuracy over the seeds (the best accuracy of each run).

    python -m benchmarks.mqar --setting gpu --workers 16            # T 256, 16 pairs, both sizes
    python -m benchmarks.mqar --setting gpu-long --workers 16       # T 512, 64 pairs
    python -m benchmarks.mqar --setting cpu-smoke                   # seconds; hybridzoo + Llama rows
    python -m benchmarks.mqar --setting gpu --kinds gdn,attn --impls hybridzoo --seeds 0,1,2
    python -m benchmarks.mqar --render-only --name 2026-12-01-mqar  # table and plot again

These models are tiny and launch-bound: ``--workers`` processes share the GPUs (job ``i`` runs on
GPU ``i % device_count``). Each finished run is written to ``<out-dir>/<name>-runs/<run>.json``
at once, and runs already there are skipped, so an interrupted sweep resumes. A run cut by
``--run-seconds`` leaves ``<run>.resume.pt`` (weights, optimizer, schedule, data order, RNG) and
the next invocation with the same settings continues it exactly where it stopped, so Zoology's
step caps fit in sittings of a few minutes. Keep Triton's
cache (``TRITON_CACHE_DIR``) between invocations: fla's autotuning alone takes minutes. Outputs:
``<name>.json`` (settings, metadata, every run with its per-step curve), ``<name>.md`` (the table)
and ``<name>.png`` (median accuracy against state size, per mixer, hybridzoo solid and reference
dashed; needs matplotlib).

Rows that need CUDA are skipped on a machine without it (with a line saying so), as are
mamba_ssm rows without a mamba_ssm build. The reference layers are in
:mod:`benchmarks.mqar_reference`, the summary, tables and plot in :mod:`benchmarks.mqar_report`,
the training step (eager or a CUDA graph) in :mod:`benchmarks.graph_step`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.mqar_reference import KINDS, NEEDS_CUDA, REFERENCE_NAMES, ReferenceMixer, reference_skip_reason
from benchmarks.mqar_report import (collect, paired_summary, paired_table, plot_results, results_table, summarize,
                                    write_outputs)

__all__ = ["KINDS", "IMPLS", "SETTINGS", "NEEDS_CUDA", "REFERENCE_NAMES", "ReferenceMixer", "reference_skip_reason",
           "state_size", "mqar_recipes", "build_model", "epoch_generator", "batches_of", "evaluate", "RunLoop", "train_run", "quick_autotuning",
           "plan", "run_streams", "summarize", "results_table", "paired_summary", "paired_table", "plot_results", "write_outputs", "collect",
           "merged_setting", "parse_args", "main"]

ROOT = Path(__file__).resolve().parents[1]
IMPLS = ("hybridzoo", "reference")

# Zoology's MQAR settings (vocab 8192, 100k training examples, power_a 0.01) at two lengths, and a
# CPU smoke setting that checks the machinery in seconds. Both GPU settings share one schedule
# (3000 steps of 64 sequences, no early stop): the comparison is between implementations at
# equal steps, and a sweep of 6 mixers x 2 sizes x 2 implementations x 3 rates x 3 seeds (216
# runs) has to fit a GPU for hours, not days. Zoology itself trains about 22,500 steps of 256.
SETTINGS: dict[str, dict[str, Any]] = {
    "gpu": dict(seq_len=256, num_pairs=16, vocab_size=8192, batch_size=64, num_train=100_000, num_val=1000,
                max_steps=3000, warmup_steps=100, eval_every=250, patience=None),
    "gpu-long": dict(seq_len=512, num_pairs=64, vocab_size=8192, batch_size=64, num_train=100_000, num_val=1000,
                     max_steps=3000, warmup_steps=100, eval_every=250, patience=None),
    "cpu-smoke": dict(seq_len=32, num_pairs=4, vocab_size=64, batch_size=8, num_train=2000, num_val=64,
                      max_steps=12, warmup_steps=2, eval_every=6, patience=4, chunk_size=16),
}
CHUNKED = ("mamba2", "gla", "retnet", "gdn")
WEIGHT_DECAY, BETAS, MIN_LR_RATIO, CLIP = 0.1, (0.9, 0.95), 0.1, 1.0
# Runs that share a process (--streams) hold this while they build a model, step eagerly (Triton
# compiles and tunes there; a run whose graph check failed steps eagerly throughout), capture their
# step, or evaluate; only graph replays run side by side.
_LANE_LOCK = threading.RLock()


# ---- state size --------------------------------------------------------------------------------
def state_size(config, seq_len: int, kind: str | None = None) -> int:
    """Floats of state per sequence in one ``kind`` layer of ``config`` (a ``HybridConfig``).

    ``kind`` defaults to the single mixer kind of the config's layer pattern. mamba1
    ``d_inner * N``; mamba2 ``H * N * P``; gla / retnet / gdn ``H * K * V``; attention
    ``2 * min(window, T) * Hk * D`` (full attention: ``2 * T * Hk * D``), the keys and values the
    query at position ``T - 1`` reads. Short-convolution tails are not counted.
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
        return (c.expand * d_model // c.head_dim) * c.d_state * c.head_dim
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
        positions = seq_len if c.window is None else min(c.window, seq_len)
        return 2 * positions * (c.n_kv_heads or c.n_heads) * head_dim
    raise ValueError(f"state_size: unknown mixer kind {kind!r}; choose from {list(KINDS)}")


def mqar_recipes() -> list[str]:
    """The packaged ``mqar-*`` recipe names, ordered by mixer kind then size (s before l)."""
    from hybridzoo.zoo.recipes import recipe_names

    names = [n for n in recipe_names() if n.startswith("mqar-")]
    return sorted(names, key=lambda n: (KINDS.index(n.split("-")[1]) if n.split("-")[1] in KINDS else 99,
                                        n.endswith("-l"), n))


# ---- one run -----------------------------------------------------------------------------------
def build_model(recipe: str, impl: str, spec: dict[str, Any], seed: int):
    """The recipe's 2-block model; ``impl == "reference"`` swaps each block's mixer for the
    reference layer (built after the rest, from the same seed)."""
    import torch

    from hybridzoo import HybridLM
    from hybridzoo.zoo.recipes import load_recipe_config

    config = load_recipe_config(recipe, vocab_size=spec["vocab_size"])
    kind = config.pattern[0]
    for key, value in (spec.get("overrides") or {}).items():  # --set kind.field=value
        section, field = key.split(".", 1)
        if section == kind:
            setattr(getattr(config, kind), field, value)
    if spec.get("chunk_size") and kind in CHUNKED:
        getattr(config, kind).chunk_size = spec["chunk_size"]
    torch.manual_seed(seed)
    if impl != "reference":
        return HybridLM(config), config
    # the reference layer is built where the block builds its mixer, so torch's RNG stream is
    # drawn at the same place: every hybridzoo mixer draws as its reference layer does, so both
    # models of a seed start from the same weights
    from hybridzoo.layers import MIXERS

    saved = MIXERS[kind]
    MIXERS[kind] = (lambda d_model, settings, backend="auto": ReferenceMixer.build(kind, config), saved[1])
    try:
        return HybridLM(config), config
    finally:
        MIXERS[kind] = saved


def epoch_generator():
    """The run's own generator for each new epoch's order, called right after
    :func:`build_model`: it starts where the seeded global stream stands after the model's draws
    (as that stream stood when a process ran one run), so runs sharing a process keep their order."""
    import torch

    generator = torch.Generator()
    generator.set_state(torch.get_rng_state())
    return generator


def batches_of(spec: dict[str, Any], seed: int):
    """(train ids, train labels, val ids, val labels), int64, from the seed (train ``2 seed``,
    held-out ``2 seed + 1``, as hybridzoo's MQARDataModule)."""
    from hybridzoo.training.mqar import multiquery_ar

    args = (spec["seq_len"], spec["vocab_size"], spec["num_pairs"])
    return (*multiquery_ar(spec["num_train"], *args, seed=2 * seed),
            *multiquery_ar(spec["num_val"], *args, seed=2 * seed + 1))


def evaluate(model, ids, labels, batch_size: int, device: str, autocast) -> tuple[float, float]:
    """(accuracy, mean loss) over the answer positions of the held-out examples."""
    import torch

    from hybridzoo.training.mqar import mqar_accuracy
    from hybridzoo.zoo.model import lm_loss, shift_labels

    model.eval()
    correct = total = 0
    loss_sum = 0.0
    with torch.no_grad(), autocast():
        for start in range(0, ids.shape[0], batch_size):
            x, y = ids[start:start + batch_size].to(device), labels[start:start + batch_size].to(device)
            logits, _ = model(x)
            c, n = mqar_accuracy(logits, y)
            correct, total = correct + c, total + n
            loss_sum += float(lm_loss(logits, shift_labels(y), reduction="sum"))
    model.train()
    return correct / total, loss_sum / total


class RunLoop:
    """One run's training state and loop: the recipe's model (``build_model``), AdamW over
    ``param_groups``, warm-up then cosine, the seed's data and epoch order, and the step
    (:class:`benchmarks.graph_step.TrainStep`, a CUDA graph where ``graph``). ``train_run`` trains
    through it. ``dtype`` ``"bf16"``: training and
    evaluation under bf16 autocast on CUDA; ``"fp32"`` (and on the CPU): float32 throughout.
    Attributes that a resumed run restores: ``order``, ``position``, ``step``, ``epoch_rng``.
    """

    def __init__(self, recipe: str, impl: str, spec: dict[str, Any], seed: int, lr: float, device: str,
                 graph: bool = True, dtype: str = "bf16"):
        import torch

        from benchmarks.graph_step import TrainStep, autocast, make_optimizer
        from hybridzoo.training.module import WarmupCosine, param_groups

        cuda = device.startswith("cuda")
        model, self.config = build_model(recipe, impl, spec, seed)
        self.epoch_rng = epoch_generator()
        self.model = model.to(device)
        self.device, self.batch = device, spec["batch_size"]
        self.graph = cuda and graph
        if dtype not in ("bf16", "fp32"):
            raise ValueError(f"RunLoop: dtype must be 'bf16' or 'fp32', not {dtype!r}")
        self.autocast_dtype = torch.bfloat16 if cuda and dtype == "bf16" else None
        self.autocast = lambda: autocast(self.autocast_dtype)  # noqa: E731
        self.optimizer = make_optimizer(param_groups(model, WEIGHT_DECAY), lr, BETAS, device, self.graph)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, WarmupCosine(spec["warmup_steps"], spec["max_steps"], MIN_LR_RATIO))
        train_ids, train_labels, self.val_ids, self.val_labels = batches_of(spec, seed)
        self.order = torch.randperm(train_ids.shape[0], generator=torch.Generator().manual_seed(seed))
        self.position, self.step = 0, 0
        # The training set and the epoch's order live on the device: a step's batch is gathered there.
        # A copy from pageable host memory each step would wait for the GPU to finish the previous
        # step, so the host could never run ahead of these launch-bound models.
        self.train_step = TrainStep(model, self.optimizer, train_ids.to(device), train_labels.to(device), CLIP,
                                    self.autocast_dtype, self.graph, scored_only=True)
        self._order_on_device = None

    @property
    def eager(self) -> bool:
        """Whether the next step runs eagerly: before the capture (Triton compiles and tunes there),
        on the CPU, or after the graph's check failed and the run fell back. An eager step calls
        every Triton autotuner, and Triton's ``Autotuner.run`` is not thread-safe (it holds the
        launch's arguments in ``self.nargs`` and clears them on return), so runs sharing a process
        take turns at eager steps."""
        return self.train_step.captured is None

    def train_step_once(self):
        """One optimizer step on the next batch of the epoch's order (a new order, drawn on the
        CPU from ``epoch_rng``, when the epoch runs out); the loss, not synchronised."""
        import torch

        if self.position + self.batch > self.order.numel():
            self.order, self.position = self.order[torch.randperm(self.order.numel(), generator=self.epoch_rng)], 0
            self._order_on_device = None
        if self._order_on_device is None:
            self._order_on_device = self.order.to(self.device)
        index = self._order_on_device[self.position:self.position + self.batch]
        self.position += self.batch
        loss = self.train_step(index)
        self.scheduler.step()
        self.step += 1
        return loss

    def evaluate(self) -> tuple[float, float]:
        """(accuracy, mean loss) on the held-out examples, under the training autocast."""
        return evaluate(self.model, self.val_ids, self.val_labels, self.batch, self.device, self.autocast)


def train_run(job: dict[str, Any]) -> dict[str, Any]:
    """Train one (recipe, impl, lr, seed) and return its row with the per-step curve."""
    import torch

    spec, device = job["spec"], job["device"]
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
        if job.get("quick_autotune", True):
            quick_autotuning()
    torch.set_num_threads(job.get("threads", 1))
    row = {k: job.get(k, "") for k in ("id", "setting", "recipe", "variant", "kind", "size", "impl", "lr", "seed")}
    row["commit"] = job.get("commit")
    lock = _LANE_LOCK  # runs sharing this process (--streams) take turns at everything but replays
    with lock:
        run = RunLoop(job["recipe"], job["impl"], spec, job["seed"], job["lr"], device,
                      graph=job.get("cuda_graph", True), dtype=job.get("dtype", "bf16"))
        model, cuda = run.model, device.startswith("cuda")
        row["state_size"] = state_size(run.config, spec["seq_len"])
        row["parameters"] = sum(p.numel() for p in model.parameters())
        curve, best, since_best = [], -1.0, 0
        start, earlier_seconds = time.perf_counter(), 0.0
        checkpoint = Path(job["path"]).with_suffix(".resume.pt") if job.get("path") else None
        if checkpoint is not None and checkpoint.is_file():  # a run cut by --run-seconds goes on where it stopped
            saved = torch.load(checkpoint, map_location=device, weights_only=False)
            if saved["schedule"] != _schedule(spec):
                raise ValueError(f"mqar: {checkpoint} was cut from a run with {saved['schedule']}, not "
                                 f"{_schedule(spec)}; delete it to start the run again")
            model.load_state_dict(saved["model"])
            run.optimizer.load_state_dict(saved["optimizer"])
            run.scheduler.load_state_dict(saved["scheduler"])
            run.order, run.position, run.step, curve = saved["order"], saved["position"], saved["step"], saved["curve"]
            best, since_best, earlier_seconds = saved["best"], saved["since_best"], saved["seconds"]
            row["first_loss"] = saved["first_loss"]
            run.epoch_rng.set_state(saved["rng"])
            if cuda and saved.get("cuda_rng") is not None:
                torch.cuda.set_rng_state(saved["cuda_rng"])
            row["resumed_at"] = run.step
    while run.step < spec["max_steps"]:
        if run.eager:  # warm-up, capture, or a run that fell back from the graph: see RunLoop.eager
            with lock:
                loss = run.train_step_once()
        else:
            loss = run.train_step_once()
        step = run.step
        if step == 1:  # paired rows (same seed, same weights) must start from the same loss
            row["first_loss"] = round(loss.item(), 6)
        if step % spec["eval_every"] == 0 or step == spec["max_steps"]:
            with lock:
                accuracy, val_loss = run.evaluate()
            curve.append({"step": step, "train_loss": round(loss.item(), 5), "val_loss": round(val_loss, 5),
                          "accuracy": accuracy, "seconds": round(time.perf_counter() - start, 1)})
            print(f"mqar: {row['id']}: step {step} accuracy {accuracy:.4f} val_loss {val_loss:.4f} "
                  f"({curve[-1]['seconds']} s)", flush=True)
            if not math.isfinite(val_loss):
                break
            best, since_best = (accuracy, 0) if accuracy > best else (best, since_best + 1)
            if best >= 0.999 or (spec.get("patience") and since_best >= spec["patience"]):
                break
            if run.step < spec["max_steps"] and out_of_time(spec, start):  # a run at its last step has ended
                row["stopped"] = (f"time limit {spec['run_seconds']} s" if spec.get("run_seconds") else
                                  "the invocation's --stop-at")
                if checkpoint is not None:  # the next invocation resumes from here
                    torch.save(dict(schedule=_schedule(spec), model=model.state_dict(),
                                    optimizer=run.optimizer.state_dict(), scheduler=run.scheduler.state_dict(),
                                    order=run.order, position=run.position, step=step, curve=curve, best=best,
                                    since_best=since_best, first_loss=row.get("first_loss"),
                                    seconds=earlier_seconds + time.perf_counter() - start,
                                    rng=run.epoch_rng.get_state(), cuda_rng=torch.cuda.get_rng_state() if cuda else None),
                               checkpoint)
                    row["resume_from"] = str(checkpoint)
                break
    if checkpoint is not None and not row.get("stopped") and checkpoint.is_file():
        checkpoint.unlink()  # finished: nothing to resume
    train_step = run.train_step
    row["cuda_graph"] = dict(used=train_step.captured is not None, check=train_step.check,
                             fallback=train_step.fallback) if run.graph else None
    row.update(status="ok", steps=run.step, accuracy=max(p["accuracy"] for p in curve),
               final_accuracy=curve[-1]["accuracy"], val_loss=curve[-1]["val_loss"],
               seconds=round(earlier_seconds + time.perf_counter() - start, 1), curve=curve)
    return row


def quick_autotuning(warmup_ms: float = 2.0, rep_ms: float = 10.0) -> None:
    """Shorten the timing behind every Triton autotuner of this process (fla's and hybridzoo's):
    ``triton.testing.do_bench`` defaults to ``warmup_ms`` / ``rep_ms`` instead of 25 / 100 ms per
    config. Triton's autotuners time each config with it (``driver.active.get_benchmarker()``,
    read at their first tuning, so call this before any kernel runs). fla's layers at MQAR's
    shapes have some twenty tuned kernels of tens of configs: minutes per process at Triton's
    defaults, with several processes sharing the GPU. The configs chosen may differ a little
    in speed; what is computed does not."""
    import triton.testing

    original = triton.testing.do_bench
    if getattr(original, "quick", None) is not None:
        return

    def do_bench(fn, warmup=warmup_ms, rep=rep_ms, *args, **kwargs):
        return original(fn, warmup, rep, *args, **kwargs)

    do_bench.quick = (warmup_ms, rep_ms)
    do_bench.__wrapped__ = original
    triton.testing.do_bench = do_bench


def _schedule(spec: dict[str, Any]) -> dict[str, Any]:
    """What a resumed run must share with the run it continues."""
    return {k: spec.get(k) for k in ("seq_len", "num_pairs", "vocab_size", "batch_size", "num_train",
                                     "max_steps", "warmup_steps", "eval_every", "patience", "overrides")}


def out_of_time(spec: dict[str, Any], start: float) -> bool:
    """Whether a run that started at ``start`` (``time.perf_counter``) is past ``--run-seconds``,
    or the invocation past ``--stop-at`` (``spec["deadline"]``, ``time.time()``); checked at each
    evaluation; tests replace it."""
    if spec.get("deadline") and time.time() > spec["deadline"]:
        return True
    return bool(spec.get("run_seconds")) and time.perf_counter() - start > spec["run_seconds"]


def _run_job(job: dict[str, Any]) -> dict[str, Any]:
    """Run a job in a worker and write its row; a failure becomes a row with the error. A job
    reached after the invocation's ``--stop-at`` is not started (no row: the next invocation runs it)."""
    path = Path(job["path"])
    if job["spec"].get("deadline") and time.time() > job["spec"]["deadline"]:
        print(f"mqar: {job['id']}: not started (past --stop-at)", flush=True)
        return {"id": job["id"], "status": "not started"}
    try:
        row = train_run(job)
    except Exception as error:  # one failed run must not lose the others
        row = {k: job.get(k, "") for k in ("id", "setting", "recipe", "variant", "kind", "size", "impl", "lr", "seed")}
        import traceback

        row.update(status="failed", error=f"{type(error).__name__}: {error}", traceback=traceback.format_exc()[-3000:])
    write_run(path, row)
    print(f"mqar: {row['id']}: {row['status']} accuracy {row.get('accuracy')} steps {row.get('steps')}", flush=True)
    return row


def _run_on_stream(job: dict[str, Any]) -> dict[str, Any]:
    """:func:`_run_job` on a CUDA stream of its own (a thread of :func:`run_streams`)."""
    if not job["device"].startswith("cuda"):
        return _run_job(job)
    import torch

    torch.cuda.set_device(torch.device(job["device"]))
    with torch.cuda.stream(torch.cuda.Stream()):
        return _run_job(job)


def run_streams(jobs: list[dict[str, Any]], streams: int) -> list[dict[str, Any]]:
    """Run ``jobs`` in one process, up to ``streams`` at once, each in a thread on its own CUDA
    stream. A tiny model's captured step leaves most of the GPU idle, and processes sharing a GPU
    take turns on it; streams of one process run their kernels side by side. Every run draws
    from its own generators, so its row equals the one it gets alone (tested on the CPU)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max(1, streams)) as pool:
        return list(pool.map(_run_on_stream, jobs))


# ---- the sweep ---------------------------------------------------------------------------------
def plan(args: argparse.Namespace, spec: dict[str, Any], device: str, runs_dir: Path,
         commit: str | None = None) -> tuple[list[dict[str, Any]], list[str]]:
    """The jobs still to run (not in ``runs_dir``) and the lines saying which rows are skipped;
    ``commit`` (the code's commit, as :func:`metadata` reads it) goes into every job's row."""
    jobs, skipped = [], []
    dtype = getattr(args, "dtype", "bf16")
    dtype_tag = "" if dtype == "bf16" else f"-{dtype}"
    gpus = max(1, __import__("torch").cuda.device_count()) if device.startswith("cuda") else 1
    for recipe in mqar_recipes():
        _, kind, size = recipe.split("-")
        if kind not in args.kinds or size not in args.sizes:
            continue
        for impl in args.impls:
            reason = reference_skip_reason(kind, device) if impl == "reference" else None
            if reason:
                skipped.append(f"{recipe} reference: {reason}")
                continue
            for lr in args.lrs:
                for seed in args.seeds:
                    tag = "".join(f"-{k.split('.', 1)[1]}={v}" for k, v in spec.get("overrides", {}).items()
                                  if k.split(".", 1)[0] == kind and impl == "hybridzoo")
                    tag += dtype_tag  # both implementations: a run of each in fp32
                    run_id = f"{args.setting}-{recipe}{tag}-{impl}-lr{lr:g}-s{seed}"
                    path = run_file(runs_dir, run_id)
                    if path.is_file() and not path.with_suffix(".resume.pt").is_file():
                        continue  # done (a run cut by --run-seconds left a checkpoint and is resumed)
                    dev = f"cuda:{len(jobs) % gpus}" if device.startswith("cuda") else device
                    jobs.append(dict(id=run_id, setting=args.setting, recipe=recipe, variant=tag, kind=kind, size=size,
                                     impl=impl, lr=lr, seed=seed, spec=spec, device=dev, path=str(path),
                                     threads=args.threads, cuda_graph=getattr(args, "cuda_graph", True),
                                     quick_autotune=not getattr(args, "full_autotune", False), dtype=dtype,
                                     commit=commit))
    return jobs, skipped


def run_file(runs_dir: Path, run_id: str) -> Path:
    """Where a run's row is kept: ``runs_dir/<id>.json``."""
    return runs_dir / f"{run_id}.json"


def write_run(path: Path, row: dict[str, Any]) -> None:
    """Write one run's row (one JSON line) to its run file."""
    path.write_text(json.dumps(row) + "\n")


def restore_run_files(runs: list[dict[str, Any]], runs_dir: Path) -> int:
    """Write the runs of a results file kept without its run folder (as committed results are)
    back as run files (:func:`run_file`), so that a new invocation into that file keeps them (the
    results are rebuilt from the folder) and does not run them again. Returns how many."""
    runs_dir.mkdir(parents=True, exist_ok=True)
    kept = [r for r in runs if r.get("id") and r.get("status") not in (None, "not started")]
    for run in kept:
        write_run(run_file(runs_dir, run["id"]), run)
    print(f"mqar: {len(kept)} runs of the results file written back to {runs_dir}", flush=True)
    return len(kept)


def merged_setting(previous: dict[str, Any] | None, spec: dict[str, Any], args: argparse.Namespace, device: str,
                   skipped: list[str], argv: list[str]) -> dict[str, Any]:
    """The setting's entry in the results JSON after this invocation: its schedule, and the union
    of the learning rates, seeds and command lines of every invocation that wrote into the file.
    Runs of one file share one schedule (step cap, evaluation, data): another one is refused."""
    import shlex

    command = "python -m benchmarks.mqar " + shlex.join(argv)
    entry = {**{k: v for k, v in spec.items() if k != "deadline"}, "lrs": sorted(set(args.lrs)), "seeds": sorted(set(args.seeds)), "device": device,
             "device_name": device_name(device), "skipped": skipped, "weight_decay": WEIGHT_DECAY,
             "betas": list(BETAS), "clip": CLIP, "min_lr_ratio": MIN_LR_RATIO, "argv": [command]}
    if not previous:
        return entry
    if _schedule(previous) != _schedule(spec):
        raise SystemExit(f"mqar: the file's {args.setting!r} runs have the schedule {_schedule(previous)}, not "
                         f"{_schedule(spec)}; give another --name")
    old_argv = previous.get("argv", [])
    if old_argv and not all(isinstance(a, str) and a.startswith("python ") for a in old_argv):
        old_argv = ["python -m benchmarks.mqar " + shlex.join(old_argv)]  # one invocation's tokens
    entry["lrs"] = sorted(set(previous.get("lrs", [])) | set(args.lrs))
    entry["seeds"] = sorted(set(previous.get("seeds", [])) | set(args.seeds))
    entry["skipped"] = list(dict.fromkeys(previous.get("skipped", []) + skipped))
    entry["argv"] = list(dict.fromkeys(old_argv + [command]))
    if previous.get("run_seconds") and not spec.get("run_seconds"):
        entry["run_seconds"] = previous["run_seconds"]
    return entry


def metadata() -> dict[str, Any]:
    import platform

    from benchmarks.meta import run_metadata

    run = run_metadata(("fla", "mamba_ssm", "transformers"))
    return {"commit": run["commit"], "dirty": run["dirty"], "torch": run["versions"]["torch"],
            "versions": run["versions"], "platform": platform.platform(), "argv": sys.argv[1:]}


def device_name(device: str) -> str:
    import torch

    if device.startswith("cuda") and torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(0)} x {torch.cuda.device_count()}"
    return f"CPU ({os.cpu_count()} cores)"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    floats = lambda s: [float(v) for v in s.split(",") if v]  # noqa: E731
    ints = lambda s: [int(v) for v in s.split(",") if v]  # noqa: E731
    names = lambda s: [v.strip() for v in s.split(",") if v.strip()]  # noqa: E731
    parser = argparse.ArgumentParser(prog="python -m benchmarks.mqar", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--setting", choices=sorted(SETTINGS), default="cpu-smoke")
    parser.add_argument("--kinds", type=names, default=list(KINDS), help="comma separated mixer kinds")
    parser.add_argument("--sizes", type=names, default=["s", "l"], help="s, l or s,l")
    parser.add_argument("--impls", type=names, default=list(IMPLS), help="hybridzoo, reference or both")
    parser.add_argument("--lrs", type=floats, default=[1e-3, 3e-3, 1e-2])
    parser.add_argument("--seeds", type=ints, default=[0, 1, 2])
    parser.add_argument("--max-steps", dest="max_steps", type=int, default=None)
    parser.add_argument("--eval-every", dest="eval_every", type=int, default=None)
    parser.add_argument("--patience", type=int, default=None,
                        help="stop a run after this many evaluations without a higher accuracy (0: off; "
                             "default: the setting's, off on the GPU)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KIND.FIELD=VALUE",
                        help="a mixer setting for the hybridzoo model, e.g. gdn.decay_init=multiscale "
                             "(YAML value; in the run's name and row)")
    parser.add_argument("--run-seconds", dest="run_seconds", type=float, default=None,
                        help="stop a run at its first evaluation past this many seconds (row marked 'stopped'); "
                             "it leaves <run>.resume.pt, and the next invocation with the same settings goes on "
                             "from there")
    parser.add_argument("--full-autotune", dest="full_autotune", action="store_true",
                        help="time each autotuner config for Triton's default 25 + 100 ms (default: 2 + 10 ms, "
                             "see quick_autotuning)")
    parser.add_argument("--stop-at", dest="stop_at", type=float, default=None,
                        help="seconds after the start of this invocation: runs stop (and leave a checkpoint) at "
                             "their first evaluation past it, and runs not started by then are left for the next "
                             "invocation")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    parser.add_argument("--workers", type=int, default=1, help="processes side by side (spread over the GPUs)")
    parser.add_argument("--streams", type=int, default=1,
                        help="runs side by side in each worker process, each on its own CUDA stream (their "
                             "captured steps overlap on the GPU; see run_streams)")
    parser.add_argument("--traceback-after", dest="traceback_after", type=float, default=None,
                        help="print every thread's Python stack to stderr after this many seconds (for a sweep "
                             "that overruns its time)")
    parser.add_argument("--no-cuda-graph", dest="cuda_graph", action="store_false",
                        help="run every CUDA training step eagerly (default: capture the step as a CUDA graph "
                             "after 3 eager steps, checked against an eager step; see benchmarks/graph_step.py)")
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16",
                        help="bf16: training and evaluation under bf16 autocast on CUDA (the benchmark's "
                             "setting); fp32: float32 throughout, for both implementations (runs tagged -fp32)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads per process")
    parser.add_argument("--out-dir", dest="out_dir", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--name", default=None, help="file stem (default: <today>-mqar)")
    parser.add_argument("--render-only", dest="render_only", action="store_true",
                        help="rewrite the JSON, table and plot from the run files")
    parser.add_argument("--note", action="append", default=[])
    args = parser.parse_args(argv)
    for what, values, allowed in (("--kinds", args.kinds, KINDS), ("--sizes", args.sizes, ("s", "l")),
                                  ("--impls", args.impls, IMPLS)):
        bad = [v for v in values if v not in allowed]
        if bad:
            parser.error(f"{what}: {bad} not among {list(allowed)}")
    if len(args.seeds) < 3 and args.setting != "cpu-smoke":
        print("mqar: fewer than 3 seeds: the medians are not Zoology's protocol", file=sys.stderr)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.traceback_after:
        import faulthandler

        faulthandler.dump_traceback_later(args.traceback_after, exit=False)
    name = args.name or f"{datetime.date.today().isoformat()}-mqar"
    runs_dir = args.out_dir / f"{name}-runs"
    json_path = args.out_dir / f"{name}.json"
    results = json.loads(json_path.read_text()) if json_path.is_file() else {
        "date": datetime.date.today().isoformat(), "what": "MQAR: hybridzoo mixers beside reference layers",
        "settings": {}, "notes": []}
    results["notes"] = list(dict.fromkeys(results.get("notes", []) + args.note))
    if args.render_only:
        print("\n".join(str(p) for p in write_outputs(collect(results, runs_dir), args.out_dir, name)))
        return 0
    if not runs_dir.is_dir() and results.get("runs"):
        restore_run_files(results["runs"], runs_dir)

    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("mqar: --device cuda but no CUDA device is available (use --device cpu)")
    spec = dict(SETTINGS[args.setting])
    for key in ("max_steps", "eval_every", "patience", "run_seconds"):
        if getattr(args, key) is not None:
            spec[key] = getattr(args, key)
    if args.stop_at is not None:
        spec["deadline"] = time.time() + args.stop_at
    if args.overrides:
        import yaml

        spec["overrides"] = {k: yaml.safe_load(v) for k, v in (o.split("=", 1) for o in args.overrides)}
    runs_dir.mkdir(parents=True, exist_ok=True)
    meta = metadata()
    jobs, skipped = plan(args, spec, device, runs_dir, commit=meta["commit"] + ("+dirty" if meta.get("dirty") else ""))
    for line in skipped:
        print(f"mqar: skipped: {line}", flush=True)
    results.setdefault("meta", meta)
    results["settings"][args.setting] = merged_setting(results["settings"].get(args.setting), spec, args, device,
                                                       skipped, sys.argv[1:] if argv is None else argv)
    print(f"mqar: {len(jobs)} runs to do on {device} with {args.workers} worker(s)", flush=True)
    if args.streams > 1:
        if args.workers <= 1:
            run_streams(jobs, args.streams)
        else:
            import functools
            import multiprocessing

            groups = [jobs[i::args.workers] for i in range(args.workers)]
            with multiprocessing.get_context("spawn").Pool(args.workers, maxtasksperchild=1) as pool:
                for _ in pool.imap_unordered(functools.partial(run_streams, streams=args.streams), groups):
                    pass
    elif args.workers <= 1:
        for job in jobs:
            _run_job(job)
    else:
        import multiprocessing

        with multiprocessing.get_context("spawn").Pool(args.workers, maxtasksperchild=1) as pool:
            for _ in pool.imap_unordered(_run_job, jobs):
                pass
    print("\n".join(str(p) for p in write_outputs(collect(results, runs_dir), args.out_dir, name)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
