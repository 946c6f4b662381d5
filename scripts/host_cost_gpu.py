"""Host time per call on a CUDA GPU, at shapes so small that the GPU keeps up with the host.

A small model's training step can wait on the host: Python, op dispatch and kernel launches.
:mod:`scripts.host_ops` counts that work on a CPU with the kernels skipped; this script times it
where it runs, on the GPU machine's own CPU, including what the CPU count cannot see: Triton's
launch path (argument binding, the autotuner's lookup, the driver call) and the CUDA driver.

Each figure is the wall time of ``--calls`` back-to-back calls with one synchronisation at the
end, divided by the calls, median of ``--rounds``: at these shapes (1 sequence of 16 tokens) each
call's GPU work is shorter than its host work, so the figure is the host's.

    python scripts/host_cost_gpu.py --out host-cost.json

Rows: a bare Triton launch of a 22-argument kernel, the same through Triton's autotuner with its
choice cached, and a bare ``torch.add`` (the floor of each kind of launch); our conv and
selective-scan wrappers; one Mamba-1 and one Mamba-2 layer's forward and backward (d_model 768),
again with each cached autotuner choice looked up by Triton's own autotuner instead of
:func:`hybridzoo.kernels.triton.launch.cached_choice`, with the share of it spent inside
:func:`hybridzoo.kernels.triton.launch.run` and the launches per step; and, where mamba_ssm and
causal_conv1d are installed, their conv, scan and layers at the same shapes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _noop(p, a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15, a16, a17, a18, a19,
          X: tl.constexpr, Y: tl.constexpr):
    """A kernel that does nothing: its launch is Triton's launch path alone."""
    pass


def per_call(fn, calls: int, rounds: int, warmup: int = 10) -> float:
    """Median over ``rounds`` of the wall microseconds per call of ``calls`` calls of ``fn`` with
    one CUDA synchronisation after them."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    figures = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        figures.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(figures)


def layer_step(layer, x):
    """One forward and backward of ``layer`` on ``x`` under bf16 autocast."""
    import torch

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = layer(x)
            y = y[0] if isinstance(y, tuple) else y
        y.float().sum().backward()

    return step


def measure(calls: int, rounds: int, log=print) -> dict:
    """Every row: ``{name: microseconds per call}`` (and launches per step for our layers)."""
    import torch

    from hybridzoo.kernels import selective_scan_grads, selective_scan_saved
    from hybridzoo.kernels.triton import launch
    from hybridzoo.kernels.triton.conv import conv_forward
    from hybridzoo.layers.mamba1 import Mamba1
    from hybridzoo.layers.mamba2 import Mamba2, Mamba2Config

    dev = torch.device("cuda")
    rows: dict = {}

    def row(name, value):
        rows[name] = value
        log(f"{name:58s} {value:9.1f}" + (" us" if "launches" not in name else ""))

    x = torch.zeros(16, device=dev)
    ints = list(range(3, 23))
    row("bare Triton launch (22 arguments)", per_call(lambda: _noop[(1,)](x, *ints, X=1, Y=2), calls, rounds))
    tuned = triton.autotune([triton.Config({}, num_warps=1), triton.Config({}, num_warps=2)], key=["a0"])(_noop)
    row("autotuned Triton launch (22 arguments, choice cached)",
        per_call(lambda: tuned[(1,)](x, *ints, X=1, Y=2), calls, rounds))
    row("bare torch.add", per_call(lambda: x.add(1), calls, rounds))

    torch.manual_seed(0)
    batch, length, dm, n = 1, 16, 64, 16
    xc = torch.randn(batch, length, dm, device=dev, dtype=torch.bfloat16)
    w, b = torch.randn(dm, 4, device=dev), torch.randn(dm, device=dev)
    row("ours: conv_forward", per_call(lambda: conv_forward(xc, w, b, None, True), calls, rounds))
    u, delta, z = (torch.randn(batch, length, dm, device=dev, dtype=torch.bfloat16) for _ in range(3))
    A, D, bias = -torch.rand(dm, n, device=dev), torch.randn(dm, device=dev), torch.randn(dm, device=dev)
    B, C = (torch.randn(batch, length, n, device=dev, dtype=torch.bfloat16) for _ in range(2))
    y, _, saved = selective_scan_saved(u, delta, A, B, C, D, z, bias, True, None, backend="triton")
    row("ours: selective_scan_saved", per_call(
        lambda: selective_scan_saved(u, delta, A, B, C, D, z, bias, True, None, backend="triton"), calls, rounds))
    row("ours: selective_scan_grads", per_call(
        lambda: selective_scan_grads(u, delta, A, B, C, D, z, bias, None, saved, y, None, delta_softplus=True,
                                     backend="triton"), calls, rounds))

    x_in = torch.randn(1, length, 768, device=dev, requires_grad=True)
    inner = launch.run
    spent = {"s": 0.0, "n": 0}

    def timed_run(*args, **kwargs):
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            spent["s"] += time.perf_counter() - start
            spent["n"] += 1

    for name, layer in (("Mamba-1", Mamba1(768)), ("Mamba-2", Mamba2(768, Mamba2Config(head_dim=16, d_state=16,
                                                                                          chunk_size=32)))):
        step = layer_step(layer.to(dev), x_in)
        row(f"ours: {name} layer forward + backward", per_call(step, max(1, calls // 3), rounds))
        own_lookup, launch.cached_choice = launch.cached_choice, lambda *args: None
        try:
            row(f"ours: {name} layer, Triton's own autotuner lookup", per_call(step, max(1, calls // 3), rounds))
        finally:
            launch.cached_choice = own_lookup
        launch.run, spent["s"], spent["n"] = timed_run, 0.0, 0
        try:
            for _ in range(max(1, calls // 3)):
                step()
            torch.cuda.synchronize()
        finally:
            launch.run = inner
        row(f"ours: {name} layer, inside launch.run per step", spent["s"] / max(1, calls // 3) * 1e6)
        row(f"ours: {name} layer, Triton launches per step", spent["n"] / max(1, calls // 3))

    try:
        from causal_conv1d import causal_conv1d_fn
        from mamba_ssm.modules.mamba2 import Mamba2 as PeerMamba2
        from mamba_ssm.modules.mamba_simple import Mamba as PeerMamba
        from mamba_ssm.ops.selective_scan_interface import selective_scan_fn
    except ImportError as error:
        log(f"peer rows skipped: {error}")
        return rows
    xt = xc.transpose(1, 2)
    row("mamba_ssm: causal_conv1d_fn", per_call(lambda: causal_conv1d_fn(xt, w, b, activation="silu"), calls, rounds))
    ut, dt_, zt, Bt, Ct = (t.transpose(1, 2).contiguous() for t in (u, delta, z, B, C))
    row("mamba_ssm: selective_scan_fn forward", per_call(
        lambda: selective_scan_fn(ut, dt_, A, Bt, Ct, D, zt, bias, True), calls, rounds))
    row("mamba_ssm: Mamba-1 layer forward + backward",
        per_call(layer_step(PeerMamba(768).to(dev), x_in), max(1, calls // 3), rounds))
    row("mamba_ssm: Mamba-2 layer forward + backward",
        per_call(layer_step(PeerMamba2(768, d_state=16, headdim=16, chunk_size=32).to(dev), x_in),
                 max(1, calls // 3), rounds))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=300, help="calls per round (layers: a third of it)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default=None, help="also write the rows, with the run's metadata, as JSON")
    args = parser.parse_args(argv)
    if args.calls < 1 or args.rounds < 1:
        parser.error("--calls and --rounds must be at least 1")
    import torch

    if not torch.cuda.is_available():
        print("host_cost_gpu: needs a CUDA GPU (it times the host's work of launching on one); on a CPU, "
              "python scripts/host_ops.py counts that work instead", file=sys.stderr)
        return 2
    from hybridzoo.utils import run_metadata

    rows = measure(args.calls, args.rounds)
    if args.out:
        Path(args.out).write_text(json.dumps({**run_metadata(("triton", "mamba_ssm", "causal_conv1d")), "calls": args.calls,
                                              "rounds": args.rounds, "microseconds": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
