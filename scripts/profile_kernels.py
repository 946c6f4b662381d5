"""GPU time per kernel of one forward+backward of our op and of its anchor (torch.profiler).

Uses the cases of ``benchmarks/kernels.py`` (same shapes and inputs): after warm-up (compiles
and autotuning done), ``--iters`` forward+backward passes run under the profiler; the table lists
every CUDA kernel with its launches and milliseconds per pass, for ours and for the anchor. It
says which kernel limits an op (e.g. a sequential state pass against chunk-parallel work).

    python scripts/profile_kernels.py --only delta --out prof.txt
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.kernels import fwd_bwd_step, selected_cases  # noqa: E402


def kernel_times(fn, grads, inputs, iters: int) -> dict[str, tuple[float, float]]:
    """``{kernel name: (launches per pass, ms per pass)}`` over ``iters`` forward+backward passes."""
    step = fwd_bwd_step(fn, grads, inputs)
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            step()
        torch.cuda.synchronize()
    table: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            entry = table[event.name]
            entry[0] += 1
            entry[1] += event.device_time_total / 1e3
    return {name: (n / iters, ms / iters) for name, (n, ms) in table.items()}


def render(title: str, times: dict[str, tuple[float, float]]) -> str:
    total = sum(ms for _, ms in times.values()) or float("nan")
    lines = [f"{title}: {total:.3f} ms of kernels per forward+backward",
             f"  {'ms':>8s} {'share':>6s} {'launches':>8s}  kernel"]
    for name, (n, ms) in sorted(times.items(), key=lambda kv: -kv[1][1]):
        lines.append(f"  {ms:8.3f} {ms / total:6.1%} {n:8.1f}  {name[:110]}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=None, help="comma-separated substrings of case names")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--no-anchor", dest="anchor", action="store_false")
    parser.add_argument("--out", default=None, help="also write the tables to this file")
    args = parser.parse_args()
    blocks: list[str] = []

    def add(block: str) -> None:
        """Print the block and rewrite ``--out`` with every block so far: a run cut short (a
        time limit, a fault in a later case) keeps the tables it had."""
        blocks.append(block)
        print(block, flush=True)
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text("\n\n".join(blocks) + "\n")

    add(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    for name, shape, build in selected_cases(args.only):
        try:
            ours, anchor, grads, inputs, _ = build()
            add(render(f"{name} {shape} -- ours", kernel_times(ours, grads, inputs, args.iters)))
            if args.anchor:
                add(render(f"{name} {shape} -- anchor", kernel_times(anchor, grads, inputs, args.iters)))
        except Exception as error:  # one case failing must not hide the others
            add(f"{name} {shape}: {type(error).__name__}: {error}"[:400])
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
