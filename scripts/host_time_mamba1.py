"""Host time of one Mamba-1 layer's training step on the CPU, its kernels skipped: the one-node
step (:class:`hybridzoo.layers.mamba1_inner.Mamba1Inner`) against the recomputed body.

A small model's GPU step waits on the host (Python, op dispatch, launches). This runs the layer's
forward and backward under bf16 autocast on CPU tensors through the GPU's code path
(``backend="triton"``, Triton's interpreter with every kernel launch skipped), so what is timed is
the host's work alone. The layer is narrow (``--d-model``), so that the CPU's own matmuls stay
small beside it. Prints the median milliseconds per step of each path, ``--rounds`` times.

    python scripts/host_time_mamba1.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"  # before Triton is imported: kernels go through the interpreter's launcher
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def median_ms(one_node: bool, d_model: int, tokens: int, steps: int) -> float:
    """Median host milliseconds of a forward and backward of one Mamba-1 layer."""
    import torch

    from hybridzoo.layers.mamba1 import Mamba1

    torch.manual_seed(0)
    mixer = Mamba1(d_model, backend="triton")
    if not one_node:
        mixer._fused_inner = lambda xz, state: False
    x = torch.randn(1, tokens, d_model, requires_grad=True)

    def step():
        mixer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y, _ = mixer.mix(x, None)
        y.float().sum().backward()

    for _ in range(10):
        step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--steps", type=int, default=300, help="timed steps per path and round")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    import torch
    from triton.runtime import interpreter

    torch.set_num_threads(1)
    interpreter.GridExecutor.__call__ = lambda self, *a, **k: None  # kernels skipped: host work only
    for _ in range(args.rounds):
        one = median_ms(True, args.d_model, args.tokens, args.steps)
        general = median_ms(False, args.d_model, args.tokens, args.steps)
        print(f"one node {one:.3f} ms, recomputed body {general:.3f} ms per layer step (host, kernels skipped)",
              flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
