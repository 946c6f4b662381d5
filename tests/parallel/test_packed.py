"""Packed documents under context parallelism on 3 gloo ranks (see packed_cases.py)."""

from tests.parallel.packed_cases import check_packed_model
from tests.parallel.spawn import run_ranks

def test_packed_documents_context_parallel_exact():
    run_ranks(3, check_packed_model, "scan")
