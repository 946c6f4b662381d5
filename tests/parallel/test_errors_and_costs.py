"""Bad input gets a clear error; the bytes sent equal the formulas of hybridzoo.parallel.costs."""

from tests.parallel.misc_cases import check_costs, check_errors
from tests.parallel.spawn import run_ranks


def check_errors_and_costs(rank: int, size: int) -> None:
    check_errors(rank, size)
    check_costs(rank, size)


def test_bad_input_errors_and_bytes_sent():
    run_ranks(4, check_errors_and_costs)
