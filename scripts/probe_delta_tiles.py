"""Probe the delta rule's state-kernel launch settings on a GPU, each in its own process (a fault
kills only its case): bf16 outputs and gradients against the float64 reference (T 2000, a reset,
NaN-poisoned outputs, CUDA_LAUNCH_BLOCKING=1 so a fault names its kernel), then fwd+bwd time at
fla's anchor shape (B2 T16384 H16, K = V = 128) for the K-128 settings that passed (without
CUDA_LAUNCH_BLOCKING).

    python3 scripts/probe_delta_tiles.py [--out DIR] [--trees .,/tmp/old] [--heads 128,256]

``--trees``: source trees to import (e.g. a copy with an older ``delta_rule*.py``); each setting is
``BV,num_warps,num_stages`` for both state kernels (``default``: the op's own launch); the other
kernels keep the tree's own launch. Session 8 found with its first form (a shell loop over the
same case code: benchmarks/results/2026-11-30-probe-delta-tiles-h200.jsonl) that 32-wide value
tiles fault or give wrong outputs for bf16 at K 128 and 256; the wrong outputs came from the
output kernel's 32-wide tiles of that tree's launch, which trees from 384904a on no longer use
(see delta_rule.value_tile_floor).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import traceback
from pathlib import Path

SETTINGS = ("default", "32,4,1", "64,4,1", "64,8,1", "64,8,2")


def case(root: str, head: int, setting: str, mode: str) -> dict:
    """One case in this process: ``mode`` "check" (vs float64) or "time" (fwd+bwd medians, ms)."""
    sys.path.insert(0, root)
    import torch
    import triton

    from hybridzoo.kernels.triton import delta_rule, launch
    from tests.kernels.triton.test_delta_rule import check, make_inputs

    launch.AUTOTUNE = False
    launch.POISON_OUTPUTS = mode == "check"
    if setting != "default":
        bv, warps, stages = map(int, setting.split(","))
        own = delta_rule._Config.state_launch

        def state_launch(cfg):
            grid, consts, _ = own(cfg)
            return grid, consts, dict(BV=bv, num_warps=warps, num_stages=stages)

        delta_rule._Config.state_launch = state_launch
    result = dict(root=root, K=head, setting=setting, mode=mode, module=delta_rule.__file__)
    try:
        if mode == "check":
            inputs = make_inputs(B=1, T=2000, Hk=2, H=4, K=head, V=head, dtype=torch.bfloat16, seed=3,
                                 resets=(700,))
            result["errors"] = {k: float(v) for k, v in check(inputs, chunk_size=64, tol=1e-2).items()}
        else:
            B, T, H = 2, 16384, 16
            x = lambda *s: torch.randn(*s, device="cuda")  # noqa: E731
            q = x(B, T, H, head).bfloat16().requires_grad_()
            k = torch.nn.functional.normalize(x(B, T, H, head), dim=-1).bfloat16().requires_grad_()
            v = x(B, T, H, head).bfloat16().requires_grad_()
            log_a = (-0.5 * torch.rand(B, T, H, device="cuda")).requires_grad_()
            beta = torch.rand(B, T, H, device="cuda").bfloat16().requires_grad_()
            do = x(B, T, H, head).bfloat16()
            fwd = lambda: delta_rule.chunk_delta_rule(q, k, v, log_a, beta, chunk_size=64)[0]  # noqa: E731
            result["fwdbwd_ms"] = triton.testing.do_bench(lambda: fwd().backward(do), return_mode="median")
            result["fwd_ms"] = triton.testing.do_bench(fwd, return_mode="median")
        result["ok"] = True
    except Exception as error:  # noqa: BLE001 - the probe records every failure
        result.update(ok=False, error=repr(error)[:400],
                      where=[line for line in traceback.format_exc().splitlines() if "hybridzoo/" in line][-3:])
    return result


def spawn(args: list[str], gpu: int, log: Path) -> tuple[subprocess.Popen, Path, list[str]]:
    """Run one case (``[root, K, setting, mode]``) in its own process on ``gpu``, output to ``log``;
    correctness cases with CUDA_LAUNCH_BLOCKING=1 (a fault names its launch), timed ones without."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=str(gpu))
    if args[3] == "check":
        env["CUDA_LAUNCH_BLOCKING"] = "1"
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, __file__, "--case", *args], env=env, stdout=out,
                                stderr=subprocess.STDOUT)
    return proc, log, args


def collect(procs: list[tuple[subprocess.Popen, Path, list[str]]], timeout: float) -> list[dict]:
    """Each case's RESULT line, or a failure naming the case when its process left none."""
    results = []
    for proc, log, (root, head, setting, mode) in procs:
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        lines = [line for line in log.read_text().splitlines() if line.startswith("RESULT ")]
        results.append(json.loads(lines[-1][7:]) if lines else
                       dict(root=root, K=int(head), setting=setting, mode=mode, ok=False,
                            error=f"no result (exit {proc.returncode}; see {log})"))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="probe_delta_tiles", help="output folder (logs, results.jsonl)")
    parser.add_argument("--trees", default=".", help="comma-separated source trees")
    parser.add_argument("--heads", default="128,256")
    parser.add_argument("--parallel", type=int, default=9, help="check processes at once (compiles)")
    parser.add_argument("--case", nargs=4, metavar=("ROOT", "K", "SETTING", "MODE"))
    args = parser.parse_args()
    if args.case:
        root, head, setting, mode = args.case
        print("RESULT " + json.dumps(case(root, int(head), setting, mode)), flush=True)
        return
    import torch

    gpus = max(1, torch.cuda.device_count())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cases = [(str(Path(t).resolve()), h, s) for h in args.heads.split(",") for t in args.trees.split(",")
             for s in SETTINGS]
    results = []
    for start in range(0, len(cases), args.parallel):  # correctness: many processes at once
        batch = cases[start:start + args.parallel]
        procs = [spawn([r, h, s, "check"], (start + i) % gpus, out / f"check_{start + i}.log")
                 for i, (r, h, s) in enumerate(batch)]
        results += collect(procs, 300)
    timed = [(r["root"], str(r["K"]), r["setting"]) for r in results if r.get("ok") and r["K"] == 128]
    for start in range(0, len(timed), gpus):  # timing: one process per GPU
        procs = [spawn([*c, "time"], i, out / f"time_{start + i}.log")
                 for i, c in enumerate(timed[start:start + gpus])]
        results += collect(procs, 180)
    (out / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in results))
    for r in results:
        tail = r.get("fwdbwd_ms") or (max(r["errors"].values()) if r.get("errors") else r.get("error", ""))
        print(f"{Path(r.get('root', '?')).name:>10} K{r.get('K')} {r.get('setting', '?'):>8} {r.get('mode', '?'):>5} "
              f"{'ok' if r.get('ok') else 'FAIL'} {str(tail)[:90]}")


if __name__ == "__main__":
    main()
