"""torch_function finds transformers' torch code under both kinds of wrapper it has used."""

from __future__ import annotations

import functools

import pytest
from torch import nn

from benchmarks.transformers_torch_path import torch_function


def torch_code(x):
    return x + 1


def dispatching(fn):
    """Like transformers' ``use_kernel_func_from_hub_with_fallback``: a ``functools.wraps`` wrapper."""

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        return "a kernel"

    return wrapped


def as_function_module(func):
    """Like ``kernels``' decorator on a function (transformers 5.25): an instance of an
    ``nn.Module`` subclass whose ``forward`` calls the function it closes over."""
    import torch

    class Func(nn.Module):
        def forward(self, *args, **kwargs):
            if torch.compiler.is_compiling():
                return "compiled"
            return func(*args, **kwargs)

    return Func()


def test_plain_and_wraps_chains():
    assert torch_function(torch_code) is torch_code
    assert torch_function(dispatching(dispatching(torch_code))) is torch_code


def test_function_module_over_a_wraps_wrapper():
    wrapped = as_function_module(dispatching(torch_code))
    assert wrapped(1) == "a kernel"                        # the wrapper does not call the torch code
    assert torch_function(wrapped) is torch_code
    assert torch_function(as_function_module(as_function_module(torch_code))) is torch_code


def test_an_object_with_no_function_under_it_is_refused():
    with pytest.raises(TypeError, match="no plain function"):
        torch_function(nn.Linear(2, 2))
    with pytest.raises(TypeError, match="no plain function"):
        torch_function(42)


def test_transformers_delta_rule_resolves_to_its_torch_code():
    modeling = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    fn = torch_function(modeling.torch_chunk_gated_delta_rule)
    assert fn.__module__ == modeling.__name__ and fn.__name__ == "torch_chunk_gated_delta_rule"
