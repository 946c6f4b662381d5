"""The GPU sweep's case list (``recipe_shapes.cases``) covers every packaged recipe: each recipe's
mixers' Triton ops, at its batch and a ragged length, in bf16 and fp32. CPU only (no kernel runs)."""

from __future__ import annotations

import pytest

from hybridzoo.zoo.recipes import load_recipe_config, recipe_names
from tests.kernels.triton import recipe_shapes

# the Triton ops each mixer kind calls (attention has none of ours: SDPA / flex_attention)
OPS_OF = {"gdn": {"causal_conv1d", "chunk_delta_rule"}, "mamba1": {"causal_conv1d", "selective_scan"},
          "mamba2": {"causal_conv1d", "chunk_linear_attn"}, "gla": {"chunk_linear_attn"},
          "retnet": {"chunk_linear_attn"}, "attn": set()}


@pytest.fixture(scope="module")
def all_cases():
    return recipe_shapes.cases()


def test_cases_cover_every_recipe_op_dtype_and_batch(all_cases):
    names = recipe_names()
    assert len(names) >= 20 and "mqar-gdn-l" in names
    for name in names:
        config = load_recipe_config(name)
        expected = set().union(*(OPS_OF[kind] for kind in config.pattern))
        for kind in ("gla", "retnet"):
            if kind in config.pattern and getattr(config, kind).use_short_conv:
                expected.add("causal_conv1d")
        mine = [c for c in all_cases if name in c["recipes"]]
        assert {c["op"] for c in mine} == expected, name
        assert all({d for d in recipe_shapes.TOLERANCE} == {c["dtype"] for c in mine if c["op"] == op}
                   for op in expected), name
        B, T = recipe_shapes.recipe_batch(name)
        assert all((c["B"], c["T"]) == (B, T) for c in mine), name
        assert T % 16 != 0, name  # ragged for every chunk size
        # every tensor argument's shape is at the recipe's batch and length
        for case in mine:
            shapes = [v["shape"] for v in case["args"].values() if isinstance(v, dict)]
            assert any(s[0] == B and T in s for s in shapes), case


def test_mqar_gdn_l_has_the_shape_that_faulted(all_cases):
    """mqar-gdn-l's delta rule (B 64, T 256 made ragged, 2 heads, K = V = 64) is a case, in bf16."""
    delta = [c for c in all_cases if "mqar-gdn-l" in c["recipes"] and c["op"] == "chunk_delta_rule"]
    assert {c["dtype"] for c in delta} == {"bfloat16", "float32"}
    assert delta[0]["args"]["q"]["shape"] == [64, 253, 2, 64] and delta[0]["args"]["v"]["shape"] == [64, 253, 2, 64]


def test_recipe_batch_reads_the_data_section():
    assert recipe_shapes.recipe_batch("mqar-gdn-l") == (64, 253)
    assert recipe_shapes.recipe_batch("tiny-hybrid") == (8, 253)
    assert recipe_shapes.recipe_batch("gated-deltanet-340m") == (2, 2045)  # no data section: the default
