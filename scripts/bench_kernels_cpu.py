"""CPU benchmark: our reference ``chunk_delta_rule`` vs transformers' ``torch_chunk_gated_delta_rule``.

Forward + backward of the gated delta rule in float32 on the same inputs (keys L2-normalised,
``loss = (o * random_grad).sum()``, gradients to q, k, v, g, beta), median wall time of several
runs after warm-up, runs of the two interleaved. transformers' pure-PyTorch function is called
directly (unwrapped: the module-level name dispatches to fla when fla is installed).

    python scripts/bench_kernels_cpu.py [--out PATH] [--runs 5] [--warmup 1]

Writes JSON (date, commit, device, versions, shapes, timings, ratio) to
``benchmarks/results/<date>-cpu-delta-rule.json`` by default.
"""

from __future__ import annotations

import argparse
import datetime
import inspect
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hybridzoo.kernels.reference.delta_rule import chunk_delta_rule  # noqa: E402
from hybridzoo.utils import rel_err, run_metadata  # noqa: E402


def time_fwd_bwd(fn, inputs, grad_out) -> tuple[float, torch.Tensor, list[torch.Tensor]]:
    """One forward + backward; returns (seconds, output, input gradients)."""
    for x in inputs:
        x.grad = None
    start = time.perf_counter()
    o = fn(*inputs)
    (o * grad_out).sum().backward()
    elapsed = time.perf_counter() - start
    return elapsed, o.detach(), [x.grad for x in inputs]


def main() -> None:
    today = datetime.date.today().isoformat()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / f"{today}-cpu-delta-rule.json"))
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=2048)
    args = parser.parse_args()

    import transformers
    from transformers.models.qwen3_next import modeling_qwen3_next

    theirs_fn = inspect.unwrap(modeling_qwen3_next.torch_chunk_gated_delta_rule)  # the pure-PyTorch path

    B, T, H, D, chunk_size = 1, args.seq_len, 4, 64, 64
    torch.manual_seed(0)
    q = torch.randn(B, T, H, D)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, D), dim=-1)
    v = torch.randn(B, T, H, D)
    g = torch.nn.functional.logsigmoid(torch.randn(B, T, H) + 3.0)  # log decays, mostly near 0
    beta = torch.rand(B, T, H)
    grad_out = torch.randn(B, T, H, D)
    inputs = [x.requires_grad_() for x in (q, k, v, g, beta)]

    def ours(q, k, v, g, beta):
        return chunk_delta_rule(q, k, v, g, beta, chunk_size=chunk_size)[0]

    def theirs(q, k, v, g, beta):
        return theirs_fn(q, k, v, g, beta, chunk_size=chunk_size, use_qk_l2norm_in_kernel=False)[0]

    times: dict[str, list[float]] = {"ours": [], "transformers": []}
    results = {}
    for i in range(args.warmup + args.runs):
        for name, fn in (("ours", ours), ("transformers", theirs)):  # interleaved: same noise for both
            elapsed, o, grads = time_fwd_bwd(fn, inputs, grad_out)
            if i >= args.warmup:
                times[name].append(elapsed)
            results[name] = (o, grads)

    out_err = rel_err(results["ours"][0], results["transformers"][0])
    grad_errs = {n: rel_err(a, b) for n, a, b in
                 zip(("q", "k", "v", "g", "beta"), results["ours"][1], results["transformers"][1])}
    ours_s = statistics.median(times["ours"])
    theirs_s = statistics.median(times["transformers"])
    ratio = theirs_s / ours_s

    print(f"gated delta rule fwd+bwd, float32, B={B} T={T} H={H} D={D} chunk={chunk_size}, "
          f"{torch.get_num_threads()} threads, median of {args.runs}")
    print(f"  ours (hybridzoo reference chunk_delta_rule): {ours_s * 1e3:8.2f} ms")
    print(f"  transformers torch_chunk_gated_delta_rule:   {theirs_s * 1e3:8.2f} ms")
    print(f"  speed-up (transformers / ours): {ratio:.2f}x")
    print(f"  rel err of outputs {out_err:.2e}; of gradients "
          + ", ".join(f"{n} {e:.1e}" for n, e in grad_errs.items()))

    run = run_metadata(("transformers",))
    record = {
        "benchmark": "cpu-delta-rule",
        "date": today,
        "commit": run["commit"],
        "worktree_dirty": run["dirty"],
        "device": {"cpu": run["device"], "cores": os.cpu_count(), "torch_threads": torch.get_num_threads()},
        "versions": run["versions"],
        "op": "gated delta rule, forward + backward (grads to q, k, v, g, beta), float32",
        "shapes": {"B": B, "T": T, "H": H, "K": D, "V": D, "chunk_size": chunk_size},
        "runs": args.runs,
        "warmup": args.warmup,
        "ours": {"impl": "hybridzoo.kernels.reference.delta_rule.chunk_delta_rule",
                 "median_s": ours_s, "times_s": times["ours"]},
        "anchor": {"impl": "transformers.models.qwen3_next.modeling_qwen3_next.torch_chunk_gated_delta_rule "
                           "(pure PyTorch, use_qk_l2norm_in_kernel=False, keys L2-normalised by the caller)",
                   "median_s": theirs_s, "times_s": times["transformers"]},
        "ratio_anchor_over_ours": ratio,
        "rel_err_output": out_err,
        "rel_err_grads": grad_errs,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out}")
    if out_err > 1e-5:
        sys.exit(f"outputs disagree: rel err {out_err:.2e}")


if __name__ == "__main__":
    main()
