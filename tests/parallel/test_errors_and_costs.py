"""Bad input gets a clear error; the bytes sent equal the formulas of hybridzoo.parallel.costs."""

from tests.parallel.misc_cases import check_costs, check_errors
from tests.parallel.model_cases import check_model
from tests.parallel.spawn import run_ranks


def check_errors_and_costs(rank: int, size: int) -> None:
    check_errors(rank, size)
    check_costs(rank, size)
    check_model(rank, size, 12, "scan")   # a group size that is not a power of two


def test_bad_input_errors_bytes_sent_and_three_ranks():
    """P = 3: errors, bytes against the formulas, and the six-mixer model exact (Hillis-Steele
    with a partial last round)."""
    run_ranks(3, check_errors_and_costs)
