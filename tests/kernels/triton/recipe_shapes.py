"""The Triton ops at the shapes of every packaged recipe: case list, one case's run, and its CLI.

A case is one op call of one recipe's model, at that recipe's batch and length (its ``data``
section; :data:`DEFAULT_BATCH` for recipes without one), made ragged (``T`` not a multiple of
any chunk), in one dtype. The op calls are read from the model itself: each recipe's model
(one block of each mixer kind, a small vocabulary) runs once on the CPU with the reference ops
wrapped to record the shapes and settings of every call (probe ``B = 3``, ``T = 7``, replaced
by the recipe's). :func:`run_case` then makes random inputs of those shapes and runs our Triton
op (autotuning on) forward and backward against the float64 reference on the same inputs.

    python -m tests.kernels.triton.recipe_shapes --list           # the cases, as JSON lines
    python -m tests.kernels.triton.recipe_shapes --case '<json>'  # run one (prints a JSON line)

``tests/kernels/triton/test_gpu_recipe_shapes.py`` runs every case in its own process (a kernel
fault ends only that process) and writes the record.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import sys

import torch

OPS = ("chunk_linear_attn", "chunk_delta_rule", "selective_scan", "causal_conv1d")
PROBE_B, PROBE_T = 3, 7  # dims of the recording run, replaced by the recipe's B and T
DEFAULT_BATCH = (2, 2048)  # (B, T) for recipes without a data section (the 340m-class models)
RAGGED = 3  # T - 3: no chunk size (16 ... 256) divides it
TOLERANCE = {"float32": 1e-4, "bfloat16": 1e-2}


def recipe_batch(name: str) -> tuple[int, int]:
    """``(B, T)`` of a recipe's data section (``batch_size``, ``seq_len``), ragged: ``T - 3``
    when a chunk of 64 divides it."""
    from hybridzoo.zoo.recipes import load_recipe

    init = ((load_recipe(name).get("data") or {}).get("init_args") or {})
    B, T = init.get("batch_size", DEFAULT_BATCH[0]), init.get("seq_len", DEFAULT_BATCH[1])
    return int(B), int(T) - RAGGED if int(T) % 64 == 0 else int(T)


@contextlib.contextmanager
def _recording(calls: list):
    """Wrap the reference ops so each call appends ``(op, {argument: shape or value})``."""
    from hybridzoo.kernels import reference

    originals = {op: getattr(reference, op) for op in OPS}

    def wrap(op, fn):
        signature = inspect.signature(fn)

        def recorded(*args, **kwargs):
            bound = signature.bind(*args, **kwargs)
            args_of = {}
            for name, value in bound.arguments.items():
                if isinstance(value, torch.Tensor):
                    args_of[name] = {"shape": list(value.shape)}
                elif isinstance(value, (int, float, str, bool)) or value is None:
                    args_of[name] = value
            calls.append((op, args_of))
            return fn(*args, **kwargs)

        return recorded

    try:
        for op, fn in originals.items():
            setattr(reference, op, wrap(op, fn))
        yield
    finally:
        for op, fn in originals.items():
            setattr(reference, op, fn)


def recipe_op_calls(name: str) -> list[tuple[str, dict]]:
    """The distinct Triton-op calls of a recipe's model (one block per mixer kind of its pattern),
    recorded on the CPU at ``B = 3, T = 7``."""
    from hybridzoo import HybridLM
    from hybridzoo.zoo.recipes import load_recipe_config

    pattern = load_recipe_config(name).pattern
    torch.manual_seed(0)
    model = HybridLM.from_recipe(name, n_layers=len(pattern), vocab_size=256, backend="reference")
    calls: list = []
    with _recording(calls), torch.no_grad():
        model(torch.randint(0, 256, (PROBE_B, PROBE_T)))
    unique = []
    for call in calls:
        if call not in unique:
            unique.append(call)
    return unique


def _at(shape: list[int], B: int, T: int) -> list[int]:
    return [B if i == 0 and d == PROBE_B else T if d == PROBE_T else d for i, d in enumerate(shape)]


def cases(names: list[str] | None = None) -> list[dict]:
    """Every (op call, dtype) of every recipe, identical cases merged (``recipes`` lists who
    has each)."""
    from hybridzoo.zoo.recipes import recipe_names

    merged: dict[str, dict] = {}
    for name in names or recipe_names():
        B, T = recipe_batch(name)
        for op, args in recipe_op_calls(name):
            real = {k: ({"shape": _at(v["shape"], B, T)} if isinstance(v, dict) else v) for k, v in args.items()}
            for dtype in TOLERANCE:
                case = {"op": op, "B": B, "T": T, "dtype": dtype, "args": real}
                key = json.dumps(case, sort_keys=True)
                merged.setdefault(key, dict(case, recipes=[]))["recipes"].append(name)
    return list(merged.values())


def _inputs(case: dict, device: str) -> dict:
    """Random inputs of the case's shapes, in the value ranges the op is called with."""
    dtype = getattr(torch, case["dtype"])
    op = case["op"]
    out = {}
    for name, spec in case["args"].items():
        if not isinstance(spec, dict):
            out[name] = spec
            continue
        shape = spec["shape"]
        x = torch.randn(shape, device=device, dtype=torch.float32)
        if name == "log_a":
            x = -torch.nn.functional.softplus(x) * 0.1  # decays in (0, 1)
        elif name == "beta":
            x = torch.sigmoid(x)
        elif name == "A":
            x = -torch.exp(x * 0.5)
        elif name == "delta":
            x = x * 0.5 - 1.0 if case["args"].get("delta_softplus") else torch.nn.functional.softplus(x - 1.0)
        elif name in ("delta_bias", "initial_state", "bias"):
            x = x * 0.1
        elif name == "weight":
            x = x / shape[-1] ** 0.5
        elif op == "chunk_delta_rule" and name in ("q", "k"):
            x = torch.nn.functional.normalize(x, dim=-1)
        elif op == "chunk_linear_attn" and name in ("q", "k"):
            x = x / shape[-1] ** 0.25
        float32_only = name in ("log_a", "A", "initial_state") or (name in ("D", "delta_bias") and op == "selective_scan")
        out[name] = x.to(torch.float32 if float32_only else dtype)
    return out


def run_case(case: dict, device: str = "cuda") -> dict:
    """Our Triton op (autotuning on) against the float64 reference on the same inputs: the
    relative error of the output, the final state and every input gradient."""
    import hybridzoo.kernels as kernels

    torch.manual_seed(0)
    inputs = _inputs(case, device)
    tensors = [k for k, v in inputs.items() if isinstance(v, torch.Tensor)]
    results = {}
    for backend in ("triton", "reference"):
        leaves = {k: (inputs[k].double() if backend == "reference" else inputs[k]).detach().requires_grad_()
                  for k in tensors}
        kwargs = {**inputs, **leaves, "backend": backend}
        out, final = getattr(kernels, case["op"])(**kwargs)
        torch.manual_seed(1)
        loss = (out.double() * torch.randn(out.shape, device=device, dtype=torch.float64)).sum()
        if final is not None:
            loss = loss + (final.double() * torch.randn(final.shape, device=device, dtype=torch.float64)).sum()
        loss.backward()
        results[backend] = {"out": out, "final": final, **{f"d{k}": leaves[k].grad for k in tensors}}
    errors = {}
    for name, ref in results["reference"].items():
        got = results["triton"][name]
        if ref is None or got is None:
            continue
        err = ((got.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()
        errors[name] = err if err == err else float("inf")  # NaN never passes
    tol = TOLERANCE[case["dtype"]]
    return {**case, "errors": errors, "tolerance": tol, "passed": all(e <= tol for e in errors.values())}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--list", action="store_true", help="print every case as a JSON line")
    parser.add_argument("--case", help="run one case (JSON) on the GPU and print its result as JSON")
    args = parser.parse_args(argv)
    if args.list:
        for case in cases():
            print(json.dumps(case))
    if args.case:
        print(json.dumps(run_case(json.loads(args.case))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
