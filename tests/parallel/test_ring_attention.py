"""Ring attention (contiguous and zig-zag, full and sliding-window) equals single-process attention."""

import pytest

from tests.parallel.op_cases import check_ring
from tests.parallel.spawn import run_ranks


@pytest.mark.parametrize("size", [2, 4])
def test_ring_attention_exact(size):
    run_ranks(size, check_ring, 16)
