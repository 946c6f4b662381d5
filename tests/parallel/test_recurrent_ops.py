"""Sharded recurrent ops and ring attention equal the single-process ops in float64 (gloo,
spawned CPU processes; one spawn per group size runs every case)."""

import pytest

from tests.parallel.op_cases import check_every_op, check_ring
from tests.parallel.spawn import run_ranks


def check_ops_and_ring(rank: int, size: int) -> None:
    check_every_op(rank, size, 24)
    check_ring(rank, size, 16)


@pytest.mark.parametrize("size", [2, 4])
def test_every_op_and_ring_attention_exact(size):
    run_ranks(size, check_ops_and_ring)
