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
every seed of ``--seeds`` (at least 3); a run stops at ``--max-steps`` or when the held-out
accuracy has not risen for ``--patience`` evaluations (or reached 0.999). A row reports the best
learning rate's median accuracy over the seeds (the best accuracy of each run).

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
mamba_ssm rows without a mamba_ssm build.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
KINDS = ("mamba1", "mamba2", "gla", "retnet", "gdn", "attn")
IMPLS = ("hybridzoo", "reference")
REFERENCE_NAMES = {"gdn": "fla GatedDeltaNet", "gla": "fla GatedLinearAttention",
                   "retnet": "fla MultiScaleRetention", "mamba1": "mamba_ssm Mamba",
                   "mamba2": "mamba_ssm Mamba2", "attn": "transformers LlamaAttention (sdpa)"}
NEEDS_CUDA = {"gdn", "gla", "retnet", "mamba1", "mamba2"}  # reference layers without a CPU path

# Zoology's MQAR settings (vocab 8192, 100k training examples, power_a 0.01) at two lengths, and a
# CPU smoke setting that checks the machinery in seconds.
SETTINGS: dict[str, dict[str, Any]] = {
    "gpu": dict(seq_len=256, num_pairs=16, vocab_size=8192, batch_size=64, num_train=100_000, num_val=1000,
                max_steps=8000, warmup_steps=100, eval_every=250, patience=4),
    "gpu-long": dict(seq_len=512, num_pairs=64, vocab_size=8192, batch_size=64, num_train=100_000, num_val=1000,
                     max_steps=16000, warmup_steps=200, eval_every=500, patience=4),
    "cpu-smoke": dict(seq_len=32, num_pairs=4, vocab_size=64, batch_size=8, num_train=2000, num_val=64,
                      max_steps=12, warmup_steps=2, eval_every=6, patience=4, chunk_size=16),
}
CHUNKED = ("mamba2", "gla", "retnet", "gdn")
WEIGHT_DECAY, BETAS, MIN_LR_RATIO, CLIP = 0.1, (0.9, 0.95), 0.1, 1.0


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


# ---- the reference layers ----------------------------------------------------------------------
def reference_skip_reason(kind: str, device: str) -> str | None:
    """Why the reference layer of ``kind`` cannot run here (None: it can)."""
    import importlib.util

    if kind in NEEDS_CUDA and not device.startswith("cuda"):
        return f"{REFERENCE_NAMES[kind]} needs CUDA (no CPU path); skipped on {device}"
    package = {"gdn": "fla", "gla": "fla", "retnet": "fla", "mamba1": "mamba_ssm", "mamba2": "mamba_ssm",
               "attn": "transformers"}[kind]
    if importlib.util.find_spec(package) is None:
        return f"{REFERENCE_NAMES[kind]} needs the {package} package (pip install {package})"
    return None


def _normal_init(layer, std: float, types: tuple) -> None:
    """A model class's init of its layer, as fla's and transformers' ``_init_weights`` apply it:
    weights of the modules of ``types`` ~ N(0, std²), their biases 0, in ``modules()`` order."""
    from torch import nn

    for module in layer.modules():
        if isinstance(module, types):
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)


class ReferenceMixer:
    """Factory of an ``nn.Module`` that holds a reference layer in a hybridzoo ``Block``:
    ``forward(x [B, T, d_model], state=None) -> (y [B, T, d_model], None)`` (no state: training only)."""

    @staticmethod
    def build(kind: str, config):
        import torch
        from torch import nn

        d = config.d_model
        c = getattr(config, kind)
        if kind in ("gdn", "gla", "retnet"):
            from benchmarks.fla_backward import allow_fla_gated_backward

            allow_fla_gated_backward()
        if kind == "gdn":
            from fla.layers import GatedDeltaNet

            layer = GatedDeltaNet(hidden_size=d, head_dim=c.head_k_dim, num_heads=c.num_k_heads,
                                  num_v_heads=c.num_v_heads, expand_v=c.head_v_dim / c.head_k_dim,
                                  conv_size=c.conv_size, norm_eps=c.norm_eps)
            call = lambda m, x: m(x)[0]  # noqa: E731
        elif kind in ("gla", "retnet"):
            from fla.layers import GatedLinearAttention, MultiScaleRetention

            common = dict(mode="chunk", hidden_size=d, expand_k=c.expand_k, expand_v=c.expand_v,
                          num_heads=c.num_heads, num_kv_heads=c.num_kv_heads, use_short_conv=c.use_short_conv,
                          conv_size=c.conv_size, conv_bias=c.conv_bias, use_output_gate=c.use_output_gate,
                          norm_eps=c.norm_eps)
            if kind == "gla":
                layer = GatedLinearAttention(gate_logit_normalizer=c.gate_logit_normalizer,
                                             gate_low_rank_dim=c.gate_low_rank_dim, clamp_min=c.clamp_min, **common)
            else:
                layer = MultiScaleRetention(**common)
            _normal_init(layer, c.initializer_range, (nn.Linear, nn.Conv1d))  # FLAPreTrainedModel._init_weights
            call = lambda m, x: m(x)[0]  # noqa: E731
        elif kind == "mamba1":
            from mamba_ssm import Mamba

            layer = Mamba(d_model=d, d_state=c.d_state, d_conv=c.d_conv, expand=c.expand, dt_rank=c.dt_rank,
                          dt_min=c.dt_min, dt_max=c.dt_max, dt_init=c.dt_init, dt_scale=c.dt_scale,
                          dt_init_floor=c.dt_init_floor, conv_bias=c.conv_bias, bias=c.bias)
            call = lambda m, x: m(x)  # noqa: E731
        elif kind == "mamba2":
            from mamba_ssm import Mamba2

            layer = Mamba2(d_model=d, d_state=c.d_state, d_conv=c.d_conv, expand=c.expand, headdim=c.head_dim,
                           ngroups=c.n_groups, chunk_size=c.chunk_size, A_init_range=tuple(c.A_init_range),
                           dt_min=c.dt_min, dt_max=c.dt_max, dt_init_floor=c.dt_init_floor,
                           conv_bias=c.conv_bias, bias=c.bias)
            call = lambda m, x: m(x)  # noqa: E731
        elif kind == "attn":
            from transformers import LlamaConfig
            from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding

            if c.qk_norm or c.output_gate:
                raise ValueError("benchmarks.mqar: the Llama reference has no q/k norms and no output gate")
            heads = c.n_heads
            llama = LlamaConfig(hidden_size=d, num_attention_heads=heads, num_key_value_heads=c.n_kv_heads or heads,
                                head_dim=c.head_dim or d // heads, rope_theta=c.rope_base, attention_bias=c.bias,
                                max_position_embeddings=1 << 16, initializer_range=c.initializer_range)
            llama._attn_implementation = "sdpa"
            layer = LlamaAttention(llama, layer_idx=0)
            _normal_init(layer, c.initializer_range, (nn.Linear,))  # LlamaPreTrainedModel._init_weights
            rotary = LlamaRotaryEmbedding(llama)

            def call(m, x):
                positions = torch.arange(x.shape[1], device=x.device)
                mask = None  # full causal attention: SDPA's is_causal
                if c.window is not None:  # key j visible from query i iff 0 <= i - j < window
                    gap = positions[:, None] - positions[None, :]
                    mask = torch.zeros(gap.shape, dtype=x.dtype, device=x.device).masked_fill(
                        (gap < 0) | (gap >= c.window), float("-inf"))[None, None]
                return m(x, position_embeddings=rotary(x, positions[None]), attention_mask=mask)[0]
        else:
            raise ValueError(f"benchmarks.mqar: unknown mixer kind {kind!r}")

        extra = rotary if kind == "attn" else None  # its table moves with the model (no host copy per call)

        class Wrapped(nn.Module):
            def __init__(self):
                super().__init__()
                self.layer = layer
                if extra is not None:
                    self.rotary = extra

            def forward(self, x, state=None):
                return call(self.layer, x), None

        return Wrapped()


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


def train_run(job: dict[str, Any]) -> dict[str, Any]:
    """Train one (recipe, impl, lr, seed) and return its row with the per-step curve."""
    import contextlib

    import torch

    from benchmarks.graph_step import TrainStep, make_optimizer
    from hybridzoo.training.module import WarmupCosine, param_groups

    spec, device = job["spec"], job["device"]
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
        if job.get("quick_autotune", True):
            quick_autotuning()
    torch.set_num_threads(job.get("threads", 1))
    row = {k: job.get(k, "") for k in ("id", "setting", "recipe", "variant", "kind", "size", "impl", "lr", "seed")}
    row["commit"] = job.get("commit")
    model, config = build_model(job["recipe"], job["impl"], spec, job["seed"])
    model.to(device)
    row["state_size"] = state_size(config, spec["seq_len"])
    row["parameters"] = sum(p.numel() for p in model.parameters())
    cuda = device.startswith("cuda")
    graph = cuda and job.get("cuda_graph", True)
    optimizer = make_optimizer(param_groups(model, WEIGHT_DECAY), job["lr"], BETAS, device, graph)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, WarmupCosine(spec["warmup_steps"], spec["max_steps"], MIN_LR_RATIO))
    autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if cuda else contextlib.nullcontext
    train_ids, train_labels, val_ids, val_labels = batches_of(spec, job["seed"])
    order = torch.randperm(train_ids.shape[0], generator=torch.Generator().manual_seed(job["seed"]))
    batch, curve, best, since_best = spec["batch_size"], [], -1.0, 0
    start, step, position, earlier_seconds = time.perf_counter(), 0, 0, 0.0
    checkpoint = Path(job["path"]).with_suffix(".resume.pt") if job.get("path") else None
    if checkpoint is not None and checkpoint.is_file():  # a run cut by --run-seconds goes on where it stopped
        saved = torch.load(checkpoint, map_location=device, weights_only=False)
        if saved["schedule"] != _schedule(spec):
            raise ValueError(f"mqar: {checkpoint} was cut from a run with {saved['schedule']}, not "
                             f"{_schedule(spec)}; delete it to start the run again")
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        scheduler.load_state_dict(saved["scheduler"])
        order, position, step, curve = saved["order"], saved["position"], saved["step"], saved["curve"]
        best, since_best, earlier_seconds = saved["best"], saved["since_best"], saved["seconds"]
        row["first_loss"] = saved["first_loss"]
        torch.set_rng_state(saved["rng"])
        if cuda and saved.get("cuda_rng") is not None:
            torch.cuda.set_rng_state(saved["cuda_rng"])
        row["resumed_at"] = step
    # The training set and the epoch's order live on the device: a step's batch is gathered there.
    # A copy from pageable host memory each step would wait for the GPU to finish the previous
    # step, so the host could never run ahead of these launch-bound models.
    train_ids, train_labels, order_on_device = train_ids.to(device), train_labels.to(device), order.to(device)
    train_step = TrainStep(model, optimizer, train_ids, train_labels, CLIP, torch.bfloat16 if cuda else None, graph,
                           scored_only=True)
    while step < spec["max_steps"]:
        if position + batch > order.numel():  # a new epoch: a new order (drawn on the CPU, as before)
            order, position = order[torch.randperm(order.numel())], 0
            order_on_device = order.to(device)
        index = order_on_device[position:position + batch]
        position += batch
        loss = train_step(index)
        scheduler.step()
        step += 1
        if step == 1:  # paired rows (same seed, same weights) must start from the same loss
            row["first_loss"] = round(loss.item(), 6)
        if step % spec["eval_every"] == 0 or step == spec["max_steps"]:
            accuracy, val_loss = evaluate(model, val_ids, val_labels, batch, device, autocast)
            curve.append({"step": step, "train_loss": round(loss.item(), 5), "val_loss": round(val_loss, 5),
                          "accuracy": accuracy, "seconds": round(time.perf_counter() - start, 1)})
            if not math.isfinite(val_loss):
                break
            best, since_best = (accuracy, 0) if accuracy > best else (best, since_best + 1)
            if best >= 0.999 or since_best >= spec["patience"]:
                break
            if out_of_time(spec, start):
                row["stopped"] = (f"time limit {spec['run_seconds']} s" if spec.get("run_seconds") else
                                  "the invocation's --stop-at")
                if checkpoint is not None:  # the next invocation resumes from here
                    torch.save(dict(schedule=_schedule(spec), model=model.state_dict(),
                                    optimizer=optimizer.state_dict(), scheduler=scheduler.state_dict(),
                                    order=order, position=position, step=step, curve=curve, best=best,
                                    since_best=since_best, first_loss=row.get("first_loss"),
                                    seconds=earlier_seconds + time.perf_counter() - start,
                                    rng=torch.get_rng_state(), cuda_rng=torch.cuda.get_rng_state() if cuda else None),
                               checkpoint)
                    row["resume_from"] = str(checkpoint)
                break
    if checkpoint is not None and not row.get("stopped") and checkpoint.is_file():
        checkpoint.unlink()  # finished: nothing to resume
    row["cuda_graph"] = dict(used=train_step.captured is not None, check=train_step.check,
                             fallback=train_step.fallback) if graph else None
    row.update(status="ok", steps=step, accuracy=max(p["accuracy"] for p in curve),
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
        row.update(status="failed", error=f"{type(error).__name__}: {error}")
    path.write_text(json.dumps(row) + "\n")
    print(f"mqar: {row['id']}: {row['status']} accuracy {row.get('accuracy')} steps {row.get('steps')}", flush=True)
    return row


# ---- the sweep ---------------------------------------------------------------------------------
def plan(args: argparse.Namespace, spec: dict[str, Any], device: str, runs_dir: Path
         ) -> tuple[list[dict[str, Any]], list[str]]:
    """The jobs still to run (not in ``runs_dir``) and the lines saying which rows are skipped."""
    jobs, skipped = [], []
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
                    run_id = f"{args.setting}-{recipe}{tag}-{impl}-lr{lr:g}-s{seed}"
                    path = runs_dir / f"{run_id}.json"
                    if path.is_file() and not path.with_suffix(".resume.pt").is_file():
                        continue  # done (a run cut by --run-seconds left a checkpoint and is resumed)
                    dev = f"cuda:{len(jobs) % gpus}" if device.startswith("cuda") else device
                    jobs.append(dict(id=run_id, setting=args.setting, recipe=recipe, variant=tag, kind=kind, size=size,
                                     impl=impl, lr=lr, seed=seed, spec=spec, device=dev, path=str(path),
                                     threads=args.threads, cuda_graph=getattr(args, "cuda_graph", True),
                                     quick_autotune=not getattr(args, "full_autotune", False),
                                     commit=getattr(args, "commit", None)))
    return jobs, skipped


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per (setting, recipe, impl): the best learning rate by median accuracy over the
    seeds, its median, min and max, and the seeds counted. Runs stopped by the time limit
    (``--run-seconds``) are left out."""
    groups: dict[tuple, dict[float, list[dict]]] = {}
    for row in rows:
        if row.get("status") == "ok" and not row.get("stopped"):  # a run cut by --run-seconds is not counted
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
                  f"{spec['batch_size']}, at most {spec['max_steps']} steps (stop when the held-out accuracy has "
                  f"not risen for {spec['patience']} evaluations every {spec['eval_every']} steps), learning rates "
                  f"{', '.join(f'{lr:g}' for lr in spec.get('lrs', []))}, seeds {spec.get('seeds')}; "
                  f"device {spec.get('device_name', '?')}", "",
                  "| recipe | state size | hybridzoo median (min-max) | lr | reference | reference median (min-max) | lr |",
                  "|---|---:|---:|---:|---|---:|---:|"]
        rows = [s for s in summary if s["setting"] == setting]
        for recipe in dict.fromkeys(s["recipe"] for s in rows):
            cell = {s["impl"]: s for s in rows if s["recipe"] == recipe}
            hz, ref = cell.get("hybridzoo"), cell.get("reference")
            fmt = lambda s: (f"{s['median_accuracy']:.3f} ({s['min_accuracy']:.3f}-{s['max_accuracy']:.3f})"  # noqa: E731
                             if s else "-")
            any_row = hz or ref
            lines.append(f"| {recipe} | {any_row['state_size']:,} | {fmt(hz)} | {hz['best_lr'] if hz else '-'} | "
                         f"{REFERENCE_NAMES.get(any_row['kind'], '?')} | {fmt(ref)} | {ref['best_lr'] if ref else '-'} |")
        lines.append("")
    lines += paired_table(results.get("runs", []))
    for note in results.get("notes", []):
        lines.append(f"- {note}")
    return "\n".join(lines) + "\n"


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
        lines.append(f"| {key[0]} | {key[1]} | {key[2]:g} | {key[3]} | {hz.get('first_loss')} / {ref.get('first_loss')} "
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
    """Fold every run file of ``runs_dir`` into ``results`` (runs and summary)."""
    rows = [json.loads(p.read_text()) for p in sorted(runs_dir.glob("*.json"))] if runs_dir.is_dir() else []
    results["runs"] = rows
    results["summary"] = summarize(rows)
    return results


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
    parser.add_argument("--patience", type=int, default=None)
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
    parser.add_argument("--no-cuda-graph", dest="cuda_graph", action="store_false",
                        help="run every CUDA training step eagerly (default: capture the step as a CUDA graph "
                             "after 3 eager steps, checked against an eager step; see benchmarks/graph_step.py)")
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
    args.commit = meta["commit"] + ("+dirty" if meta.get("dirty") else "")
    jobs, skipped = plan(args, spec, device, runs_dir)
    for line in skipped:
        print(f"mqar: skipped: {line}", flush=True)
    results.setdefault("meta", meta)
    results["settings"][args.setting] = merged_setting(results["settings"].get(args.setting), spec, args, device,
                                                       skipped, sys.argv[1:] if argv is None else argv)
    print(f"mqar: {len(jobs)} runs to do on {device} with {args.workers} worker(s)", flush=True)
    if args.workers <= 1:
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
