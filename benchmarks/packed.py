"""Packed documents: varlen kernel ops beside fla's, and a packed training step beside the unpacked one.

Documents of realistic lengths: log-normal, median ``--median`` (600) tokens, sigma ``--sigma``
(1.2: about 1.5% of documents are longer than an 8192-token row and are cut at the row's end),
drawn with a fixed seed and laid end to end into rows of ``--seq-len`` (8192) tokens; a row's start
is always a document start. Each row's boundaries become ``cu_seqlens`` over the packed
``[1, B·T]`` batch (ops) or ``position_ids`` restarting at 0 (models).

``ops``: forward + backward medians (``triton.testing.do_bench``) of our Triton op with
``cu_seqlens`` beside fla's op of the same kind with the same inputs and ``cu_seqlens``
(``chunk_gla``, ``chunk_simple_gla``, ``chunk_gated_delta_rule``), at the recipes' head shapes, and
of our op on the same tokens unpacked (``[B, T]``, no boundaries). fla's gated backward runs with
``fla.ops.common.chunk_o.TRITON_ABOVE_3_7_1 = True`` on Triton < 3.7.1.

``models``: tokens/s of a training step (fp32 weights, bf16 autocast, fused AdamW) of each recipe
on packed rows (``position_ids``) and on the same tokens as plain rows, taking turns, ``--repeats``
times; the ratio packed / unpacked is the median over repetitions.

    python -m benchmarks packed ops --out benchmarks/results/packed-ops.json
    python -m benchmarks packed models --recipes gla-340m,mamba-130m --out benchmarks/results/packed-models.json
    python -m benchmarks packed ops --cpu-smoke          # tiny shapes, reference backend, no timing worth reading
"""

from __future__ import annotations

import argparse
import datetime
import gc
import statistics
import sys
import time

import torch

from benchmarks.meta import run_metadata, write_json

RECIPES = ("gla-340m", "gated-deltanet-340m", "mamba2-130m", "mamba-130m", "qwen35-0.8b")


def document_lengths(total: int, seq_len: int, median: float, sigma: float, seed: int) -> list[list[int]]:
    """Rows of document lengths: log-normal lengths laid end to end, cut at each row's end (the
    rest of a cut document starts the next row). Each row sums to ``seq_len``; ``total`` tokens."""
    generator = torch.Generator().manual_seed(seed)
    rows, row, room, pending = [], [], seq_len, 0
    while len(rows) * seq_len < total:
        if pending == 0:
            z = torch.randn((), generator=generator).item()
            pending = max(1, round(median * torch.exp(torch.tensor(sigma * z)).item()))
        take = min(pending, room)
        row.append(take)
        pending -= take
        room -= take
        if room == 0:
            rows.append(row)
            row, room = [], seq_len
    return rows


def cu_seqlens_of(rows: list[list[int]], device) -> torch.Tensor:
    """int32 ``[N + 1]`` cumulative lengths of every document of every row, in order."""
    lengths = torch.tensor([n for row in rows for n in row], dtype=torch.int64)
    return torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]).to(device=device, dtype=torch.int32)


def position_ids_of(rows: list[list[int]], device) -> torch.Tensor:
    """``[B, T]`` positions restarting at 0 at each document (transformers' padding-free convention)."""
    return torch.stack([torch.cat([torch.arange(n) for n in row]) for row in rows]).to(device)


# ---------------------------------------------------------------------------------------- ops

OP_CASES = {
    # name: (kind, H, K, V) at the recipe's heads
    "per-key gla-340m": ("per_key", 4, 128, 256),
    "scalar retnet-340m": ("scalar", 4, 256, 512),
    "scalar mamba2-130m": ("scalar", 24, 128, 64),
    "delta gated-deltanet-340m": ("delta", 6, 128, 256),
    "delta qwen35-0.8b": ("delta", 16, 128, 128),
}


def _op_inputs(kind, B, T, H, K, V, device, dtype):
    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, device=device) * scale).to(dtype).requires_grad_(True)

    q, v = rand(B, T, H, K), rand(B, T, H, V)
    if kind == "delta":
        k = torch.nn.functional.normalize(torch.randn(B, T, H, K, device=device), dim=-1).to(dtype).requires_grad_(True)
    else:
        k = rand(B, T, H, K)
    gate = (B, T, H, K) if kind == "per_key" else (B, T, H)
    log_a = (-torch.rand(*gate, device=device) * 0.1).requires_grad_(True)
    beta = torch.rand(B, T, H, device=device).to(dtype).requires_grad_(True) if kind == "delta" else None
    return [x for x in (q, k, v, log_a, beta) if x is not None]


def _ours(kind, inputs, cu_seqlens, backend):
    from hybridzoo import kernels as K

    if kind == "delta":
        return lambda: K.chunk_delta_rule(*inputs, cu_seqlens=cu_seqlens, backend=backend)[0]
    return lambda: K.chunk_linear_attn(*inputs, cu_seqlens=cu_seqlens, backend=backend)[0]


def _fla(kind, inputs, cu_seqlens):
    from benchmarks.fla_backward import allow_fla_gated_backward

    allow_fla_gated_backward()
    if kind == "delta":
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as op
    elif kind == "per_key":
        from fla.ops.gla import chunk_gla as op
    else:
        from fla.ops.simple_gla import chunk_simple_gla as op
    cu = cu_seqlens.long()
    return lambda: op(*inputs, cu_seqlens=cu)[0]


def _time(fn, inputs, smoke: bool) -> float:
    """Median ms of forward + backward."""
    out = fn()
    grad = torch.randn_like(out)

    def step():
        torch.autograd.backward(fn(), grad)
        for x in inputs:
            x.grad = None

    if smoke:
        began = time.perf_counter()
        step()
        return (time.perf_counter() - began) * 1e3
    from triton.testing import do_bench

    return do_bench(step, warmup=25, rep=100)


def run_ops(args, device, log=print) -> list[dict]:
    smoke = device.type == "cpu"
    B, T = (2, 64) if smoke else (args.batch, args.seq_len)
    rows_of_docs = document_lengths(B * T, T, 12 if smoke else args.median, args.sigma, args.seed)
    cu = cu_seqlens_of(rows_of_docs, device)
    dtype = torch.float32 if smoke else torch.bfloat16
    backend = "reference" if smoke else "triton"
    rows = []
    for name in (args.cases.split(",") if args.cases else OP_CASES):
        kind, H, K, V = OP_CASES[name]
        if smoke:
            H, K, V = 2, 16, 16
        row = {"case": name, "kind": kind, "shape": f"B{B} T{T} H{H} K{K} V{V}", "documents": len(cu) - 1}
        torch.manual_seed(args.seed)
        flat = _op_inputs(kind, B, T, H, K, V, device, dtype)
        packed = [x.detach().reshape(1, B * T, *x.shape[2:]).requires_grad_(True) for x in flat]
        for label, make in (("ours_varlen_ms", lambda: _ours(kind, packed, cu, backend)),
                            ("ours_unpacked_ms", lambda: _ours(kind, flat, None, backend)),
                            ("fla_varlen_ms", lambda: _fla(kind, packed, cu))):
            try:
                row[label] = _time(make(), packed if "varlen" in label else flat, smoke)
            except Exception as error:  # one side failing must not lose the other
                row[label + "_error"] = f"{type(error).__name__}: {error}"[:300]
            gc.collect()
        if "ours_varlen_ms" in row and "fla_varlen_ms" in row:
            row["ratio_ours_over_fla"] = row["ours_varlen_ms"] / row["fla_varlen_ms"]
        if "ours_varlen_ms" in row and "ours_unpacked_ms" in row:
            row["ratio_varlen_over_unpacked"] = row["ours_varlen_ms"] / row["ours_unpacked_ms"]
        log(f"packed ops: {row}")
        rows.append(row)
    return rows


# ------------------------------------------------------------------------------------- models

def _step_time(model, ids, position_ids, optimizer, autocast, device) -> float:
    began = time.perf_counter()
    with autocast:
        loss = model(ids, labels=ids, position_ids=position_ids)[2]
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - began


def run_models(args, device, log=print) -> list[dict]:
    from hybridzoo import HybridLM
    from hybridzoo.zoo.recipes import load_recipe_config

    smoke = device.type == "cpu"
    B, T = (2, 64) if smoke else (args.batch, args.seq_len)
    docs = document_lengths(B * T, T, 12 if smoke else args.median, args.sigma, args.seed)
    position_ids = position_ids_of(docs, device)
    rows = []
    for recipe in (args.recipes.split(",") if args.recipes else RECIPES):
        overrides = dict(vocab_size=256, d_model=64, n_layers=4, d_mlp=128) if smoke else {}
        config = load_recipe_config(recipe, **overrides)
        row = {"recipe": recipe, "batch": B, "seq_len": T, "documents": sum(len(r) for r in docs),
               "packed": [], "unpacked": []}
        for repeat in range(args.repeats):
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            torch.manual_seed(repeat)
            with device:
                model = HybridLM(config)
            model = model.to(device=device, dtype=torch.float32).train()
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
            ids = torch.randint(0, 256, (B, T), generator=torch.Generator().manual_seed(repeat)).to(device)
            autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
            order = (("unpacked", None), ("packed", position_ids))
            for who, pos in order[::1 if repeat % 2 == 0 else -1]:
                try:
                    for _ in range(args.warmup):
                        _step_time(model, ids, pos, optimizer, autocast, device)
                    times = [_step_time(model, ids, pos, optimizer, autocast, device) for _ in range(args.steps)]
                    row[who].append(B * T * len(times) / sum(times))
                except Exception as error:  # noqa: BLE001 - one side failing must not lose the other
                    row.setdefault("errors", []).append(f"{who}: {type(error).__name__}: {error}"[:300])
            del model, optimizer
            log(f"packed models: {recipe} #{repeat}: packed {row['packed'][-1:]} unpacked {row['unpacked'][-1:]}")
        pairs = list(zip(row["packed"], row["unpacked"]))
        if pairs:
            ratios = [p / u for p, u in pairs]
            row["ratio_packed_over_unpacked"] = {"median": statistics.median(ratios), "min": min(ratios),
                                                 "max": max(ratios), "all": ratios}
        rows.append(row)
    return rows


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m benchmarks packed", description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("what", choices=("ops", "models"))
    parser.add_argument("--cases", default=None, help=f"comma-separated subset of: {', '.join(OP_CASES)}")
    parser.add_argument("--recipes", default=None, help=f"comma-separated subset of: {', '.join(RECIPES)}")
    parser.add_argument("--batch", type=int, default=2, help="rows per step (default 2)")
    parser.add_argument("--seq-len", type=int, default=8192, help="tokens per row (default 8192)")
    parser.add_argument("--median", type=float, default=600.0, help="median document length (default 600)")
    parser.add_argument("--sigma", type=float, default=1.2, help="log-normal sigma of document lengths (default 1.2)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3, help="models: repetitions (each side once per repetition)")
    parser.add_argument("--warmup", type=int, default=3, help="models: untimed steps per side and repetition")
    parser.add_argument("--steps", type=int, default=10, help="models: timed steps per side and repetition")
    parser.add_argument("--out", default=None, help="JSON results (default benchmarks/results/<date>-packed-<what>.json)")
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on a CPU: every code path, no timing")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.cpu_smoke:
        device = torch.device("cpu")
        args.repeats, args.warmup, args.steps = 1, 0, 1
    elif not torch.cuda.is_available():
        print("packed: no CUDA device; use --cpu-smoke on a CPU", file=sys.stderr)
        return 2
    else:
        device = torch.device("cuda")
    out = args.out or f"benchmarks/results/{datetime.date.today()}-packed-{args.what}.json"
    header = {**run_metadata(("fla", "mamba_ssm", "causal_conv1d")),
              "settings": {k: v for k, v in vars(args).items() if k != "out"}}
    rows = run_ops(args, device) if args.what == "ops" else run_models(args, device)
    write_json(out, {**header, "rows": rows})
    print(f"wrote {out}")
    return 0
