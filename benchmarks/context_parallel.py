"""Overhead of context parallelism: a HybridLM training step (forward + backward) with its sequence
sharded over P processes, against the same step unsharded in one process.

    python -m benchmarks context_parallel --device cuda --ranks 2 --recipe tiny-hybrid --seq-len 8192
    python -m benchmarks context_parallel --device cpu --ranks 2 --seq-len 64 --steps 2   # smoke

On one GPU the P processes share it (gloo, messages staged through host memory, since NCCL refuses
two ranks on one device): the ratio then measures what sharding adds (messages, corrections,
smaller kernels) rather than a speed-up. Prints one JSON object (and writes it with ``--out``):
median step times of both runs, their ratio, and the bytes per step that
:func:`hybridzoo.parallel.costs.model_bytes_per_step` predicts.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time


def _parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--recipe", default="tiny-hybrid")
    parser.add_argument("--layers", default=None, help="override the recipe's mixer pattern")
    parser.add_argument("--n-layers", type=int, default=None)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float64"])
    parser.add_argument("--method", default="scan", choices=["scan", "sequential"])
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", default=None, help="also write the JSON result here")
    return parser.parse_args(argv)


def _model(args, device):
    import torch

    from hybridzoo import HybridLM

    overrides = {k: v for k, v in (("layers", args.layers), ("n_layers", args.n_layers)) if v is not None}
    torch.manual_seed(0)
    model = HybridLM.from_recipe(args.recipe, **overrides).to(device)
    return model if args.dtype == "bfloat16" else model.to(getattr(torch, args.dtype))


def _time_steps(args, model, ids, sync) -> list[float]:
    times = []
    for i in range(args.warmup + args.steps):
        sync()
        start = time.perf_counter()
        _, _, loss = model(ids, labels=ids)
        loss.backward()
        sync()
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
    return times


def _autocast(args, device):
    import contextlib

    import torch

    if args.dtype != "bfloat16":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16)


def _worker(rank, args, init_file, result_file):
    import torch
    import torch.distributed as dist

    from hybridzoo.parallel.context import context_parallel, shard_sequence

    torch.set_num_threads(max(1, (os.cpu_count() or 2) // args.ranks))
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=args.ranks)
    device = torch.device(args.device)
    model = _model(args, device)
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.seq_len),
                        generator=torch.Generator().manual_seed(1)).to(device)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()
        dist.barrier()

    with context_parallel(method=args.method), _autocast(args, device):
        local = shard_sequence(ids)
        times = _time_steps(args, model, local, sync)
    if rank == 0:
        with open(result_file, "w") as f:
            json.dump(times, f)
    dist.destroy_process_group()


def measure(argv=None) -> dict:
    """Run the comparison; return (and print) its JSON record."""
    args = _parse(sys.argv[1:] if argv is None else argv)
    import torch
    import torch.multiprocessing as mp

    from hybridzoo.parallel.costs import model_bytes_per_step

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("context_parallel benchmark: --device cuda but no GPU is visible; use --device cpu")
    if args.seq_len % args.ranks:
        raise SystemExit(f"--seq-len {args.seq_len} must be a multiple of --ranks {args.ranks}")
    model = _model(args, device)
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.seq_len),
                        generator=torch.Generator().manual_seed(1)).to(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    with _autocast(args, device):
        single = _time_steps(args, model, ids, sync)
    fwd, bwd = model_bytes_per_step(model, args.ranks, args.batch, args.seq_len // args.ranks, args.method,
                                    dtype=getattr(torch, args.dtype))
    layers = model.config.layer_kinds()
    del model, ids  # the ranks share this GPU: free what the unsharded run held before they start
    if device.type == "cuda":
        torch.cuda.empty_cache()
    with tempfile.TemporaryDirectory() as tmp:
        result_file = os.path.join(tmp, "times.json")
        mp.spawn(_worker, args=(args, os.path.join(tmp, "init"), result_file), nprocs=args.ranks, join=True)
        with open(result_file) as f:
            sharded = json.load(f)
    from benchmarks.meta import run_metadata

    result = {
        **run_metadata(),
        "what": "context-parallel step (fwd+bwd) vs unsharded", "device": str(device),
        "device_name": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "recipe": args.recipe, "layers": layers,
        "ranks": args.ranks, "method": args.method, "seq_len": args.seq_len, "batch": args.batch,
        "dtype": args.dtype, "single_s": statistics.median(single), "sharded_s": statistics.median(sharded),
        "ratio": statistics.median(sharded) / statistics.median(single),
        "bytes_forward": fwd, "bytes_backward": bwd,
    }
    print(json.dumps(result))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


def main(argv=None) -> int:
    measure(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
