"""Float64 exactness on 2 and 4 gloo ranks (spawned CPU processes; one spawn per group size):
every sharded recurrent op (both schedules), ring attention (contiguous and zig-zag, full and
windowed) and a six-mixer HybridLM equal their single-process runs to 1e-10."""

import pytest

from tests.parallel.model_cases import check_model
from tests.parallel.op_cases import check_every_op, check_ring
from tests.parallel.spawn import run_ranks


def check_all(rank: int, size: int, method: str) -> None:
    check_every_op(rank, size, 24)
    check_ring(rank, size, 16)
    check_model(rank, size, 16, method)


@pytest.mark.parametrize("size,method", [(2, "sequential"), (4, "scan")])
def test_ops_ring_attention_and_six_mixer_model_exact(size, method):
    run_ranks(size, check_all, method)
