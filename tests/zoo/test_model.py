"""HybridLM over random mixer patterns: forward, backward, decoding == full forward."""

import itertools
import random

import pytest
import torch

from hybridzoo import HybridConfig, HybridLM
from hybridzoo.zoo import ConfigError
from hybridzoo.utils import rel_err
from tests.zoo.tiny import KINDS, tiny_config


def _random_patterns(n: int, seed: int = 0) -> list[list[str]]:
    """Seeded random patterns; together they put every kind next to every other kind."""
    rng = random.Random(seed)
    patterns = [[a, b] for a, b in itertools.permutations(KINDS, 2)]  # every ordered pair
    rng.shuffle(patterns)
    # merge the pairs into a few longer stacks, plus a few fully random ones
    stacks = [sum(patterns[i:i + 5], []) for i in range(0, len(patterns), 5)]
    stacks += [[rng.choice(KINDS) for _ in range(rng.randint(2, 6))] for _ in range(n)]
    return stacks


@pytest.mark.parametrize("layers", _random_patterns(3), ids=lambda p: "-".join(p))
def test_decoding_token_by_token_equals_full_forward(layers):
    torch.manual_seed(len(layers))
    model = HybridLM(tiny_config(layers)).double()
    ids = torch.randint(0, 37, (2, 13))
    logits, _ = model(ids)
    # prefill 5 tokens, then decode one at a time with the carried state
    step_logits, state = model(ids[:, :5])
    outs = [step_logits]
    for t in range(5, 13):
        out, state = model(ids[:, t:t + 1], state)
        outs.append(out)
    assert rel_err(torch.cat(outs, 1), logits) <= 1e-10


def test_every_pair_of_kinds_appears_in_the_random_patterns():
    pairs = {(p[i], p[i + 1]) for p in _random_patterns(3) for i in range(len(p) - 1)}
    assert pairs >= set(itertools.permutations(KINDS, 2))


def test_forward_backward_reaches_every_parameter():
    torch.manual_seed(0)
    model = HybridLM(tiny_config("mamba1 mamba2 gla retnet gdn attn"))
    ids = torch.randint(0, 37, (2, 11))
    logits, state, loss = model(ids, labels=ids)
    assert logits.shape == (2, 11, 37) and len(state) == 6
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    assert model.lm_head.weight is model.embed.weight  # tied by default


def test_loss_is_mean_cross_entropy_over_non_ignored_shifted_labels():
    torch.manual_seed(1)
    model = HybridLM(tiny_config("gdn attn")).double()
    ids = torch.randint(0, 37, (2, 9))
    labels = ids.clone()
    labels[0, :4] = -100
    logits, _, loss = model(ids, labels=labels)
    logp = logits.log_softmax(-1)
    picked = [-logp[b, t, labels[b, t + 1]] for b in range(2) for t in range(8) if labels[b, t + 1] != -100]
    assert abs(loss.item() - torch.stack(picked).mean().item()) < 1e-12
    _, _, loss_targets = model(ids, targets=torch.nn.functional.pad(labels[:, 1:], (0, 1), value=-100))
    assert loss_targets.item() == loss.item()


def test_return_hidden_gives_what_the_head_turns_into_the_logits():
    """``return_hidden=True``: the final-norm hidden states [B, T, d_model] and the same state;
    ``lm_head`` of them is the logits (to the last bit); labels are refused with it."""
    torch.manual_seed(2)
    model = HybridLM(tiny_config("gdn mamba2 attn")).double()
    ids = torch.randint(0, 37, (2, 9))
    logits, state = model(ids)
    hidden, hidden_state = model(ids, return_hidden=True)
    assert hidden.shape == (2, 9, model.config.d_model)
    assert torch.equal(model.lm_head(hidden), logits)
    assert len(hidden_state) == len(state)
    with pytest.raises(ValueError, match="return_hidden"):
        model(ids, labels=ids, return_hidden=True)


def test_config_pattern_repeats_and_validates():
    cfg = HybridConfig(n_layers=7, layers="gdn gdn gdn attn")
    assert cfg.layer_kinds() == ["gdn", "gdn", "gdn", "attn", "gdn", "gdn", "gdn"]
    with pytest.raises(ConfigError, match="unknown mixer kind"):
        HybridConfig(layers="gdn lstm")
    with pytest.raises(ConfigError, match="unknown key"):
        HybridConfig.from_dict({"d_model": 64, "dmodel": 3})
    with pytest.raises(ConfigError, match=r"gdn: unknown key\(s\) \['heads'\]"):
        HybridConfig.from_dict({"gdn": {"heads": 3}})
    with pytest.raises(ConfigError, match="n_layers"):
        HybridConfig(n_layers=0)


def test_a_layer_pattern_longer_than_n_layers_is_refused():
    """Eight kinds for four layers used to build the first four and drop the rest silently: an
    error naming both numbers and the fix. A pattern repeated (and cut) to n_layers stays."""
    eight = "gdn gdn mamba2 mamba2 attn attn gla gla"
    with pytest.raises(ConfigError, match=r"8 mixer kinds .* n_layers is 4: the last 4 \(attn attn gla gla\)"
                                          r".*Set n_layers to 8"):
        HybridLM.from_recipe("tiny-hybrid", layers=eight, n_layers=4)
    with pytest.raises(ConfigError, match="n_layers is 2"):  # the recipe's 3 kinds, 2 layers
        HybridConfig.from_dict({"layers": ["gdn", "mamba2", "attn"], "n_layers": 2})
    cfg = HybridConfig(n_layers=4, layers="gdn mamba2 attn")
    assert cfg.layer_kinds() == ["gdn", "mamba2", "attn", "gdn"]  # every kind built


@pytest.mark.parametrize("data,pattern", [
    ({"tie_embeddings": "false"}, "tie_embeddings must be true or false"),
    ({"layers": [["gdn"]]}, "layers must be a string or a list of strings"),
    ({"gdn": {"num_k_heads": 2.5}}, "gdn.num_k_heads must be an int"),
    ({"d_model": 2**63}, "d_model must be an int below 2"),
    ({"attn": {"window": "5"}}, "attn.window must be an int below 2\\*\\*31 or null"),
])
def test_config_values_of_the_wrong_type_are_refused(data, pattern):
    """A string "false" is truthy: it used to tie the head; 2.5 heads or 2**63 failed deep in torch."""
    with pytest.raises(ConfigError, match=pattern):
        HybridConfig.from_dict(data)


def test_config_json_and_yaml_round_trip(tmp_path):
    cfg = tiny_config("mamba2 attn", tie_embeddings=False)
    cfg.to_json(tmp_path / "c.json")
    assert HybridConfig.from_json(tmp_path / "c.json") == cfg
    assert HybridConfig.from_yaml(cfg.to_yaml()) == cfg


def test_bad_inputs_give_clear_errors():
    model = HybridLM(tiny_config("gla attn"))
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 37\)"):
        model(torch.tensor([[1, 40]]))
    with pytest.raises(ValueError, match="int tensor"):
        model(torch.zeros(1, 3))
    with pytest.raises(ValueError, match="state has 1 entries"):
        model(torch.tensor([[1, 2]]), state=[None])


def test_ids_checked_skips_only_the_range_check_and_is_restored(monkeypatch):
    """Inside ``ids_checked()`` the forward does not read the ids back (the range check: one
    device sync per call, min and max read together); the shape / dtype check stays, and the
    range check returns after the block."""
    model = HybridLM(tiny_config("gla"))
    reads = []
    for name in ("__int__", "item", "tolist"):
        original = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda t, *a, _f=original, **k: reads.append(1) or _f(t, *a, **k))
    with model.ids_checked():
        model(torch.tensor([[1, 2]]))
        assert not reads
        with pytest.raises(ValueError, match="int tensor"):
            model(torch.zeros(1, 3))
    model(torch.tensor([[1, 2]]))
    assert len(reads) == 1
    with pytest.raises(ValueError, match="token ids must be in"):
        model(torch.tensor([[1, 40]]))


def test_yaml_exponent_without_dot_is_read_as_a_float():
    cfg = HybridConfig.from_yaml("norm_eps: 1e-5\ngla: {norm_eps: 1e-5}\n")
    assert cfg.norm_eps == 1e-5 and cfg.gla.norm_eps == 1e-5
    with pytest.raises(ConfigError, match="norm_eps must be a number"):
        HybridConfig.from_yaml("norm_eps: small\n")


def test_bf16_autocast_states_carry_and_keep_their_dtypes():
    torch.manual_seed(0)
    model = HybridLM(tiny_config("mamba1 mamba2 gla retnet gdn attn"))
    ids = torch.randint(0, 37, (2, 13))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        first, state = model(ids[:, :7])
        for block_state in state:
            tensors = block_state.tensors()
            recurrent = tensors.get("recurrent")
            assert recurrent is None or recurrent.dtype == torch.float32, block_state.kind
        second, state = model(ids[:, 7:], state)  # a carried state passes the checks
        full, _ = model(ids)
    assert rel_err(torch.cat([first, second], 1), full) < 1e-2


def test_run_metadata_prefers_the_given_commit(monkeypatch):
    """Benchmarks record ``HYBRIDZOO_COMMIT`` when set (a copied checkout's git metadata can be
    stale), else the checkout's HEAD; versions of absent packages are None."""
    from hybridzoo.utils import run_metadata

    monkeypatch.setenv("HYBRIDZOO_COMMIT", "abc1234")
    meta = run_metadata(("torch", "no_such_package_here"))
    assert meta["commit"] == "abc1234" and meta["dirty"] is None
    assert meta["versions"]["torch"] == torch.__version__ and meta["versions"]["no_such_package_here"] is None
    monkeypatch.delenv("HYBRIDZOO_COMMIT")
    assert run_metadata()["commit"] != "abc1234"
