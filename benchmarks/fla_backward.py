"""fla 0.6 refuses the backward of its gated chunk kernels on Hopper with Triton < 3.7.1.

Benchmarks that time or train fla's gated layers lift that check with :func:`allow_fla_gated_backward`
(``fla.ops.common.chunk_o.TRITON_ABOVE_3_7_1 = True``) and say so next to their figures.
"""

from __future__ import annotations


def allow_fla_gated_backward() -> None:
    """Set fla's ``TRITON_ABOVE_3_7_1`` where the installed Triton is older than 3.7 (newer
    Tritons pass fla's own check)."""
    import triton
    from fla.ops.common import chunk_o

    if tuple(int(p) for p in triton.__version__.split(".")[:2]) < (3, 7):
        chunk_o.TRITON_ABOVE_3_7_1 = True
