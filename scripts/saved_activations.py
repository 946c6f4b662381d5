"""List the tensors a mixer layer (or a whole recipe) keeps for its backward, and the bytes per token.

    python scripts/saved_activations.py mamba2 --d-model 1024 --length 64
    python scripts/saved_activations.py mamba1 --d-model 1024 --length 64 --backend reference
    python scripts/saved_activations.py --recipe mamba2-130m --set d_model=1024 --set n_layers=2

Runs one forward (fp32 weights, bf16 autocast on the CPU unless ``--no-autocast``) of ``mixer``
(``mamba1``, ``mamba2``, ... with its default settings at ``--d-model``) or of ``HybridLM`` built
from ``--recipe`` with ``--set field=value`` overrides, and prints every storage autograd saved
(shape, dtype, bytes, bytes per token, the nodes that saved it; views of one buffer once). The
per-token total is the slope between ``--length`` and twice it, so weight casts and recurrent
states (whose size does not grow with the tokens) drop out; for a recipe it is also given per layer.

``--backend triton`` (the default: the path a GPU takes) needs ``TRITON_INTERPRET=1`` on a CPU,
set here before Triton is imported; tiny lengths keep the interpreter fast.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from hybridzoo.memory import saved_tensors  # noqa: E402


def build(args):
    """The module and a function ``input(length) -> tensor`` feeding it."""
    if args.recipe:
        from hybridzoo.zoo.model import HybridLM
        from hybridzoo.zoo.recipes import load_recipe_config

        overrides = {}
        for item in args.set:
            name, _, value = item.partition("=")
            overrides[name] = int(value) if value.lstrip("-").isdigit() else value
        config = load_recipe_config(args.recipe, backend=args.backend, **overrides)
        model = HybridLM(config)
        return model, lambda length: torch.randint(0, config.vocab_size, (args.batch, length)), \
            len(config.layer_kinds())
    from hybridzoo.layers import MIXERS

    mixer_cls, config_cls = MIXERS[args.mixer][:2]
    mixer = mixer_cls(args.d_model, config_cls(), backend=args.backend)
    return mixer, lambda length: torch.randn(args.batch, length, args.d_model, requires_grad=True), 1


def measure(module, make_input, length, autocast):
    torch.manual_seed(0)
    x = make_input(length)

    def forward():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            return module(x)

    return saved_tensors(forward, parameters=list(module.parameters()) + [x])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mixer", nargs="?", default="mamba2", help="mixer kind (ignored with --recipe)")
    parser.add_argument("--recipe", default=None, help="a packaged recipe name or YAML path")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="HybridConfig override for --recipe (repeatable)")
    parser.add_argument("--d-model", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--length", type=int, default=64)
    parser.add_argument("--backend", default="triton", help="kernel backend (default: triton, the GPU path)")
    parser.add_argument("--no-autocast", action="store_true", help="fp32 throughout instead of bf16 autocast")
    args = parser.parse_args()

    module, make_input, n_layers = build(args)
    autocast = not args.no_autocast
    rows = measure(module, make_input, args.length, autocast)
    longer = measure(module, make_input, 2 * args.length, autocast)
    tokens = args.batch * args.length

    def activation_bytes(entries):
        return sum(e.nbytes for e in entries if not e.parameter)

    # a saved tensor with a parameter's shape (or its transpose) is taken for a cast copy of it
    # (autocast's bf16 weights): no per-token size, so no per-token figure
    weight_shapes = {tuple(sorted(p.shape)) for p in module.parameters()}
    print(f"{'bytes':>10} {'B/token':>9}  {'dtype':<14} {'shape':<26} saved by")
    for e in rows:
        if e.parameter:
            continue
        weight = tuple(sorted(e.shape)) in weight_shapes
        per_token = "weight" if weight else f"{e.nbytes / tokens:.1f}"
        print(f"{e.nbytes:>10} {per_token:>9}  {str(e.dtype):<14} {str(e.shape):<26} "
              f"{', '.join(e.owners)}")
    params = [e for e in rows if e.parameter]
    print(f"(+ {len(params)} parameter or input storages, {sum(e.nbytes for e in params)} bytes, not counted)")
    per_token = (activation_bytes(longer) - activation_bytes(rows)) / tokens
    what = args.recipe or f"{args.mixer} d_model={args.d_model}"
    print(f"{what}: {per_token:.1f} bytes per token saved for backward"
          + (f", {per_token / n_layers:.1f} per token per layer ({n_layers} layers)" if args.recipe else "")
          + f" [{'bf16 autocast' if autocast else 'fp32'}, backend {args.backend}, "
          f"lengths {args.length} and {2 * args.length}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
