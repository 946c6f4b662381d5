"""Converters from Hugging Face checkpoints: logits and greedy generations of tiny random
transformers models (pure-PyTorch paths forced) against ``from_hf`` of their saved safetensors,
round trips through ``convert_checkpoint``, and the errors."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch

from hybridzoo import HybridLM
from hybridzoo.utils import rel_err
from hybridzoo.zoo.convert import (ConversionError, convert_checkpoint, from_hf, hf_to_hybrid_config,
                                   save_converted)
from tests.hf_pure import force_pure_path, needs_parity_transformers

transformers = pytest.importorskip("transformers", reason="the converters are tested against transformers")

VOCAB = 64
QWEN = dict(vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=4,
            num_attention_heads=2, num_key_value_heads=1, head_dim=8, linear_num_key_heads=2,
            linear_num_value_heads=4, linear_key_head_dim=4, linear_value_head_dim=3,
            linear_conv_kernel_dim=3, rms_norm_eps=1e-6,
            layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
            rope_parameters={"rope_type": "default", "rope_theta": 5000.0, "partial_rotary_factor": 0.5})


def build_hf(family: str):
    """A tiny float32 transformers model of ``family`` and the pure-path family key."""
    if family == "mamba":   # tied embeddings, biases, explicit dt rank
        config = transformers.MambaConfig(vocab_size=VOCAB, hidden_size=16, state_size=4, num_hidden_layers=3,
                                          conv_kernel=3, time_step_rank=3, use_bias=True,
                                          tie_word_embeddings=True)
        return transformers.MambaForCausalLM(config), "mamba"
    if family == "mamba2":  # untied, 2 groups of B/C, time_step_limit (0, inf) in config.json
        config = transformers.Mamba2Config(vocab_size=VOCAB, hidden_size=16, state_size=4, num_heads=8,
                                           head_dim=4, n_groups=2, num_hidden_layers=2, chunk_size=8)
        return transformers.Mamba2ForCausalLM(config), "mamba2"
    if family == "qwen3_next":  # MoE configured but every layer dense through mlp_only_layers
        config = transformers.Qwen3NextConfig(**QWEN, num_experts=4, mlp_only_layers=[0, 1, 2, 3])
        return transformers.Qwen3NextForCausalLM(config), "qwen3_next"
    if family == "qwen3_5":  # the text model alone, tied embeddings
        config = transformers.Qwen3_5TextConfig(**QWEN, tie_word_embeddings=True)
        return transformers.Qwen3_5ForCausalLM(config), "qwen3_5"
    if family == "qwen3_5_vl":  # the multimodal checkpoint: text_config, model.language_model.*
        vision = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=16,
                      patch_size=2, temporal_patch_size=1, num_position_embeddings=16)
        config = transformers.Qwen3_5Config(text_config=QWEN, vision_config=vision)
        return transformers.Qwen3_5ForConditionalGeneration(config), "qwen3_5"
    raise AssertionError(family)


def saved_hf(family: str, directory, shard: bool = False):
    """Build, perturb (so every parameter matters: zero-centred norms, dt biases, ...) and save."""
    torch.manual_seed(0)
    hf, pure = build_hf(family)
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.1 * torch.randn_like(p))
    hf.save_pretrained(directory, max_shard_size="20KB" if shard else "5GB")
    return hf.eval(), pure


FAMILIES = ["mamba", pytest.param("mamba2", marks=needs_parity_transformers), "qwen3_next", "qwen3_5", "qwen3_5_vl"]
PURE_CALLS = {"mamba": "mamba_selective_scan", "mamba2": "mamba2_chunk_scan",
              "qwen3_next": "torch_chunk_gated_delta_rule", "qwen3_5": "torch_chunk_gated_delta_rule"}


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_and_greedy_generation_match_transformers(family, tmp_path, monkeypatch):
    shard = family == "qwen3_next"  # also read a sharded checkpoint through its index
    hf, pure = saved_hf(family, tmp_path, shard=shard)
    assert (tmp_path / "model.safetensors.index.json").is_file() == shard
    calls = force_pure_path(monkeypatch, pure)
    ours = from_hf(tmp_path)
    assert not ours.training and ours.embed.weight.dtype == torch.float32

    torch.manual_seed(1)
    ids = torch.randint(0, VOCAB, (2, 13))
    with torch.no_grad():
        ref = hf(ids).logits
        logits, _ = ours(ids)
    assert calls[PURE_CALLS[pure]] >= 1, calls        # transformers really ran its torch code
    assert rel_err(logits, ref) <= 1e-4, rel_err(logits, ref)

    hf.generation_config.eos_token_id = None         # never stop early: 8 tokens each
    hf.generation_config.pad_token_id = 0            # (an explicit mask: no token is padding)
    expected = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)
    assert expected.shape == (2, 13 + 8)
    assert torch.equal(ours.generate(ids, max_new_tokens=8), expected)


def test_layer_pattern_norms_and_tying(tmp_path):
    saved_hf("qwen3_5_vl", tmp_path)
    model = from_hf(tmp_path)
    config = model.config
    assert config.layer_kinds() == ["gdn", "attn", "gdn", "attn"] and config.norm_zero_centered
    assert config.attn.output_gate and config.attn.qk_norm and config.attn.norm_zero_centered
    assert model.blocks[1].mixer.rotary.rotary_dim == 4 and config.attn.rope_base == 5000.0
    assert config.d_mlp == 24 and not config.tie_embeddings
    assert model.blocks[0].mixer.A_log._no_weight_decay        # parameter attributes survive loading

    saved_hf("mamba", tmp_path / "mamba")
    mamba = from_hf(tmp_path / "mamba")
    assert mamba.config.d_mlp == 0 and mamba.blocks[0].mlp is None and not mamba.config.norm_zero_centered
    assert mamba.lm_head.weight is mamba.embed.weight          # tied: lm_head.weight was not saved


def test_dtype_and_buffers(tmp_path):
    saved_hf("qwen3_5", tmp_path)
    ref = from_hf(tmp_path)
    model = from_hf(tmp_path, dtype="bf16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.blocks[1].mixer.rotary.inv_freq().dtype == torch.float32
    assert torch.equal(model.blocks[1].mixer.rotary.inv_freq(), ref.blocks[1].mixer.rotary.inv_freq())
    ids = torch.randint(0, VOCAB, (1, 9))
    with torch.no_grad():
        assert rel_err(model(ids)[0], ref(ids)[0]) <= 3e-2


@pytest.mark.parametrize("family", ["mamba2", "qwen3_5_vl"])
def test_convert_checkpoint_round_trip(family, tmp_path, capsys):
    saved_hf(family, tmp_path / "hf")
    capsys.readouterr()                              # transformers' own progress bar
    out = convert_checkpoint(tmp_path / "hf", tmp_path / "ours")
    assert out == tmp_path / "ours" and capsys.readouterr() == ("", "")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    loaded = HybridLM.from_pretrained(out)
    direct = from_hf(tmp_path / "hf")
    if family == "mamba2":                           # (0, inf) survives both JSON files
        assert loaded.config.mamba2.time_step_limit[1] == math.inf
    ids = torch.randint(0, VOCAB, (2, 11))
    with torch.no_grad():
        assert torch.equal(loaded(ids)[0], direct(ids)[0])
    assert save_converted(direct, tmp_path / "again") == tmp_path / "again"


def write_config(directory, config: dict):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def test_unknown_architecture_lists_supported(tmp_path):
    write_config(tmp_path, {"architectures": ["LlamaForCausalLM"], "model_type": "llama"})
    with pytest.raises(ConversionError, match=r"LlamaForCausalLM.*MambaForCausalLM, Mamba2ForCausalLM, "
                                              r"Qwen3NextForCausalLM, Qwen3_5ForCausalLM"):
        from_hf(tmp_path)
    with pytest.raises(ConversionError, match="not a directory.*not a hub id"):
        from_hf("Qwen/Qwen3-Next-80B-A3B-Instruct")


@pytest.mark.parametrize("overrides,layers", [({}, "[0, 1, 2, 3]"),
                                              ({"num_experts": 4, "decoder_sparse_step": 2}, "[1, 3]"),
                                              ({"num_experts": 4, "mlp_only_layers": [0, 2, 3]}, "[1]")])
def test_moe_is_refused(tmp_path, overrides, layers):
    config = transformers.Qwen3NextConfig(**QWEN, **overrides)   # default: num_experts=512
    config.save_pretrained(tmp_path)
    with pytest.raises(ConversionError, match=rf"layers {re.escape(layers)} are sparse MoE.*mixture-of-exp"):
        from_hf(tmp_path)
    moe35 = {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe"}
    with pytest.raises(ConversionError, match="mixture-of-experts"):
        from_hf(write_config(tmp_path / "moe35", moe35))


def test_dense_qwen3_next_config_and_rope_checks():
    config = transformers.Qwen3NextConfig(**QWEN, num_experts=0).to_dict()
    assert hf_to_hybrid_config(config).layer_kinds() == ["gdn", "attn", "gdn", "attn"]
    config["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}
    with pytest.raises(ConversionError, match="rope_type 'yarn' is not supported"):
        hf_to_hybrid_config(config)


def test_missing_extra_and_no_tensors(tmp_path):
    from safetensors.torch import load_file, save_file

    saved_hf("mamba", tmp_path)
    weights = tmp_path / "model.safetensors"
    tensors = load_file(weights)
    save_file({k: v for k, v in tensors.items() if k != "backbone.layers.1.mixer.D"}, weights)
    with pytest.raises(ConversionError, match=r"missing.*blocks\.1\.mixer\.D"):
        from_hf(tmp_path)
    save_file({**tensors, "backbone.layers.0.mixer.B_norm.weight": torch.ones(4)}, weights)
    with pytest.raises(ConversionError, match=r"backbone\.layers\.0\.mixer\.B_norm\.weight"):
        from_hf(tmp_path)
    weights.unlink()
    with pytest.raises(ConversionError, match=r"no \*\.safetensors.*pytorch_model\.bin"):
        from_hf(tmp_path)
    with pytest.raises(ConversionError, match="unknown dtype"):
        from_hf(tmp_path, dtype="int8")


def console_command() -> list[str]:
    """The installed ``hybridzoo`` script, or (not installed) the module it runs."""
    import shutil
    import sys
    from pathlib import Path

    found = shutil.which("hybridzoo", path=str(Path(sys.executable).parent))
    return [found] if found else [sys.executable, "-m", "hybridzoo.cli"]


@needs_parity_transformers
def test_cli_convert_then_eval_round_trip(tmp_path, monkeypatch):
    """``hybridzoo convert SRC OUT`` on a saved byte-level transformers Mamba-2, then
    ``hybridzoo eval OUT --data FILE``: the held-out loss it reports is the transformers model's own
    cross-entropy on the same rows (its pure-PyTorch path)."""
    import os
    import subprocess
    from pathlib import Path

    import torch.nn.functional as F

    from hybridzoo.training.data import TextDataModule
    from tests.training.test_cli import write_corpus

    torch.manual_seed(0)
    config = transformers.Mamba2Config(vocab_size=256, hidden_size=16, state_size=4, num_heads=8, head_dim=4,
                                       n_groups=2, num_hidden_layers=2, chunk_size=8)
    hf = transformers.Mamba2ForCausalLM(config)
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.1 * torch.randn_like(p))
    hf.save_pretrained(tmp_path / "hf")
    corpus = write_corpus(tmp_path / "corpus.jsonl")
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    run = subprocess.run([*console_command(), "convert", str(tmp_path / "hf"), str(tmp_path / "ours")],
                         capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "converted" in run.stdout
    assert sorted(p.name for p in (tmp_path / "ours").iterdir()) == ["config.json", "model.safetensors"]
    run = subprocess.run([*console_command(), "eval", str(tmp_path / "ours"), "--data", str(corpus),
                          "--device", "cpu", "--json"], capture_output=True, text=True, env=env, cwd=tmp_path,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout)
    data = TextDataModule(paths=[str(corpus)])  # what eval builds for --data without training.json
    data.setup("validate")
    rows = torch.stack([data._val_set[i]["input_ids"] for i in range(len(data._val_set))])
    force_pure_path(monkeypatch, "mamba2")
    with torch.no_grad():
        logits = hf.eval()(rows).logits
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, 256), rows[:, 1:].reshape(-1)).item()
    assert result["tokens"] == rows[:, 1:].numel()
    assert result["loss"] == pytest.approx(loss, rel=1e-4)
