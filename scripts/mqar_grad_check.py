"""Train one MQAR run and, at chosen steps, compare its gradient under every kernel path.

A run that stalls on the GPU but learns on the CPU (``mqar-gdn-l`` at lr 1e-2) points at a kernel
path. This script trains the run as ``benchmarks.mqar`` does (same model, data, optimizer,
schedule and CUDA-graph step), and at each ``--check`` step computes the loss and gradient of
one fixed held-out batch (the first ``batch_size`` examples) with copies of the same weights:

============ =============================================================
variant      path
============ =============================================================
auto-bf16    the training path: Triton kernels under bf16 autocast
auto-fp32    Triton kernels, float32, no autocast
ref-bf16     reference kernels under bf16 autocast
ref-fp32     reference kernels, float32
ref-fp64     reference kernels, float64: the spec every path is measured by
============ =============================================================

With ``--impl reference`` the run trains the benchmark's reference model instead (fla's or
mamba_ssm's layer, or Llama attention, in the same blocks), and two more variants compute the
gradient with that model itself: ``theirs-bf16`` (its training path) and ``theirs-fp32``; the
hybridzoo variants get its weights (:func:`benchmarks.mqar_reference.hybridzoo_tensors`), and
its gradients are compared under hybridzoo's names. So both implementations' paths are measured
against one float64 gradient, at the weights of a reference run.

For each variant: the loss, the gradient norm, and the relative error of the whole gradient, of
its worst parameters (relative to the whole gradient's norm) and of every parameter (relative to
its own gradient's norm: ``param_rel_err``) against ``ref-fp64``, and each parameter's error
along its true gradient, ``<g - g64, g64> / |g64|^2`` (``param_bias``: 0 for an error that only
scatters, > 0 for a gradient too long, < 0 too short). The weights at the
``--save-states`` steps go to ``states.pt``.

    python scripts/mqar_grad_check.py --recipe mqar-gdn-l --lr 1e-2 --seed 0 --steps 600 \\
        --check 0,50,100,200,400,600 --out /tmp/gdn-check

``--train-backend reference`` / ``--train-dtype fp32`` train with another path instead (for a
whole run: ``--steps 3000 --check ''`` reports the curve and accuracy every 250 steps).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import json
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

VARIANTS = {"auto-bf16": ("auto", "bf16"), "auto-fp32": ("auto", "fp32"), "ref-bf16": ("reference", "bf16"),
            "ref-fp32": ("reference", "fp32"), "ref-fp64": ("reference", "fp64")}


def _model_copy(state: dict, config, backend: str, dtype: str, device):
    """A hybridzoo model of ``config`` on ``backend`` holding ``state``, in float64 or float32."""
    from hybridzoo import HybridLM

    other = HybridLM(dataclasses.replace(config, backend=backend)).to(device)
    other.load_state_dict(state)
    return other.double() if dtype == "fp64" else other.float()


def gradients(model, config, ids, labels, device: str, like: dict | None = None) -> dict:
    """Loss and gradient of ``(ids, labels)`` under every variant; errors against ref-fp64.
    ``model`` is the run's model: hybridzoo's, or, when ``like`` (a hybridzoo model's state dict
    of the recipe, for names and shapes) is given, the reference one (whose own paths are then the
    ``theirs-*`` variants)."""
    import torch

    from benchmarks.mqar_reference import hybridzoo_tensors
    from hybridzoo.zoo.model import lm_loss, shift_labels

    reference = like is not None
    state = hybridzoo_tensors(config.pattern[0], model.state_dict(), like) if reference else model.state_dict()
    variants = dict(VARIANTS)
    if reference:
        variants.update({"theirs-bf16": ("theirs", "bf16"), "theirs-fp32": ("theirs", "fp32")})
    results, grads = {}, {}
    for name, (backend, dtype) in variants.items():
        if backend == "theirs":
            other = copy.deepcopy(model).float()
        else:
            other = _model_copy(state, config, backend, dtype, next(model.parameters()).device)
        autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if dtype == "bf16" and device.startswith("cuda")
                    else torch.autocast("cpu", dtype=torch.bfloat16) if dtype == "bf16"
                    else contextlib.nullcontext())
        try:
            with autocast:
                logits, _ = other(ids)
            loss = lm_loss(logits.float() if dtype != "fp64" else logits, shift_labels(labels))
            loss.backward()
        except Exception as error:  # a path that fails is a finding, not the end of the check
            results[name] = {"error": f"{type(error).__name__}: {str(error)[:300]}"}
            continue
        named = {n: p.grad.detach().double() for n, p in other.named_parameters() if p.grad is not None}
        grads[name] = hybridzoo_tensors(config.pattern[0], named, like) if backend == "theirs" else named
        norm = math.sqrt(sum(float((g * g).sum()) for g in grads[name].values()))
        results[name] = {"loss": float(loss.detach()), "grad_norm": norm}
    spec = grads.get("ref-fp64")
    if spec is not None:
        spec_sq = {n: float((t * t).sum()) for n, t in spec.items()}   # once, for every variant
        total = math.sqrt(sum(spec_sq.values()))
    for name, g in grads.items():
        if spec is None or name == "ref-fp64":
            continue
        deltas = {n: g[n] - spec[n] for n in spec}
        errors = {n: float(d.norm()) for n, d in deltas.items()}
        diff = math.sqrt(sum(e * e for e in errors.values()))
        # each parameter's error, relative to the whole gradient's norm: where the error is
        per_param = sorted(((e / max(total, 1e-30), n) for n, e in errors.items()), reverse=True)
        # and relative to its own gradient: small parameters (decays, step sizes, skips) whose
        # gradient is off by a large fraction hide under the whole norm
        own = {n: e / max(math.sqrt(spec_sq[n]), 1e-30) for n, e in errors.items()}
        # and along the true gradient: a bias in the step's direction, which noise averages away
        bias = {n: float((d * spec[n]).sum()) / max(spec_sq[n], 1e-300) for n, d in deltas.items()}
        results[name].update(grad_rel_err=diff / max(total, 1e-30),
                             param_rel_err={n: float(f"{e:.3g}") for n, e in own.items()},
                             param_bias={n: float(f"{b:.3g}") for n, b in bias.items()},
                             largest_errors={n: round(e, 6) for e, n in per_param[:5]},
                             largest_true_grads={n: round(math.sqrt(spec_sq[n]) / max(total, 1e-30), 6)
                                                 for _, n in per_param[:5]})
    return results


def mixer_stats(model) -> dict:
    """The largest magnitude of every mixer parameter (decays, gates and projections alike)."""
    out = {}
    for name, p in model.named_parameters():
        if ".mixer." in name:
            out[name] = round(float(p.detach().abs().max()), 5)
    return out


def main(argv: list[str] | None = None) -> int:
    import torch

    from benchmarks.mqar import SETTINGS, RunLoop
    from hybridzoo import HybridLM

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default="mqar-gdn-l")
    parser.add_argument("--setting", default="gpu", choices=sorted(SETTINGS))
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=600, help="steps to train")
    parser.add_argument("--max-steps", dest="max_steps", type=int, default=3000, help="the schedule's length")
    parser.add_argument("--check", default="0,50,100,200,400,600", help="steps at which to compare gradients")
    parser.add_argument("--save-states", dest="save_states", default="",
                        help="check steps whose weights go to states.pt (default: none)")
    parser.add_argument("--impl", default="hybridzoo", choices=("hybridzoo", "reference"),
                        help="train hybridzoo's model or the benchmark's reference model (theirs-* variants)")
    parser.add_argument("--train-backend", dest="train_backend", default="auto")
    parser.add_argument("--train-dtype", dest="train_dtype", default="bf16", choices=("bf16", "fp32"))
    parser.add_argument("--no-cuda-graph", dest="cuda_graph", action="store_false")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    checks = {int(s) for s in args.check.split(",") if s}
    saves = {int(s) for s in args.save_states.split(",") if s}
    device = "cuda" if torch.cuda.is_available() else "cpu"
    spec = dict(SETTINGS[args.setting], max_steps=args.max_steps)
    if args.impl == "reference" and args.train_backend != "auto":
        raise SystemExit("mqar_grad_check: --train-backend applies to hybridzoo's model, not with --impl reference")
    hook = None if args.train_backend == "auto" else (
        lambda model, config: _model_copy(model.state_dict(), config, args.train_backend, "fp32",
                                          next(model.parameters()).device))
    run = RunLoop(args.recipe, args.impl, spec, args.seed, args.lr, device, graph=args.cuda_graph,
                  dtype=args.train_dtype, model_hook=hook)
    model, config, batch = run.model, run.config, run.batch
    probe_ids, probe_labels = run.val_ids[:batch].to(device), run.val_labels[:batch].to(device)
    # the reference run's weights and gradients are compared under hybridzoo's names and shapes
    like = HybridLM(config).state_dict() if args.impl == "reference" else None
    args.out.mkdir(parents=True, exist_ok=True)
    log, states, start = [], {}, time.perf_counter()
    while True:
        step = run.step
        if step in checks:
            entry = {"step": step, "variants": gradients(model, config, probe_ids, probe_labels, device, like),
                     "mixer_max_abs": mixer_stats(model)}
            if step in saves:
                states[step] = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
            log.append(entry)
            row = "  ".join(f"{n} {v.get('loss', float('nan')):.4f}/{v.get('grad_norm', float('nan')):.3g}"
                            f"/{v.get('grad_rel_err', 0):.2e}" for n, v in entry["variants"].items())
            print(f"check {step}: {row}", flush=True)
            bf16 = entry["variants"].get("auto-bf16", {})
            if bf16.get("grad_rel_err", 0) > 0.1:
                print(f"check {step}: auto-bf16 largest errors {bf16['largest_errors']} "
                      f"(true gradient shares {bf16['largest_true_grads']})", flush=True)
        if step == args.steps:
            break
        loss = run.train_step_once()
        done = run.step
        if done % 25 == 0:
            log.append({"step": done, "train_loss": float(loss)})
        if done % 250 == 0 or done == args.steps:
            accuracy, val_loss = run.evaluate()
            log.append({"step": done, "accuracy": accuracy, "val_loss": val_loss,
                        "seconds": round(time.perf_counter() - start, 1)})
            print(f"step {done}: loss {float(loss):.4f} val {val_loss:.4f} accuracy {accuracy:.4f}", flush=True)
    cuda = device == "cuda"
    meta = {"recipe": args.recipe, "impl": args.impl, "setting": args.setting, "lr": args.lr, "seed": args.seed, "steps": args.steps,
            "max_steps": args.max_steps, "train_backend": args.train_backend, "train_dtype": args.train_dtype,
            "cuda_graph": run.train_step.captured is not None, "device": torch.cuda.get_device_name(0) if cuda else "cpu",
            "torch": torch.__version__}
    (args.out / "grad_check.json").write_text(json.dumps({"meta": meta, "log": log}, indent=1))
    if states:
        torch.save(states, args.out / "states.pt")
    return 0


if __name__ == "__main__":
    sys.exit(main())
