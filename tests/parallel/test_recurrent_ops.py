"""Sharded recurrent ops equal the single-process op in float64 (gloo, spawned CPU processes)."""

import pytest

from tests.parallel.op_cases import check_every_op
from tests.parallel.spawn import run_ranks


@pytest.mark.parametrize("size", [2, 4])
def test_every_op_exact(size):
    run_ranks(size, check_every_op, 24)
