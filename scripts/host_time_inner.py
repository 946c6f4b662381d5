"""Host time of one Mamba layer's training step on the CPU, its kernels skipped: the one-node
step (:class:`hybridzoo.layers.mamba1_inner.Mamba1Inner`, :class:`hybridzoo.layers.mamba2_inner.Mamba2Inner`)
against the recomputed body.

A small model's GPU step waits on the host (Python, op dispatch, launches). This runs the layer's
forward and backward under bf16 autocast on CPU tensors through the GPU's code path
(``backend="triton"``, the fused norm forced on, Triton's interpreter with every kernel launch
skipped), so what is timed is the host's work alone. The layer is narrow (``--d-model``), so that
the CPU's own matmuls stay small beside it. Prints the median milliseconds per step of each path,
``--rounds`` times.

    python scripts/host_time_inner.py                  # Mamba-1
    python scripts/host_time_inner.py --mixer mamba2
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


def build(mixer: str, d_model: int):
    """One layer of ``mixer`` (``mamba1``: d_state 16; ``mamba2``: d_state 16, head_dim 16) on our
    Triton backend."""
    if mixer == "mamba1":
        from hybridzoo.layers.mamba1 import Mamba1

        return Mamba1(d_model, backend="triton")
    from hybridzoo.layers.mamba2 import Mamba2, Mamba2Config

    return Mamba2(d_model, Mamba2Config(d_state=16, head_dim=16), backend="triton")


def median_ms(one_node: bool, d_model: int, tokens: int, steps: int, kind: str = "mamba1") -> float:
    """Median host milliseconds of a forward and backward of one layer of ``kind``."""
    import torch

    torch.manual_seed(0)
    mixer = build(kind, d_model)
    if not one_node:
        mixer._fused_inner = lambda inputs, params, state: False
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
    parser.add_argument("--mixer", choices=("mamba1", "mamba2"), default="mamba1")
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--steps", type=int, default=300, help="timed steps per path and round")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    import torch

    from host_ops import kernels_skipped  # this script's folder

    torch.set_num_threads(1)
    with kernels_skipped():  # host work only, the fused norms as a GPU runs them
        for _ in range(args.rounds):
            one = median_ms(True, args.d_model, args.tokens, args.steps, args.mixer)
            general = median_ms(False, args.d_model, args.tokens, args.steps, args.mixer)
            print(f"one node {one:.3f} ms, recomputed body {general:.3f} ms per layer step (host, kernels "
                  "skipped)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
