"""Packed documents under context parallelism on 2 and 4 gloo ranks (see packed_cases.py)."""

import pytest

from tests.parallel.packed_cases import check_packed_model
from tests.parallel.spawn import run_ranks


@pytest.mark.parametrize("size,method", [(2, "sequential"), (4, "scan")])
def test_packed_documents_context_parallel_exact(size, method):
    run_ranks(size, check_packed_model, method)
