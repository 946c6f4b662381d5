"""Data parallelism through Lightning: one training run on 1 device and on N devices (DDP or FSDP)
at the same global batch. Reports each step's loss in both runs, how far apart they are, and the
tokens/s of each (the scaling).

Both runs go through ``hybridzoo fit`` with the recipe's model, the embedded corpus (bytes, packed
rows of ``--seq-len`` tokens) and ``--global-batch`` rows per step: ``global / N`` per device on N
devices. The training order gives each rank the rows ``rank, rank + N, ...`` of the one-device
run's batch, and every row has the same number of tokens, so the N-device run takes the same
steps as the one-device run, up to the rounding of the gradient all-reduce. A callback reduces each
step's loss over the ranks (the mean) and times the steps. The first ``--warmup`` steps are left out
of tokens/s.

    python -m benchmarks data_parallel --recipe gated-deltanet-340m --devices 2 --strategy ddp \\
        --seq-len 2048 --global-batch 16 --steps 20
    python -m benchmarks data_parallel --recipe gated-deltanet-340m --devices 2 --strategy fsdp
    python -m benchmarks data_parallel --accelerator cpu --recipe tiny-hybrid --devices 2 \\
        --seq-len 64 --global-batch 8 --steps 3 --warmup 1     # smoke: 2 CPU processes (gloo)

FSDP needs GPUs (Lightning's ``FSDPStrategy`` runs on CUDA devices only); DDP runs on CPUs too.

Prints one JSON object (and writes it with ``--out``): both runs' per-step losses, their largest
relative difference, step times, tokens/s, the scaling (N-device tokens/s over one device's), the
peak GPU memory per device, and the run metadata.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

from lightning.pytorch.callbacks import Callback  # noqa: E402


class StepRecorder(Callback):
    """Per optimizer step: the loss averaged over the ranks and the step's wall time (the device
    synchronised at both ends); at the end, rank 0 writes them, with the world size and the largest
    peak GPU memory of any rank, to ``out`` (JSON)."""

    def __init__(self, out: str):
        self.out = out
        self.losses: list[float] = []
        self.seconds: list[float] = []
        self._start = 0.0

    @staticmethod
    def _sync(trainer) -> None:
        import torch

        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize(trainer.strategy.root_device)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._sync(trainer)
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        mean = trainer.strategy.reduce(loss.detach().float(), reduce_op="mean")
        self._sync(trainer)
        self.seconds.append(time.perf_counter() - self._start)
        self.losses.append(float(mean))

    def on_train_end(self, trainer, pl_module):
        import torch

        device = trainer.strategy.root_device
        peak = torch.tensor(float(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else 0.0,
                            device=device)
        peak = float(trainer.strategy.reduce(peak, reduce_op="max"))
        if trainer.global_rank == 0:
            Path(self.out).write_text(json.dumps({
                "world_size": trainer.world_size, "losses": self.losses, "step_seconds": self.seconds,
                "peak_bytes_per_device": peak if device.type == "cuda" else None}))


def recipe_file(args, devices: int, strategy: str, directory: Path) -> Path:
    """A complete recipe for one of the two runs: the packaged recipe's model, the embedded corpus,
    ``global_batch / devices`` rows per device, no validation, and :class:`StepRecorder`."""
    import yaml

    from hybridzoo.zoo.recipe_files import load_recipe

    model = load_recipe(args.recipe)["model"]
    recipe = {
        "model": model,
        "data": {"class_path": "hybridzoo.training.data.TextDataModule",
                 "init_args": {"paths": None, "tokenizer": None, "seq_len": args.seq_len,
                               "batch_size": args.global_batch // devices, "val_fraction": 0.05, "seed": 0,
                               "max_files": args.max_files}},
        "trainer": {"default_root_dir": str(directory / "run"), "max_steps": args.steps,
                    "accelerator": args.accelerator, "devices": devices, "strategy": strategy,
                    "precision": args.precision, "limit_val_batches": 0, "num_sanity_val_steps": 0,
                    "log_every_n_steps": 1, "gradient_clip_val": 1.0, "enable_progress_bar": False,
                    "enable_model_summary": False, "enable_checkpointing": False,
                    "callbacks": [{"class_path": "benchmarks.data_parallel.StepRecorder",
                                   "init_args": {"out": str(directory / "steps.json")}}]},
    }
    path = directory / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


def run_fit(args, devices: int, strategy: str) -> dict:
    """One ``hybridzoo fit`` in a subprocess; its :class:`StepRecorder` record."""
    with tempfile.TemporaryDirectory(prefix="hybridzoo-dp-") as tmp:
        directory = Path(tmp)
        recipe = recipe_file(args, devices, strategy, directory)
        env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        if args.accelerator == "cpu":
            env.setdefault("OMP_NUM_THREADS", "1")
        command = [sys.executable, "-m", "hybridzoo.cli", "fit", "--config", str(recipe)]
        print(f"data_parallel: {devices} device(s), {strategy}: {' '.join(command)}", file=sys.stderr, flush=True)
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=args.timeout)
        if done.returncode != 0:
            raise SystemExit(f"data_parallel: the {devices}-device run failed (exit {done.returncode}):\n"
                             f"{done.stderr[-4000:]}")
        return json.loads((directory / "steps.json").read_text())


def summarize(args, one: dict, many: dict) -> dict:
    """The comparison of the one-device run ``one`` and the N-device run ``many``."""
    tokens = args.global_batch * args.seq_len

    def rate(record: dict) -> float | None:
        timed = record["step_seconds"][args.warmup:]
        return tokens / statistics.median(timed) if timed else None

    differences = [abs(a - b) / abs(a) for a, b in zip(one["losses"], many["losses"], strict=True)]
    one_rate, many_rate = rate(one), rate(many)
    return {
        "losses_one_device": one["losses"], f"losses_{args.devices}_devices": many["losses"],
        "max_relative_loss_difference": max(differences),
        "step_seconds_one_device": one["step_seconds"], f"step_seconds_{args.devices}_devices": many["step_seconds"],
        "tokens_per_s_one_device": one_rate, f"tokens_per_s_{args.devices}_devices": many_rate,
        "scaling": many_rate / one_rate if one_rate and many_rate else None,
        "peak_bytes_per_device_one_device": one["peak_bytes_per_device"],
        f"peak_bytes_per_device_{args.devices}_devices": many["peak_bytes_per_device"],
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks data_parallel", description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="gated-deltanet-340m")
    parser.add_argument("--devices", type=int, default=2, help="devices of the data-parallel run (>= 2)")
    parser.add_argument("--strategy", default="ddp", choices=["ddp", "fsdp"])
    parser.add_argument("--accelerator", default="gpu", choices=["gpu", "cpu"])
    parser.add_argument("--precision", default=None, help="Lightning precision (default: bf16-mixed on GPUs, "
                        "32-true on CPUs)")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--global-batch", type=int, default=16, help="rows per step over all devices")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3, help="first steps left out of tokens/s")
    parser.add_argument("--max-files", type=int, default=None, help="read at most this many corpus files")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per run")
    parser.add_argument("--out", default=None, help="also write the JSON result here")
    args = parser.parse_args(argv)
    if args.devices < 2:
        parser.error(f"--devices must be at least 2 (the run to compare with one device), got {args.devices}")
    if args.global_batch % args.devices:
        parser.error(f"--global-batch {args.global_batch} must be a multiple of --devices {args.devices}")
    if not 0 <= args.warmup < args.steps:
        parser.error(f"--warmup must be in [0, --steps), got {args.warmup} with --steps {args.steps}")
    if args.strategy == "fsdp" and args.accelerator != "gpu":
        parser.error("--strategy fsdp needs --accelerator gpu (Lightning's FSDP runs on CUDA devices only)")
    if args.precision is None:
        args.precision = "bf16-mixed" if args.accelerator == "gpu" else "32-true"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.accelerator == "gpu":
        import torch

        if torch.cuda.device_count() < args.devices:
            raise SystemExit(f"data_parallel: {args.devices} GPUs asked for, {torch.cuda.device_count()} visible")
    from benchmarks.meta import run_metadata

    one = run_fit(args, 1, "auto")
    many = run_fit(args, args.devices, args.strategy)
    result = {**run_metadata(()), "what": "data parallelism: one device against N at the same global batch",
              "settings": {k: v for k, v in vars(args).items() if k not in ("out", "timeout")},
              **summarize(args, one, many)}
    text = json.dumps(result, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
