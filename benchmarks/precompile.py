"""Every Triton autotuner in the process compiling its candidates side by side: a faster cold cache.

hybridzoo's own autotuned launches compile their candidates on several threads before timing them
(``hybridzoo.kernels.triton.launch.precompile``, ``HYBRIDZOO_COMPILE_THREADS``). A peer's kernels
(fla's) are autotuned by Triton alone, one candidate at a time: fla's GLA model took 523 s to its
first step on an empty cache on an H200. :func:`every_autotuner_precompiled` applies the same
side-by-side compile to every ``triton.autotune`` kernel launched inside it, the peer's included.
The autotuners still time every candidate and choose as before; only the compiles overlap. A
benchmark uses it to fill Triton's cache (``TRITON_CACHE_AUTOTUNING=1``) before a timed run, and
then its peer's first step is no user's cold start (``benchmarks.models`` records the setting).
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator


def add_compile_threads_argument(parser: argparse.ArgumentParser, whose: str, note: str = "") -> None:
    """``--all-compile-threads N`` (``args.all_compile_threads``, default 0, N >= 0) on a
    benchmark's ``parser``; ``whose`` names the other side's tuners in the help ("the peer's"),
    ``note`` ends it."""
    def threads(text: str) -> int:
        value = int(text)
        if value < 0:
            raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
        return value

    parser.add_argument("--all-compile-threads", type=threads, default=0, metavar="N",
                        help=f"every Triton autotuner in the process, {whose} too, compiles its candidates on N "
                        "threads before timing them (benchmarks/precompile.py): fills Triton's cache faster" + note)


@contextlib.contextmanager
def every_autotuner_precompiled(threads: int) -> Iterator[None]:
    """Inside the block, each ``triton.runtime.Autotuner`` that tunes a new key first compiles
    its pruned candidates on ``threads`` threads (the hook hybridzoo's own tuners carry:
    :func:`hybridzoo.kernels.triton.launch.compile_candidates_once`, in ``Autotuner._bench``,
    which runs only while a key is tuned); outside it, Triton's own behaviour. ``threads`` < 2
    changes nothing."""
    if threads < 2:
        yield
        return
    from triton.runtime.autotuner import Autotuner

    from hybridzoo.kernels.triton import launch

    original = Autotuner._bench

    def _bench(self, *args, config, **meta):
        launch.compile_candidates_once(self, args, meta, threads)  # warns and steps aside on failure
        return original(self, *args, config=config, **meta)

    Autotuner._bench = _bench
    try:
        yield
    finally:
        Autotuner._bench = original
