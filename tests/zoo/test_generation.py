"""generate(): prefill + one-token steps; greedy equals argmax of a full forward."""

import pytest
import torch

from hybridzoo import HybridLM
from hybridzoo.zoo.generation import sample_next
from tests.zoo.tiny import tiny_config


@pytest.mark.parametrize("layers", ["mamba1 attn", "gdn gla", "retnet mamba2 attn"])
def test_greedy_equals_argmax_of_full_forward_at_every_step(layers):
    torch.manual_seed(0)
    model = HybridLM(tiny_config(layers)).double()
    prompt = torch.randint(0, 37, (3, 6))
    out = model.generate(prompt, max_new_tokens=8)
    assert out.shape == (3, 14) and torch.equal(out[:, :6], prompt)
    for t in range(6, 14):
        logits, _ = model(out[:, :t])
        assert torch.equal(out[:, t], logits[:, -1].argmax(-1)), f"step {t}"


def test_eos_stops_rows_and_generation():
    torch.manual_seed(0)
    model = HybridLM(tiny_config("gdn attn"))
    prompt = torch.randint(0, 37, (2, 4))
    greedy = model.generate(prompt, max_new_tokens=6)
    eos = int(greedy[0, 5])  # the second token row 0 would produce
    out = model.generate(prompt, max_new_tokens=6, eos_token_id=eos)
    row0 = out[0, 4:].tolist()
    assert row0[1] == eos and all(t == eos for t in row0[1:])


def test_sampling_respects_top_k_and_top_p():
    logits = torch.tensor([[0.0, 5.0, 4.9, -3.0]]).repeat(500, 1)
    g = torch.Generator().manual_seed(0)
    picks = sample_next(logits, temperature=1.0, top_k=2, generator=g)
    assert set(picks.tolist()) <= {1, 2} and len(set(picks.tolist())) == 2
    picks = sample_next(logits, temperature=1.0, top_p=0.3, generator=g)
    assert set(picks.tolist()) == {1}
    with pytest.raises(ValueError, match="top_p"):
        sample_next(logits, temperature=1.0, top_p=0.0)


def test_generate_leaves_training_mode_as_it_was():
    model = HybridLM(tiny_config("mamba2 attn")).train()
    model.generate(torch.zeros(1, 3, dtype=torch.long), max_new_tokens=2)
    assert model.training
