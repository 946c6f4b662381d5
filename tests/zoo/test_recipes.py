"""Packaged recipes: every one loads and has the size in its name; overrides, paths and errors."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import yaml

from hybridzoo import HybridConfig, HybridLM
from hybridzoo.zoo.config import ConfigError
from hybridzoo.zoo.recipes import (
    count_parameters,
    layers_summary,
    load_recipe,
    load_recipe_config,
    nominal_parameters,
    recipe_names,
    recipe_path,
    recipe_table,
)

NAMED = ["mamba-130m", "mamba2-130m", "gla-340m", "retnet-340m", "gated-deltanet-340m",
         "samba-421m", "qwen35-0.8b"]


def fla_mlp_width(d_model: int, hidden_ratio: int) -> int:
    """fla's GatedMLP rule: 2/3 of hidden_ratio * d_model, rounded up to a multiple of 256."""
    return 256 * math.ceil(int(d_model * hidden_ratio * 2 / 3) / 256)


def _mixer_parameters(kind: str, c, d: int) -> int:
    """Parameters of one mixer of ``kind`` with settings ``c`` and width ``d`` (the layer papers'
    projections, written out; no module is built)."""
    if kind == "mamba1":  # in_proj (x, z), depthwise conv, x_proj (dt, B, C), dt_proj, A, D, out_proj
        inner, n = c.expand * d, c.d_state
        rank = math.ceil(d / 16) if c.dt_rank == "auto" else c.dt_rank
        return (2 * inner * d + inner * c.d_conv + inner * c.conv_bias + (rank + 2 * n) * inner
                + rank * inner + inner + inner * n + inner + d * inner
                + c.bias * (2 * inner + d))
    if kind == "mamba2":  # in_proj (z, x, B, C, dt), conv over (x, B, C), dt_bias, A, D, gated norm, out_proj
        inner, groups_n = c.expand * d, c.n_groups * c.d_state
        heads = inner // c.head_dim
        conv = inner + 2 * groups_n
        return ((2 * inner + 2 * groups_n + heads) * d + conv * c.d_conv + conv * c.conv_bias + 3 * heads
                + inner + inner * d + c.bias * (2 * inner + 2 * groups_n + heads + d))
    if kind in ("gla", "retnet"):  # q, k, v, output gate, (short convs), (GLA: low-rank gate), o, norm
        key, value = int(c.expand_k * d), int(c.expand_v * d)
        total = 2 * key * d + value * d + value * d * c.use_output_gate + d * value + value // c.num_heads
        total += c.use_short_conv * (2 * key + value) * (c.conv_size + c.conv_bias)
        if kind == "gla":
            total += c.gate_low_rank_dim * d + key * c.gate_low_rank_dim + key
        return total
    if kind == "gdn":  # q, k, v; z gate; beta; decay; conv over q, k, v; dt_bias, A; norm; out_proj
        key, value = c.num_k_heads * c.head_k_dim, c.num_v_heads * c.head_v_dim
        qkv = 2 * key + value
        return qkv * d + value * d + 2 * c.num_v_heads * d + qkv * c.conv_size + 2 * c.num_v_heads \
            + c.head_v_dim + d * value
    if kind == "attn":  # q (doubled with an output gate), k, v, o, (q/k norms), (biases)
        head = c.head_dim or d // c.n_heads
        kv_heads = c.n_kv_heads or c.n_heads
        q, kv = c.n_heads * head * (1 + c.output_gate), kv_heads * head
        return (q + 2 * kv) * d + d * c.n_heads * head + 2 * head * c.qk_norm + c.bias * (q + 2 * kv + d)
    raise AssertionError(kind)


def parameters_by_formula(config: HybridConfig) -> int:
    """Distinct parameters of ``HybridLM(config)`` from its settings: embedding, per block a norm
    and its mixer, a norm and a SwiGLU MLP (d_mlp None: 8/3 d rounded up to a multiple of 64; 0:
    none), the final norm and, untied, the LM head."""
    d = config.d_model
    mlp = 64 * math.ceil(8 * d / 3 / 64) if config.d_mlp is None else config.d_mlp
    kinds = config.layer_kinds()
    per_block = [d + _mixer_parameters(kind, getattr(config, kind), d) + (d + 3 * d * mlp if mlp else 0)
                 for kind in kinds]
    return config.vocab_size * d * (1 if config.tie_embeddings else 2) + sum(per_block) + d


def test_the_recipes_are_packaged():
    names = recipe_names()
    assert names == sorted(names)
    for name in ["tiny-hybrid", *NAMED]:
        assert name in names
    assert any(name.startswith("jamba-style-") for name in names)


@pytest.mark.parametrize("name", recipe_names())
def test_recipe_builds_on_meta_with_the_size_in_its_name(name):
    data = load_recipe(name)
    assert set(data["model"]) >= {"config"}
    config = load_recipe_config(name)
    assert isinstance(config, HybridConfig)
    with torch.device("meta"):
        model = HybridLM(config)
    assert len(model.blocks) == config.n_layers
    # independent count: the published parameter formulas of each mixer, from the config alone
    total = parameters_by_formula(config)
    assert count_parameters(config) == total
    nominal = nominal_parameters(name)
    if name == "tiny-hybrid" or name.startswith("mqar-"):  # task recipes: sized for the task, not named by size
        assert nominal is None
    else:
        assert nominal is not None, f"{name}: no size in the name"
        assert abs(total / nominal - 1) <= 0.10, f"{name}: {total:,} parameters vs {nominal:,} in its name"
    # the YAML documents its source (or, for tiny-hybrid, what it is for)
    assert recipe_path(name).read_text().lstrip().startswith("#")


def test_named_recipes_match_their_published_shapes():
    mamba = load_recipe_config("mamba-130m")
    assert (mamba.d_model, mamba.n_layers, mamba.pattern, mamba.mlp_width, mamba.tie_embeddings) == \
        (768, 24, ["mamba1"], 0, True)
    assert mamba.vocab_size in (50277, 50280)
    mamba2 = load_recipe_config("mamba2-130m")
    assert (mamba2.d_model, mamba2.n_layers, mamba2.pattern, mamba2.mlp_width) == (768, 24, ["mamba2"], 0)
    assert (mamba2.mamba2.d_state, mamba2.mamba2.head_dim) == (128, 64)
    for name, kind, ratio in [("gla-340m", "gla", 4), ("retnet-340m", "retnet", 2),
                              ("gated-deltanet-340m", "gdn", 4)]:
        config = load_recipe_config(name)
        assert (config.d_model, config.vocab_size, config.pattern) == (1024, 32000, [kind])
        assert config.mlp_width == fla_mlp_width(1024, ratio)
    samba = load_recipe_config("samba-421m")
    assert samba.layer_kinds()[:2] == ["mamba1", "attn"] and samba.mlp_width > 0
    assert samba.attn.window == 2048
    qwen = load_recipe_config("qwen35-0.8b")
    kinds = qwen.layer_kinds()
    assert kinds.count("gdn") == 3 * kinds.count("attn") and kinds[3::4] == ["attn"] * 6
    assert qwen.attn.output_gate and qwen.attn.qk_norm and qwen.attn.partial_rotary_factor < 1
    assert qwen.norm_zero_centered and qwen.attn.norm_zero_centered
    jamba = load_recipe_config(next(n for n in recipe_names() if n.startswith("jamba-style-")))
    kinds = jamba.layer_kinds()
    assert kinds.count("mamba1") == 7 * kinds.count("attn") and jamba.mlp_width > 0


def test_recipe_table():
    table = recipe_table()
    assert [row["name"] for row in table] == recipe_names()
    for row in table:
        assert set(row) == {"name", "layers", "d_model", "n_layers", "parameters"}
        config = load_recipe_config(row["name"])
        assert (row["d_model"], row["n_layers"]) == (config.d_model, config.n_layers)
        assert isinstance(row["parameters"], int)
    tiny = next(row for row in table if row["name"] == "tiny-hybrid")
    assert tiny["parameters"] == HybridLM.from_recipe("tiny-hybrid").num_parameters()  # a real model
    assert tiny["layers"] == "gdn mamba2 attn x2"
    cut = HybridConfig(n_layers=5, layers="mamba1 attn", **_small())
    assert layers_summary(cut) == "mamba1 attn x2 + mamba1"
    with pytest.raises(ConfigError, match="n_layers is 1"):  # a pattern longer than n_layers
        HybridConfig(n_layers=1, layers="gdn gdn attn", **_small())


def test_tied_head_counted_once():
    tied = load_recipe_config("tiny-hybrid")
    untied = load_recipe_config("tiny-hybrid", tie_embeddings=False)
    assert count_parameters(untied) - count_parameters(tied) == tied.vocab_size * tied.d_model


@pytest.mark.parametrize("name, expected", [
    ("mamba-130m", 130_000_000), ("mamba2-130m", 130_000_000), ("qwen35-0.8b", 800_000_000),
    ("samba-421m", 421_000_000), ("jamba-style-400m", 400_000_000), ("tiny-hybrid", None),
    ("gla-340M", 340_000_000), ("model-1.5B-chat", 1_500_000_000), ("x-250k", 250_000),
    ("recipes/mamba-130m.yaml", 130_000_000), ("llama2", None), ("gpt-4o", None),
])
def test_nominal_parameters(name, expected):
    assert nominal_parameters(name) == expected


def test_tiny_hybrid_trains_on_cpu():
    config = load_recipe_config("tiny-hybrid")
    assert config.vocab_size == 256
    assert len(set(config.layer_kinds())) >= 3
    torch.manual_seed(0)
    model = HybridLM.from_recipe("tiny-hybrid", backend="reference")
    assert 100_000 <= model.num_parameters() <= 1_000_000
    ids = torch.randint(0, 256, (2, 96))  # longer than the window and several chunks long
    _, _, loss = model(ids, labels=ids)
    assert torch.isfinite(loss) and abs(loss.item() - math.log(256)) < 0.5
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    assert sum(float(p.grad.abs().sum()) for p in model.parameters()) > 0
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    optimizer.step()
    with torch.no_grad():
        _, _, after = model(ids, labels=ids)
    assert after < loss  # the step learned something on this batch


def test_from_recipe_overrides():
    model = HybridLM.from_recipe("tiny-hybrid", n_layers=2, layers="mamba2 attn")
    assert [block.kind for block in model.blocks] == ["mamba2", "attn"]
    recipe = load_recipe_config("tiny-hybrid")
    assert model.config.d_model == recipe.d_model and model.config.attn == recipe.attn
    # a dict for a mixer block is merged into the recipe's block, not a replacement of it
    merged = load_recipe_config("tiny-hybrid", attn={"window": 16})
    assert merged.attn.window == 16 and merged.attn.n_heads == recipe.attn.n_heads
    assert load_recipe_config("tiny-hybrid").attn.window == recipe.attn.window  # nothing mutated


def _small() -> dict:
    gdn = dict(num_k_heads=2, num_v_heads=2, head_k_dim=8, head_v_dim=8)
    return dict(vocab_size=17, d_model=16, d_mlp=32, mamba1=dict(d_state=4), attn=dict(n_heads=2), gdn=gdn)


def _write(path: Path, config: dict, lightning_form: bool = False) -> Path:
    model = {"class_path": "hybridzoo.training.HybridLightningModule",
             "init_args": {"config": config}} if lightning_form else {"config": config}
    path.write_text(yaml.safe_dump({"model": model, "trainer": {"max_steps": 3}}))
    return path


@pytest.mark.parametrize("lightning_form", [False, True])
def test_yaml_path(tmp_path, lightning_form):
    path = _write(tmp_path / "mine.yaml", dict(n_layers=3, layers="mamba1 attn", **_small()), lightning_form)
    for given in (path, str(path)):
        model = HybridLM.from_recipe(given, d_mlp=0)
        assert [block.kind for block in model.blocks] == ["mamba1", "attn", "mamba1"]
        assert model.config.d_model == 16 and model.config.mlp_width == 0
    assert nominal_parameters(path) is None


def test_unknown_recipe_name_lists_the_recipes(tmp_path):
    with pytest.raises(FileNotFoundError) as error:
        HybridLM.from_recipe("no-such-recipe")
    assert "no-such-recipe" in str(error.value)
    for name in recipe_names():
        assert name in str(error.value)
    with pytest.raises(FileNotFoundError):
        HybridLM.from_recipe(tmp_path / "missing.yaml")


@pytest.mark.parametrize("change, named", [
    ({"hidden_size": 64}, "hidden_size"),                              # unknown HybridConfig key
    ({"gdn": {"num_heads": 4}}, "num_heads"),                           # unknown key of a mixer block
    ({"layers": "gdn lstm attn"}, "lstm"),                              # unknown mixer kind
])
def test_bad_recipe_raises_config_error_naming_it(tmp_path, change, named):
    config = dict(n_layers=3, layers="mamba1 attn", **_small())
    for key, value in change.items():
        config[key] = {**config[key], **value} if isinstance(value, dict) and key in config else value
    path = _write(tmp_path / "bad.yaml", config)
    with pytest.raises(ConfigError, match=named):
        HybridLM.from_recipe(path)


def test_recipe_without_model_config_section(tmp_path):
    path = tmp_path / "nomodel.yaml"
    path.write_text("trainer:\n  max_steps: 3\n")
    with pytest.raises(ConfigError, match="model"):
        load_recipe_config(path)
