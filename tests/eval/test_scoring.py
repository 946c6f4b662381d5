"""hybridzoo.zoo.scoring (what the lm-eval model runs on) against full forwards of the whole
text in float64: the state carried from a context to its continuations, from piece to piece of
a long prefill and from step to step of decoding must give the same numbers."""

from __future__ import annotations

import pytest
import torch

from hybridzoo.zoo.scoring import (GenerationRequest, continuation_logprobs, cut_at_stop, generate_until,
                                   rolling_logprobs)
from tests.eval.tiny_export import full_forward_logprobs, greedy_tokens, reference_loglikelihood, tiny_model

TOL = 1e-10


def _tokens(seed: int, n: int) -> list[int]:
    return torch.randint(1, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def model():
    return tiny_model(torch.float64)


def test_continuations_share_their_context_state(model):
    long_context, short, other = _tokens(1, 150), _tokens(2, 9), _tokens(3, 9)  # 150 > window 64
    greedy = greedy_tokens(model, long_context, 4)
    requests = [(long_context, _tokens(4, 7)), (short, _tokens(5, 1)), (long_context, _tokens(6, 20)),
                (other, _tokens(7, 3)), (long_context, greedy), (short, _tokens(8, 5)),
                (long_context, greedy[:3] + [(greedy[3] + 1) % 256])]
    calls = []
    got = continuation_logprobs(model, requests, batch_size=2, prefill_chunk=40,
                                on_result=lambda i, r: calls.append(i))
    assert sorted(calls) == list(range(len(requests)))
    for (context, continuation), (logprob, greedy_flag) in zip(requests, got):
        want, want_greedy = reference_loglikelihood(model, context, continuation)
        assert abs(logprob - want) <= TOL * abs(want)
        assert greedy_flag == want_greedy
    assert got[4][1] is True and got[6][1] is False


def test_each_context_is_run_once(model, monkeypatch):
    from hybridzoo.zoo import scoring

    seen = []
    real = scoring.prefill
    monkeypatch.setattr(scoring, "prefill", lambda m, ids, **kw: seen.append(ids.shape) or real(m, ids, **kw))
    context = _tokens(1, 30)
    continuation_logprobs(model, [(context, _tokens(s, 4)) for s in range(5)], batch_size=8)
    assert seen == [torch.Size([1, 30])]


def test_rolling_scores_every_token_once(model):
    documents = [_tokens(10, 130), _tokens(11, 1), _tokens(12, 57), []]
    got = rolling_logprobs(model, documents, prefix_id=0, batch_size=3, prefill_chunk=50)
    for document, logprob in zip(documents, got):
        if not document:
            assert logprob == 0.0
            continue
        rows = full_forward_logprobs(model, [0] + document)
        want = float(rows.gather(-1, torch.tensor(document)[:, None]).sum())
        assert abs(logprob - want) <= TOL * abs(want)


def _decode(ids):
    return "".join(chr(65 + i % 26) for i in ids)  # one letter per token: stop strings are easy to place


def test_generate_until_stops_at_the_first_stop_string(model):
    contexts = [_tokens(20, 12), _tokens(21, 12), _tokens(22, 70)]
    greedy = [_decode(greedy_tokens(model, c, 12)) for c in contexts]
    requests = [GenerationRequest(contexts[0], until=[greedy[0][5:7], greedy[0][8:10]], max_new_tokens=12),
                GenerationRequest(contexts[1], until=["\u2603"], max_new_tokens=12),  # never occurs
                GenerationRequest(contexts[2], until=[greedy[2][3], greedy[2][1:3]], max_new_tokens=12),
                GenerationRequest(contexts[1], until=[], max_new_tokens=0)]
    got = generate_until(model, requests, _decode, batch_size=4, prefill_chunk=32)
    assert got[0] == greedy[0][:greedy[0].index(greedy[0][5:7])]
    assert got[1] == greedy[1]
    assert got[2] == cut_at_stop(greedy[2], [greedy[2][3], greedy[2][1:3]])[0] and len(got[2]) <= 3
    assert got[3] == ""


def test_generate_until_stops_at_eos(model):
    context = _tokens(30, 10)
    greedy = greedy_tokens(model, context, 6)
    got = generate_until(model, [GenerationRequest(context, max_new_tokens=6)], _decode, eos_id=greedy[3])
    assert got == [_decode(greedy[:greedy.index(greedy[3])])]


def test_bad_input_is_refused(model):
    with pytest.raises(ValueError, match="context has no tokens"):
        continuation_logprobs(model, [([], [1])])
    with pytest.raises(ValueError, match="batch_size"):
        rolling_logprobs(model, [[1]], prefix_id=0, batch_size=0)
