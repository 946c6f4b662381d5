"""Overhead of context parallelism: a HybridLM training step (forward + backward) with its sequence
sharded over P processes, against the same step unsharded in one process.

    python -m benchmarks context_parallel --device cuda --ranks 2 --recipe tiny-hybrid --seq-len 8192
    python -m benchmarks context_parallel --device cuda --ranks 2 --recipe gated-deltanet-340m \
        --seq-len 32768 --check-grads                      # 2 GPUs: NCCL, gradients checked
    python -m benchmarks context_parallel --device cuda --ranks 2 --recipe qwen35-0.8b --seq-len 1048576 \
        --steps 1 --warmup 0 --seco-chunk 16384 --skip-unsharded  # SeCO on each rank, 1M tokens
    python -m benchmarks context_parallel --device cpu --ranks 2 --seq-len 64 --steps 2   # smoke

With as many GPUs as ranks, rank ``r`` runs on GPU ``r`` over NCCL. With fewer, the P processes
share GPU 0 (gloo, messages staged through host memory, since NCCL refuses two ranks on one
device): the ratio then measures what sharding adds (messages, corrections, smaller kernels)
rather than a speed-up. ``--backend`` overrides the choice. ``--check-grads`` also runs one step
of each kind on the same tokens and compares the sharded loss and parameter gradients (summed
over the ranks) with the unsharded ones: the largest relative difference ``‖g − g₁‖ / ‖g₁‖`` over
the parameters, and which parameter has it. Prints one JSON object (and writes it with ``--out``):
median step times of both runs, their ratio, the bytes per step that
:func:`hybridzoo.parallel.costs.model_bytes_per_step` (or ``seco_bytes_per_step``) predicts and
those the ranks sent (every ``isend`` counted), the backend and GPUs, peak GPU memory per rank,
and the check.
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
    parser.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl"],
                        help="auto: nccl with a GPU per rank, else gloo")
    parser.add_argument("--check-grads", action="store_true", help="compare the sharded step's loss and "
                        "gradients with the unsharded step's")
    parser.add_argument("--seco-chunk", type=int, default=None, help="each rank runs SeCO over its slice in "
                        "chunks of this many tokens (hybridzoo.training.seco_ranks); the unsharded run too")
    parser.add_argument("--skip-unsharded", action="store_true", help="time only the sharded step (for "
                        "lengths one device cannot hold)")
    parser.add_argument("--out", default=None, help="also write the JSON result here")
    args = parser.parse_args(argv)
    if args.check_grads and args.skip_unsharded:
        parser.error("--check-grads compares with the unsharded step: drop --skip-unsharded")
    if args.seco_chunk is not None and args.seco_chunk < 1:
        parser.error(f"--seco-chunk must be at least 1, got {args.seco_chunk}")
    return args


def _placement(args) -> tuple[str, bool]:
    """``(backend, one GPU per rank)`` for ``args``."""
    import torch

    own_gpus = args.device == "cuda" and torch.cuda.device_count() >= args.ranks
    backend = args.backend if args.backend != "auto" else ("nccl" if own_gpus else "gloo")
    if backend == "nccl" and not own_gpus:
        raise SystemExit(f"context_parallel benchmark: --backend nccl needs a GPU per rank ({args.ranks}), "
                         f"{torch.cuda.device_count() if args.device == 'cuda' else 0} visible")
    return backend, own_gpus


def rank_device(args, rank: int, own_gpus: bool):
    """Where rank ``rank`` runs: GPU ``rank`` with a GPU per rank, GPU 0 when the ranks share one
    (an explicit index: ``torch.cuda.set_device`` refuses a bare ``cuda``), else the CPU."""
    import torch

    if args.device != "cuda":
        return torch.device(args.device)
    return torch.device("cuda", rank if own_gpus else 0)


def _step_gradients(args, model, ids, autocast) -> tuple[float, dict]:
    """One training step of ``model`` on ``ids`` (:func:`_train_step`): (loss, {parameter:
    gradient, in the parameter's dtype})."""
    import torch

    model.zero_grad(set_to_none=True)
    with autocast:
        loss = _train_step(args, model, ids)
    grads = {name: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().clone()
             for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return float(loss.detach()), grads


def compare_gradients(loss: float, grads: dict, ref_loss: float, ref: dict) -> dict:
    """The sharded step (``loss``, ``grads``: summed over the ranks) against the unsharded one
    (differences in float64)."""
    import torch

    worst, worst_name = 0.0, None
    for name, want in ref.items():
        got, want = grads[name].to(want.device, torch.float64), want.double()
        rel = float((got - want).norm() / want.norm().clamp_min(1e-300))
        if rel > worst or worst_name is None:
            worst, worst_name = rel, name
    return {"loss": loss, "loss_unsharded": ref_loss, "loss_relative_difference": abs(loss - ref_loss) / abs(ref_loss),
            "max_gradient_relative_difference": worst, "worst_parameter": worst_name, "parameters": len(ref)}


def _model(args, device):
    import torch

    from hybridzoo import HybridLM

    overrides = {k: v for k, v in (("layers", args.layers), ("n_layers", args.n_layers)) if v is not None}
    torch.manual_seed(0)
    model = HybridLM.from_recipe(args.recipe, **overrides).to(device)
    return model if args.dtype == "bfloat16" else model.to(getattr(torch, args.dtype))


def _train_step(args, model, ids):
    """One forward and backward on ``ids`` (labels = ids): plain, or SeCO in chunks of
    ``--seco-chunk`` tokens (inside ``context_parallel``: over this rank's slice). Returns the loss."""
    if args.seco_chunk:
        from hybridzoo.training.seco_engine import seco_step

        return seco_step(model, {"input_ids": ids, "labels": ids}, args.seco_chunk).loss
    _, _, loss = model(ids, labels=ids)
    loss.backward()
    return loss


def _time_steps(args, model, ids, sync) -> list[float]:
    times = []
    for i in range(args.warmup + args.steps):
        sync()
        start = time.perf_counter()
        _train_step(args, model, ids)
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


def _worker(rank, args, init_file, result_file, ref_file):
    import torch
    import torch.distributed as dist

    from hybridzoo.parallel.comm import count_sent
    from hybridzoo.parallel.context import context_parallel, shard_sequence

    torch.set_num_threads(max(1, (os.cpu_count() or 2) // args.ranks))
    backend, own_gpus = _placement(args)
    device = rank_device(args, rank, own_gpus)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.cuda.reset_peak_memory_stats(device)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=args.ranks)
    model = _model(args, device)
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.seq_len),
                        generator=torch.Generator().manual_seed(1)).to(device)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()
        dist.barrier()

    collective = "cpu" if backend == "gloo" else device  # gloo reduces host copies
    with count_sent() as sent, context_parallel(method=args.method), _autocast(args, device):
        local = shard_sequence(ids)
        times = _time_steps(args, model, local, sync)
    sent_total = torch.tensor(sent, dtype=torch.int64, device=collective)
    dist.all_reduce(sent_total)
    check = None
    if args.check_grads:
        with context_parallel(method=args.method):
            loss, grads = _step_gradients(args, model, shard_sequence(ids), _autocast(args, device))
        # a rank's loss and gradients are its share of the sums
        total = torch.tensor(loss, dtype=torch.float64, device=collective)
        dist.all_reduce(total)
        grads = {name: grad.to(collective) for name, grad in grads.items()}
        for grad in grads.values():
            dist.all_reduce(grad)
        if rank == 0:
            ref_loss, ref = torch.load(ref_file, map_location="cpu")
            check = compare_gradients(float(total), {k: v.cpu() for k, v in grads.items()}, ref_loss, ref)
        del grads
    peak = torch.tensor(float(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else 0.0,
                        device=collective)
    peaks = [torch.zeros_like(peak) for _ in range(args.ranks)]
    dist.all_gather(peaks, peak)
    if rank == 0:
        with open(result_file, "w") as f:
            json.dump({"times": times, "check": check, "backend": backend,
                       "bytes_sent_per_step": int(sent_total) // (args.warmup + args.steps),
                       "devices": [str(rank_device(args, r, own_gpus)) for r in range(args.ranks)],
                       "peak_bytes_per_rank": [float(p) for p in peaks] if device.type == "cuda" else None}, f)
    dist.destroy_process_group()


def measure(argv=None) -> dict:
    """Run the comparison; return (and print) its JSON record."""
    args = _parse(sys.argv[1:] if argv is None else argv)
    import torch
    import torch.multiprocessing as mp

    from hybridzoo.parallel.costs import model_bytes_per_step, seco_bytes_per_step

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("context_parallel benchmark: --device cuda but no GPU is visible; use --device cpu")
    if args.seq_len % args.ranks:
        raise SystemExit(f"--seq-len {args.seq_len} must be a multiple of --ranks {args.ranks}")
    _placement(args)  # a bad --backend fails before any work
    model = _model(args, device)
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.seq_len),
                        generator=torch.Generator().manual_seed(1)).to(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    single = None
    if not args.skip_unsharded:
        with _autocast(args, device):
            single = _time_steps(args, model, ids, sync)
    if args.seco_chunk:
        fwd, bwd = seco_bytes_per_step(model, args.ranks, args.batch, args.seq_len // args.ranks,
                                       dtype=getattr(torch, args.dtype))
    else:
        fwd, bwd = model_bytes_per_step(model, args.ranks, args.batch, args.seq_len // args.ranks, args.method,
                                        dtype=getattr(torch, args.dtype))
    layers = model.config.layer_kinds()
    with tempfile.TemporaryDirectory() as tmp:
        ref_file = os.path.join(tmp, "reference.pt")
        if args.check_grads:
            ref_loss, ref = _step_gradients(args, model, ids, _autocast(args, device))
            torch.save((ref_loss, {k: v.cpu() for k, v in ref.items()}), ref_file)
            del ref
        single_peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
        del model, ids  # the ranks may share this GPU: free what the unsharded run held before they start
        if device.type == "cuda":
            torch.cuda.empty_cache()
        result_file = os.path.join(tmp, "times.json")
        mp.spawn(_worker, args=(args, os.path.join(tmp, "init"), result_file, ref_file), nprocs=args.ranks,
                 join=True)
        with open(result_file) as f:
            record = json.load(f)
    sharded = record["times"]
    from benchmarks.meta import run_metadata

    result = {
        **run_metadata(),
        "what": "context-parallel step (fwd+bwd) vs unsharded", "device": str(device),
        "device_name": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "recipe": args.recipe, "layers": layers,
        "ranks": args.ranks, "method": args.method, "seq_len": args.seq_len, "batch": args.batch,
        "dtype": args.dtype, "seco_chunk": args.seco_chunk,
        "single_s": statistics.median(single) if single else None, "sharded_s": statistics.median(sharded),
        "ratio": statistics.median(sharded) / statistics.median(single) if single else None,
        "bytes_forward": fwd, "bytes_backward": bwd, "bytes_sent_per_step": record["bytes_sent_per_step"],
        "backend": record["backend"], "rank_devices": record["devices"],
        "peak_bytes_unsharded": single_peak, "peak_bytes_per_rank": record["peak_bytes_per_rank"],
        "check": record["check"],
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
