"""HybridLM with all six mixers, sharded over 2 and 4 gloo ranks, equals the single-process model."""

import pytest

from tests.parallel.model_cases import check_model
from tests.parallel.spawn import run_ranks


@pytest.mark.parametrize("size,method", [(2, "sequential"), (4, "scan")])
def test_six_mixer_model_exact(size, method):
    run_ranks(size, check_model, 16, method)
