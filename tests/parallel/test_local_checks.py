"""Checks that need no process group: refusals before any message is sent."""

from types import SimpleNamespace

import pytest

from hybridzoo.parallel.comm import ContextParallelError, split_evenly
from hybridzoo.parallel.context import context_parallel, sharded
from hybridzoo.parallel.lightning import ContextParallelCallback
from hybridzoo import kernels


def test_needs_an_initialised_process_group():
    with pytest.raises(ContextParallelError, match="init_process_group"):
        with context_parallel():
            pass


def test_outside_a_context_ops_are_unchanged():
    assert sharded(kernels.chunk_linear_attn) is kernels.chunk_linear_attn


def test_uneven_split_names_the_fix():
    with pytest.raises(ContextParallelError, match="multiple of 4"):
        split_evenly(10, 4, "x")


def test_lightning_callback_refuses_spaco_but_not_seco():
    ContextParallelCallback().on_train_start(None, SimpleNamespace(seco=SimpleNamespace(spaco_budget=None)))
    with pytest.raises(ContextParallelError, match="SpaCO"):
        ContextParallelCallback().on_train_start(None, SimpleNamespace(seco=SimpleNamespace(spaco_budget=2)))


def test_lightning_callback_needs_distributed():
    with pytest.raises(ContextParallelError, match="distributed strategy"):
        ContextParallelCallback().setup(None, None, "fit")
