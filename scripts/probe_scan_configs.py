"""Time the selective scan's forward and backward kernels at one time block over channel blocks
and warps, on CUDA: which launch settings are fastest at a shape.

    python scripts/probe_scan_configs.py --block-t 16 --shape 2,16384,2048,16
    python scripts/probe_scan_configs.py --block-t 32 --shape 8,2048,1536,16 --out probe.jsonl
    python scripts/probe_scan_configs.py --block-t 16 --module my_scan_variant --kernels bwd
    python scripts/probe_scan_configs.py --block-t 16 --bwd-block-t 8 --bwd-prefetch --blocks 4 --warps 1 --kernels bwd

``--module`` names a module laid out as ``hybridzoo.kernels.triton.selective_scan`` (the default),
so that a rewritten kernel can be timed beside the packaged one on the same inputs. ``--maxnreg
0,168`` also times each backward setting with its registers capped (0: no cap; each row's
``maxnreg``). ``--segments`` (1 by default: each program runs a whole sequence) sets the time
segments of the module's grids. ``--fwd-dt-given`` / ``--bwd-dt-given`` 0 or 1 set whether the
training forward and the backward read the step sizes from a buffer computed before them (the
module's ``FWD_DT_GIVEN``, ``BWD_DT_GIVEN``); the backward's time includes that kernel.

bf16 inputs as the Mamba-1 mixer passes them (z, D, delta_bias, softplus), float32 A. Autotuning
is off; each setting is forced through ``selective_scan._config``. Prints one JSON line per
setting (``{"kernel": "fwd"|"bwd", "block_t", "block_d", "warps", "ms"}`` or an ``"error"``),
appended to ``--out`` when given. The forward is timed with its per-block states stored (as in
training); the backward alone, from one stored forward. Checks each backward's gradients against
the fixed setting's (relative error), so a setting that computes something else shows.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--block-t", type=int, required=True)
    parser.add_argument("--bwd-block-t", type=int, default=None,
                        help="the backward's time block (a power of two dividing --block-t; default --block-t): "
                             "the forward stores a state every that many tokens")
    parser.add_argument("--bwd-prefetch", action="store_true",
                        help="the backward loads each time block's inputs during the block before it "
                             "(default: it does not; the library chooses by the grid)")
    parser.add_argument("--shape", default="2,16384,2048,16", help="B,T,Dm,N")
    parser.add_argument("--blocks", default="4,8,16,32", help="channel blocks to try")
    parser.add_argument("--warps", default="1,2,4,8", help="num_warps to try")
    parser.add_argument("--kernels", default="fwd,bwd", help="which kernels to vary")
    parser.add_argument("--maxnreg", default="0", help="register caps to try for the backward (0: none)")
    parser.add_argument("--max-per-thread", type=int, default=128,
                        help="skip settings whose tile puts more elements on a thread")
    parser.add_argument("--module", default="hybridzoo.kernels.triton.selective_scan",
                        help="the module whose selective_scan and _config are timed")
    parser.add_argument("--segments", type=int, default=1,
                        help="time segments: 1 (the grid as is, the default) or more")
    parser.add_argument("--fwd-dt-given", type=int, choices=(0, 1), default=None,
                        help="1: the training forward reads the step sizes from a buffer computed before it; "
                             "0: it computes them (default: the module's FWD_DT_GIVEN)")
    parser.add_argument("--bwd-dt-given", type=int, choices=(0, 1), default=None,
                        help="the same for the backward (default: the module's BWD_DT_GIVEN)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    import triton

    import importlib

    from hybridzoo.kernels.triton import launch

    module = importlib.import_module(args.module)

    launch.AUTOTUNE = False
    if hasattr(module, "SEGMENTS"):
        module.SEGMENTS = args.segments
    for kind in ("fwd", "bwd"):
        flag = getattr(args, f"{kind}_dt_given")
        if flag is not None:
            setattr(module, f"{kind.upper()}_DT_GIVEN", bool(flag))
    batch, length, dm, n = (int(v) for v in args.shape.split(","))
    gen = torch.Generator(device="cuda").manual_seed(0)

    def rand(*shape, scale=1.0, dtype=torch.bfloat16):
        return (torch.randn(*shape, device="cuda", generator=gen) * scale).to(dtype)

    u, delta, z = rand(batch, length, dm), rand(batch, length, dm, scale=0.5), rand(batch, length, dm)
    B, C = rand(batch, length, n), rand(batch, length, n)
    A = -torch.arange(1, n + 1, device="cuda", dtype=torch.float32).repeat(dm, 1)
    D, bias = torch.ones(dm, device="cuda"), rand(dm, scale=0.5, dtype=torch.float32) - 4.0
    leaves = [t.requires_grad_() for t in (u, delta, A, B, C, D, z, bias)]
    dy = rand(batch, length, dm)
    base = dict(module._config(training=True), bwd_maxnreg=0)  # 0: no register cap

    def run(cfg):
        module._config = lambda training, block_n=16, cfg=cfg: cfg
        y, _ = module.selective_scan(u, delta, A, B, C, D, z, bias, delta_softplus=True)
        return y

    reference = torch.autograd.grad(run(base), leaves, dy)
    rows = []
    blocks = [int(v) for v in args.blocks.split(",")]
    warps = [int(v) for v in args.warps.split(",")]
    caps = [int(v) for v in args.maxnreg.split(",")]
    for kernel in args.kernels.split(","):
        for bd, w, cap in [(bd, w, cap) for bd in blocks for w in warps for cap in (caps if kernel == "bwd" else [0])]:
            block_t = (args.bwd_block_t or args.block_t) if kernel == "bwd" else args.block_t
            per_thread = block_t * bd * triton.next_power_of_2(n) // (32 * w)
            if not 4 <= per_thread <= args.max_per_thread:
                continue  # tiles of fewer elements than threads, or a long register spill
            cfg = dict(base, block_t=args.block_t, bwd_block_t=args.bwd_block_t or args.block_t,
                       bwd_prefetch=args.bwd_prefetch, **{f"{kernel}_block_d": bd, f"{kernel}_warps": w})
            if kernel == "bwd":
                cfg["bwd_maxnreg"] = cap
            row = dict(kernel=kernel, block_t=args.block_t, bwd_block_t=args.bwd_block_t or args.block_t,
                       bwd_prefetch=args.bwd_prefetch, block_d=bd, warps=w, maxnreg=cap, shape=args.shape,
                       module=args.module, segments=args.segments,
                       fwd_dt_given=getattr(module, "FWD_DT_GIVEN", None), bwd_dt_given=getattr(module, "BWD_DT_GIVEN", None))
            try:
                if kernel == "fwd":
                    ms = triton.testing.do_bench(lambda: run(cfg), warmup=5, rep=40)
                else:
                    y = run(cfg)
                    grads = torch.autograd.grad(y, leaves, dy, retain_graph=True)
                    err = max(float((g.float() - r.float()).norm() / r.float().norm().clamp_min(1e-30))
                              for g, r in zip(grads, reference))
                    row["max_rel_err_vs_fixed"] = err
                    ms = triton.testing.do_bench(
                        lambda: torch.autograd.grad(y, leaves, dy, retain_graph=True), warmup=5, rep=40)
                row["ms"] = round(ms, 4)
            except Exception as exc:  # noqa: BLE001 - a setting that cannot compile is a result
                row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "a") as fh:
            for row in rows:
                fh.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
