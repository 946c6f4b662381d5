"""hybridzoo's benchmarks, one module per benchmark, each with ``main(argv) -> int``.

Run one with ``python -m benchmarks <name> [args]``; ``python -m benchmarks --help`` lists them.
Shared pieces: :mod:`benchmarks.meta` (the run metadata every results file records) and
:mod:`benchmarks.runner` (runs a list of commands over the visible GPUs). Committed results are in
``benchmarks/results/``.
"""
