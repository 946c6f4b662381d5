"""Each head's decay at initialisation, per seed: which seeds start with a long memory.

Gated DeltaNet and Mamba-2 draw each head's per-step decay at random,
``a = exp(-exp(A_log) * softplus(dt_bias))`` (as fla's and mamba_ssm's layers do), so with few
heads per layer one seed may start with no long memory at all (the decay where the head's
input-dependent term is 0; the real one varies with the input around it). For each seed this builds the
recipe's model exactly as ``python -m benchmarks mqar`` does for that seed (same weights) and prints,
per layer, each head's ``a`` and its memory ``1 / (1 - a)`` in tokens.

    python scripts/initial_decays.py mqar-gdn-l --seeds 0,1,2,3,4,5
    python scripts/initial_decays.py mqar-mamba2-l --set mamba2.dt_max=0.01
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.mqar import build_model  # noqa: E402


def initial_decays(recipe: str, seed: int, overrides: dict | None = None) -> list[list[float]]:
    """Per layer with ``A_log`` and ``dt_bias`` parameters, each head's initial per-step decay."""
    model, _ = build_model(recipe, "hybridzoo", {"vocab_size": 8192, "overrides": overrides or {}}, seed)
    layers = []
    for module in model.modules():
        if isinstance(getattr(module, "A_log", None), torch.nn.Parameter) and hasattr(module, "dt_bias"):
            with torch.no_grad():
                step = torch.nn.functional.softplus(module.dt_bias.float())
                layers.append(torch.exp(-module.A_log.float().exp() * step).tolist())
    if not layers:
        raise SystemExit(f"initial_decays: {recipe} has no layer with A_log and dt_bias (Gated DeltaNet, Mamba-2)")
    return layers


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipe")
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated seeds")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KIND.FIELD=VALUE",
                        help="a mixer setting, as benchmarks.mqar's --set (YAML value)")
    args = parser.parse_args(argv)
    import yaml

    overrides = {k: yaml.safe_load(v) for k, v in (o.split("=", 1) for o in args.overrides)}
    for seed in (int(s) for s in args.seeds.split(",") if s):
        layers = initial_decays(args.recipe, seed, overrides)
        text = " | ".join(" ".join(f"{a:.3f} ({1 / max(1 - a, 1e-9):,.0f})" for a in heads) for heads in layers)
        print(f"seed {seed}: {text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
