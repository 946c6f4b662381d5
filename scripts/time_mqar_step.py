"""Time one MQAR training step, eager against replayed from a CUDA graph, per recipe and implementation.

    python scripts/time_mqar_step.py                       # every -l recipe, hybridzoo and reference
    python scripts/time_mqar_step.py --recipes mqar-gdn-l --impls hybridzoo

One process, Zoology's ``gpu`` setting (batch 64, T 256, vocabulary 8192), bf16 autocast, AdamW:
``--steps`` timed steps after ``--warmup``, each on a batch drawn from 512 training examples;
prints ms per step, the loss after the last step for both (the same model, batches and seed), and
the captured step's check against an eager step (:mod:`benchmarks.graph_step`). Needs CUDA.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import benchmarks.mqar as bench  # noqa: E402
from benchmarks.graph_step import TrainStep, make_optimizer  # noqa: E402
from hybridzoo.training.module import param_groups  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipes", default="mqar-attn-l,mqar-gla-l,mqar-gdn-l,mqar-mamba1-l,mqar-mamba2-l,mqar-retnet-l")
    parser.add_argument("--impls", default="hybridzoo,reference")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("time_mqar_step: needs CUDA")
    spec = dict(bench.SETTINGS["gpu"], num_train=512, num_val=8)
    ids, labels = [t.cuda() for t in bench.batches_of(spec, 0)[:2]]
    print("| recipe | impl | eager ms/step | graph ms/step | speed-up | loss eager / graph | graph check |")
    print("|---|---|---:|---:|---:|---|---|")
    for recipe in args.recipes.split(","):
        kind = recipe.split("-")[1]
        for impl in args.impls.split(","):
            reason = bench.reference_skip_reason(kind, "cuda") if impl == "reference" else None
            if reason:
                print(f"| {recipe} | {impl} | skipped: {reason} |||||")
                continue
            times, losses, check = {}, {}, None
            for graph in (False, True):
                model, _ = bench.build_model(recipe, impl, spec, 0)
                model.cuda()
                optimizer = make_optimizer(param_groups(model, bench.WEIGHT_DECAY), 3e-3, bench.BETAS, "cuda", graph)
                step = TrainStep(model, optimizer, ids, labels, bench.CLIP, torch.bfloat16, graph)
                generator = torch.Generator(device="cuda").manual_seed(0)
                batches = [torch.randint(0, ids.shape[0], (spec["batch_size"],), device="cuda", generator=generator)
                           for _ in range(args.warmup + args.steps)]
                for i, index in enumerate(batches):
                    if i == args.warmup:
                        torch.cuda.synchronize()
                        start = time.perf_counter()
                    loss = step(index)
                torch.cuda.synchronize()
                times[graph] = (time.perf_counter() - start) / args.steps * 1e3
                losses[graph] = float(loss)
                if graph:
                    check = step.check if step.captured is not None else step.fallback
            print(f"| {recipe} | {impl} | {times[False]:.2f} | {times[True]:.2f} | {times[False] / times[True]:.1f}x | "
                  f"{losses[False]:.5f} / {losses[True]:.5f} | {check} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
