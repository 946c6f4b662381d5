"""``hybridzoo demo``: run every reference kernel on random data and check it against its loop.

Until the training issue lands this is the README's main command: it shows that the install
works and what each op computes, with its float64 error against the step-by-step ground truth.
"""

from __future__ import annotations

import time

import torch

from hybridzoo import kernels
from hybridzoo.kernels import reference
from hybridzoo.utils import rel_err


def _cases(B: int, T: int, H: int, D: int, generator: torch.Generator):
    def randn(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64)

    q, k, v = randn(B, T, H, D), randn(B, T, H, D), randn(B, T, H, D)
    k_unit = torch.nn.functional.normalize(k, dim=-1)
    log_a = -torch.rand(B, T, H, generator=generator, dtype=torch.float64) * 0.2
    log_a_key = -torch.rand(B, T, H, D, generator=generator, dtype=torch.float64) * 0.2
    beta = torch.rand(B, T, H, generator=generator, dtype=torch.float64)
    Dm, N = H * D, 16
    u, delta = randn(B, T, Dm), torch.rand(B, T, Dm, generator=generator, dtype=torch.float64)
    A = -torch.rand(Dm, N, generator=generator, dtype=torch.float64) - 0.5
    Bs, Cs = randn(B, T, N), randn(B, T, N)
    w = randn(Dm, 4)
    return [
        ("chunk_linear_attn (RetNet / Mamba-2 SSD: one decay per head)",
         lambda: kernels.chunk_linear_attn(q, k, v, log_a, chunk_size=64)[0],
         lambda: reference.linear_attn_loop(q, k, v, log_a)[0]),
        ("chunk_linear_attn (GLA: one decay per key)",
         lambda: kernels.chunk_linear_attn(q, k, v, log_a_key, chunk_size=64)[0],
         lambda: reference.linear_attn_loop(q, k, v, log_a_key)[0]),
        ("chunk_delta_rule (Gated DeltaNet)",
         lambda: kernels.chunk_delta_rule(q, k_unit, v, log_a, beta, chunk_size=64)[0],
         lambda: reference.delta_rule_loop(q, k_unit, v, log_a, beta)[0]),
        ("selective_scan (Mamba-1)",
         lambda: kernels.selective_scan(u, delta, A, Bs, Cs)[0],
         lambda: reference.selective_scan_loop(u, delta, A, Bs, Cs)[0]),
        ("attention (sliding window 64)",
         lambda: kernels.attention(q, k, v, window=64)[0],
         lambda: reference.attention_loop(q, k, v, window=64)[0]),
        ("causal_conv1d (width 4)",
         lambda: kernels.causal_conv1d(u, w)[0],
         lambda: reference.causal_conv1d_loop(u, w)[0]),
    ]


def run_demo(batch: int = 2, seq_len: int = 256, heads: int = 4, head_dim: int = 32, seed: int = 0) -> list[dict]:
    """Run each op's default path and its step loop in float64; return one row per op."""
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for name, fast, loop in _cases(batch, seq_len, heads, head_dim, generator):
        start = time.perf_counter()
        out = fast()
        fast_s = time.perf_counter() - start
        start = time.perf_counter()
        ref = loop()
        loop_s = time.perf_counter() - start
        rows.append({"op": name, "rel_err": rel_err(out, ref), "ms": 1e3 * fast_s, "loop_ms": 1e3 * loop_s})
    return rows


def main(seq_len: int = 256) -> int:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    console.print(f"hybridzoo reference kernels, float64, B=2 T={seq_len} H=4 D=32, CPU threads={torch.get_num_threads()}")
    rows = run_demo(seq_len=seq_len)
    table = Table(title="each op against its step-by-step loop (the ground truth)")
    for column in ("op", "rel. error", "op ms", "loop ms"):
        table.add_column(column)
    worst = 0.0
    for row in rows:
        worst = max(worst, row["rel_err"])
        table.add_row(row["op"], f"{row['rel_err']:.1e}", f"{row['ms']:.1f}", f"{row['loop_ms']:.1f}")
    console.print(table)
    ok = worst <= 1e-10
    console.print(f"worst relative error {worst:.1e}: " + ("[green]all ops exact[/green]" if ok else "[red]MISMATCH[/red]"))
    return 0 if ok else 1
