"""Count the host-side work of one training step, per layer, on the CPU: aten ops and Triton launches.

Small models at the model table's shape can be bound by the host (Python, op dispatch, kernel
launches) rather than by the GPU: the GPU then waits between kernels. This script runs a
recipe's training step (forward, loss, backward; bf16 autocast) on CPU tensors through the same
code path a GPU takes (``backend="triton"``, the fused layer passes forced on), with every Triton
kernel launch counted and skipped (the values are garbage; only the calls matter), and counts the
aten ops dispatched. One layer's share is the difference between the model at 1 and at 2 layers.

    python scripts/host_ops.py mqar-mamba2-l mqar-retnet-l
    python scripts/host_ops.py gla-340m --tokens 64 --top 15

Prints, per recipe: aten ops and Triton launches of the whole step at 1 layer and per added
layer, the host time of the step with kernels skipped (CPU; a relative figure), and with
``--top`` the most frequent ops of one layer. Views are counted (they cost dispatch time too).

``--peer`` counts the model table's peer of a pair of ``python -m benchmarks models`` (fla's
GLA, RetNet and Gated DeltaNet models: their Triton kernels skipped the same way, autotuning
answered without timing) beside hybridzoo's model of that pair. Both sides then run with bf16
weights and no autocast (fla's fused layers do not run under CPU autocast), and the loss is a
log-sum-exp of the logits (fla's fused cross-entropy needs a GPU)::

    python scripts/host_ops.py retnet-340m gated-deltanet-340m --peer
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import sys
import time
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"  # before Triton is imported: kernels go through the interpreter's launcher
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _model(recipe: str, n_layers: int, side: str, tiny: bool = False):
    """``(step, vocab_size)``: ``step(ids)`` (the model at ``step.model``) runs one forward and backward of the recipe's
    ``HybridLM`` (``side`` "ours", bf16 autocast) or, with ``side`` "peer" or "ours-bf16", of the
    model table's pair of that name on one side (bf16 weights, no autocast). Each step first sets
    the parameters' gradients to None, as a training loop's ``zero_grad`` does, so that the counts
    hold no accumulation into ``.grad`` from the step before."""
    import dataclasses

    import torch

    from hybridzoo import HybridLM

    if side == "ours":
        model = HybridLM.from_recipe(recipe, backend="triton", n_layers=n_layers)

        def step(ids):
            model.zero_grad(set_to_none=True)  # as a training loop does: no gradient accumulated into .grad
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(ids, labels=ids)[2]
            loss.backward()

        step.model = model
        return step, model.config.vocab_size
    from benchmarks.models import PAIRS

    if recipe not in PAIRS:
        raise SystemExit(f"host_ops: --peer takes a pair of the model table ({', '.join(PAIRS)}), got {recipe!r}")
    config = dataclasses.replace(PAIRS[recipe].ours(tiny), n_layers=n_layers, backend="triton")
    if side == "peer":
        model = PAIRS[recipe].peer(config)[0].to(torch.bfloat16)
        logits = lambda ids: model(input_ids=ids).logits  # noqa: E731
    else:
        model = HybridLM(config).to(torch.bfloat16)
        logits = lambda ids: model(ids)[0]  # noqa: E731

    def step(ids):
        model.zero_grad(set_to_none=True)
        logits(ids).float().logsumexp(-1).mean().backward()

    step.model = model
    return step, config.vocab_size


@contextlib.contextmanager
def kernels_skipped(on_launch=None):
    """Within: every Triton launch through the interpreter skipped (its kernel's name passed to
    ``on_launch`` when given), the fused norms taken as a GPU takes them, and the benchmarks of
    fla's autotuners stubbed, so that what runs is the host's work alone; all restored on exit."""
    from triton.runtime import autotuner, interpreter

    from hybridzoo.kernels import fused

    def skipped_launch(self, *args, **kwargs):
        if on_launch is not None:
            on_launch(getattr(self.fn, "__name__", str(self.fn)))

    real_launch, real_force, real_bench = interpreter.GridExecutor.__call__, fused.FORCE, autotuner.Autotuner._bench
    interpreter.GridExecutor.__call__, fused.FORCE = skipped_launch, True
    autotuner.Autotuner._bench = lambda self, *args, config=None, **kwargs: [1.0, 1.0, 1.0]  # fla's autotuners
    try:
        yield
    finally:
        interpreter.GridExecutor.__call__, fused.FORCE = real_launch, real_force
        autotuner.Autotuner._bench = real_bench


def count_step(recipe: str, n_layers: int, tokens: int, side: str = "ours", tiny: bool = False) -> dict:
    """aten op counts, Triton launch counts and the host seconds of one training step."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    launches: collections.Counter = collections.Counter()

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.counts: collections.Counter = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.counts[str(func.overloadpacket)] += 1
            return func(*args, **(kwargs or {}))

    with kernels_skipped(lambda name: launches.update([name])):
        torch.manual_seed(0)
        step, vocab_size = _model(recipe, n_layers, side, tiny)
        ids = torch.randint(0, vocab_size, (1, tokens))
        step(ids)  # first call: imports, caches
        launches.clear()
        with Ops() as ops:
            step(ids)
        counted = dict(launches)
        start = time.perf_counter()
        for _ in range(3):
            step(ids)
        seconds = (time.perf_counter() - start) / 3
    return {"aten": dict(ops.counts), "launches": counted, "seconds": seconds}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipes", nargs="+")
    parser.add_argument("--tokens", type=int, default=64, help="tokens of the one sequence (64)")
    parser.add_argument("--top", type=int, default=0, help="also list one layer's N most frequent ops")
    parser.add_argument("--peer", action="store_true", help="pairs of the model table: hybridzoo's model and "
                        "its peer, both with bf16 weights and no autocast")
    parser.add_argument("--tiny", action="store_true", help="with --peer: the pairs' tiny CPU-smoke shapes")
    args = parser.parse_args(argv)
    for recipe, side in ((r, s) for r in args.recipes for s in (("ours-bf16", "peer") if args.peer else ("ours",))):
        one, two = (count_step(recipe, n, args.tokens, side, args.tiny) for n in (1, 2))
        layer = {op: two["aten"].get(op, 0) - one["aten"].get(op, 0) for op in two["aten"]}
        layer_launches = sum(two["launches"].values()) - sum(one["launches"].values())
        name = recipe if side == "ours" else f"{recipe} {'peer' if side == 'peer' else 'hybridzoo'}"
        print(f"{name}: step at 1 layer {sum(one['aten'].values())} aten ops, "
              f"{sum(one['launches'].values())} Triton launches; each added layer "
              f"{sum(layer.values())} aten ops, {layer_launches} Triton launches, "
              f"{(two['seconds'] - one['seconds']) * 1e3:.1f} ms of host time (CPU, kernels skipped)", flush=True)
        if args.top:
            top = sorted(((n, op) for op, n in layer.items() if n), reverse=True)[:args.top]
            print("  " + ", ".join(f"{op.removeprefix('aten.')} {n}" for n, op in top))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
