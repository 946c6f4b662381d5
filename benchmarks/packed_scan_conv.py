"""Packed (cu_seqlens) against unpacked Triton selective_scan and causal_conv1d at Mamba-130m's shapes.

One row of T 8192 tokens (bf16, Dm 1536, N 16, conv width 4, SiLU; the scan with D, z and a
softplus bias), packed with log-normal documents (median about 600 tokens, some longer than the
row; ``tests/kernels/triton/test_scan_conv_varlen.lognormal_lengths``) or left as one sequence.
Forward alone and forward + backward, median of ``triton.testing.do_bench``, two interleaved
passes (the smaller kept). ``--cached``: the document index computed once outside the timed call
(the kernels' cost alone; without it each call validates ``cu_seqlens`` and builds the index, as
a layer does).

    python -m benchmarks packed_scan_conv [--cached] [--seeds 0,1] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    import torch
    from triton.testing import do_bench

    import hybridzoo.kernels.triton.conv as conv_module
    import hybridzoo.kernels.triton.selective_scan as scan_module
    from benchmarks.meta import run_metadata, write_json
    from tests.kernels.triton.test_scan_conv_varlen import _cu, lognormal_lengths

    parser = argparse.ArgumentParser(prog="python -m benchmarks packed_scan_conv", description=__doc__.splitlines()[0])
    parser.add_argument("--cached", action="store_true", help="build the document index once, outside the timing")
    parser.add_argument("--seeds", default="0,1", help="document-length draws (comma-separated)")
    parser.add_argument("--out", default=None, help="write the rows and the run's metadata as JSON")
    args = parser.parse_args(argv)
    dev, dtype = "cuda", torch.bfloat16
    T, dm, n, width = 8192, 1536, 16, 4
    rows = []
    for seed in (int(s) for s in args.seeds.split(",")):
        lengths = lognormal_lengths(T, seed=seed)
        cu = _cu(lengths, dev)
        scan_packed, conv_packed = scan_module._packed, conv_module._packed
        if args.cached:
            row = torch.empty(1, T, dm, device=dev)
            scan_docs = scan_packed(cu, row, torch.empty(dm, n), None, "selective_scan")
            conv_docs = conv_packed(cu, row, width, None)
            scan_module._packed = lambda c, *a: scan_docs if c is not None else (None, 0)
            conv_module._packed = lambda c, *a: conv_docs if c is not None else None
        torch.manual_seed(0)
        leaf = lambda *shape, scale=1.0, shift=0.0: (scale * torch.randn(*shape, device=dev) + shift).to(dtype).requires_grad_()  # noqa: E731
        u, delta, z = leaf(1, T, dm), leaf(1, T, dm, scale=0.5, shift=-4.0), leaf(1, T, dm)
        B, C = leaf(1, T, n), leaf(1, T, n)
        A = (-torch.arange(1, n + 1, device=dev, dtype=torch.float32).repeat(dm, 1)).requires_grad_()
        D, bias = torch.randn(dm, device=dev, requires_grad=True), torch.randn(dm, device=dev, requires_grad=True)
        x, weight, conv_bias = leaf(1, T, dm), leaf(dm, width), leaf(dm)
        dy = torch.randn(1, T, dm, device=dev, dtype=dtype)

        def scan(packed, backward):
            y, _ = scan_module.selective_scan(u, delta, A, B, C, D, z, bias, True, None, False,
                                              cu_seqlens=cu if packed else None)
            if backward:
                y.backward(dy)

        def conv(packed, backward):
            y, _ = conv_module.causal_conv1d(x, weight, conv_bias, activation="silu", cu_seqlens=cu if packed else None)
            if backward:
                y.backward(dy)

        for name, op in (("selective_scan", scan), ("causal_conv1d", conv)):
            for backward in (False, True):
                times = {False: [], True: []}
                for _ in range(2):
                    for packed in (False, True):
                        def call(packed=packed, backward=backward):
                            with torch.set_grad_enabled(backward):
                                op(packed, backward)
                        call()
                        torch.cuda.synchronize()
                        times[packed].append(do_bench(call, warmup=50, rep=300))
                rows.append(dict(op=name, passes="forward+backward" if backward else "forward", seed=seed,
                                 documents=len(lengths), cached_index=args.cached,
                                 unpacked_ms=min(times[False]), packed_ms=min(times[True]),
                                 ratio=min(times[True]) / min(times[False])))
                print(rows[-1], flush=True)
        scan_module._packed, conv_module._packed = scan_packed, conv_packed
    if args.out:
        write_json(args.out, {**run_metadata(), "shape": dict(T=T, Dm=dm, N=n, W=width, dtype="bf16"), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
