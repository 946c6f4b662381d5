"""SeCO composed with context parallelism on 2 and 4 gloo ranks (spawned CPU processes, float64):
each rank chunks its own slice, and loss and every gradient of a six-mixer hybrid equal the
single-process full-backprop run to 1e-10; the bytes sent (P = 4) equal the cost formula."""

import pytest

from tests.parallel.seco_cases import check_seco_costs, check_seco_exact
from tests.parallel.spawn import run_ranks


def check_all(rank: int, size: int) -> None:
    check_seco_exact(rank, size)
    if size == 4:
        check_seco_costs(rank, size)


@pytest.mark.parametrize("size", [2, 4])
def test_seco_with_context_parallelism_exact(size):
    run_ranks(size, check_all)
