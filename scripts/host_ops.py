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
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"  # before Triton is imported: kernels go through the interpreter's launcher
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def count_step(recipe: str, n_layers: int, tokens: int) -> dict:
    """aten op counts, Triton launch counts and the host seconds of one training step."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from triton.runtime import interpreter

    from hybridzoo import HybridLM
    from hybridzoo.kernels import fused

    launches: collections.Counter = collections.Counter()

    def skipped_launch(self, *args, **kwargs):
        launches[getattr(self.fn, "__name__", str(self.fn))] += 1

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.counts: collections.Counter = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.counts[str(func.overloadpacket)] += 1
            return func(*args, **(kwargs or {}))

    real_launch, real_force = interpreter.GridExecutor.__call__, fused.FORCE
    interpreter.GridExecutor.__call__, fused.FORCE = skipped_launch, True
    try:
        torch.manual_seed(0)
        model = HybridLM.from_recipe(recipe, backend="triton", n_layers=n_layers)
        ids = torch.randint(0, model.config.vocab_size, (1, tokens))

        def step():
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(ids, labels=ids)[2]
            loss.backward()

        step()  # first call: imports, caches
        launches.clear()
        with Ops() as ops:
            step()
        counted = dict(launches)
        start = time.perf_counter()
        for _ in range(3):
            step()
        seconds = (time.perf_counter() - start) / 3
    finally:
        interpreter.GridExecutor.__call__, fused.FORCE = real_launch, real_force
    return {"aten": dict(ops.counts), "launches": counted, "seconds": seconds}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipes", nargs="+")
    parser.add_argument("--tokens", type=int, default=64, help="tokens of the one sequence (64)")
    parser.add_argument("--top", type=int, default=0, help="also list one layer's N most frequent ops")
    args = parser.parse_args(argv)
    for recipe in args.recipes:
        one, two = count_step(recipe, 1, args.tokens), count_step(recipe, 2, args.tokens)
        layer = {op: two["aten"].get(op, 0) - one["aten"].get(op, 0) for op in two["aten"]}
        layer_launches = sum(two["launches"].values()) - sum(one["launches"].values())
        print(f"{recipe}: step at 1 layer {sum(one['aten'].values())} aten ops, "
              f"{sum(one['launches'].values())} Triton launches; each added layer "
              f"{sum(layer.values())} aten ops, {layer_launches} Triton launches, "
              f"{(two['seconds'] - one['seconds']) * 1e3:.1f} ms of host time (CPU, kernels skipped)", flush=True)
        if args.top:
            top = sorted(((n, op) for op, n in layer.items() if n), reverse=True)[:args.top]
            print("  " + ", ".join(f"{op.removeprefix('aten.')} {n}" for n, op in top))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
