"""Packed documents (``cu_seqlens``) through every mixer: a packed call equals each document run
alone and the results concatenated (outputs, final states and every gradient, float64, 1e-10)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hybridzoo.layers import MIXERS, KVState, RecurrentState
from hybridzoo.utils import rel_err
from tests.zoo.tiny import TINY_BLOCKS

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

TOL = 1e-10
CHUNK = 8  # the tiny mixers' chunk size
WINDOW = 5
# one token, exactly a chunk, chunk + 1, longer than the window and several chunks, short
LENGTHS = [1, CHUNK, CHUNK + 1, 2 * CHUNK + 3, 3]

SETTINGS = dict(TINY_BLOCKS)
SETTINGS["gla"] = dict(TINY_BLOCKS["gla"], use_short_conv=True)      # conv tails too
SETTINGS["retnet"] = dict(TINY_BLOCKS["retnet"], use_short_conv=True)
SETTINGS["attn"] = dict(TINY_BLOCKS["attn"], window=WINDOW)
SETTINGS["attn-full"] = dict(TINY_BLOCKS["attn"], window=None)
KINDS = ["mamba1", "mamba2", "gla", "retnet", "gdn", "attn", "attn-full"]


def build(kind: str, d_model: int = 16):
    cls, config_cls = MIXERS[kind.split("-")[0]]
    torch.manual_seed(0)
    return cls(d_model, config_cls(**SETTINGS[kind])).double()


def cu_of(lengths) -> torch.Tensor:
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)


def random_state(mixer, kind: str, n_docs: int, generator) -> RecurrentState | KVState:
    """A random incoming state: per document for a recurrent mixer, one document's K/V (3
    positions) for attention."""
    if kind.startswith("attn"):
        shape = (1, 3, mixer.n_kv_heads, mixer.head_dim)
        return KVState(kind="attn", k_buf=torch.randn(shape, generator=generator, dtype=torch.float64),
                       v_buf=torch.randn(shape, generator=generator, dtype=torch.float64), length=3, offset=3)
    fields = {name: torch.randn(shape, generator=generator, dtype=dtype)
              for name, (shape, dtype) in mixer.expected_state(n_docs, torch.float64).items()}
    return RecurrentState(kind=mixer.kind, offset=4, **fields)


def leaves(state):
    return {name: t.detach().clone().requires_grad_() for name, t in state.tensors().items()}


def document_state(state, kind: str, i: int):
    """The incoming state of document i run alone (RetNet's positions: the first document continues
    the state's offset, the others start at 0)."""
    if state is None:
        return None
    if kind.startswith("attn"):
        return state if i == 0 else None
    return dataclasses.replace(state, offset=state.offset if i == 0 else 0,
                               **{name: t[i:i + 1] for name, t in state.tensors().items()})


@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("kind", KINDS)
def test_packed_equals_separate(kind: str, with_state: bool):
    mixer = build(kind)
    generator = torch.Generator().manual_seed(1)
    cu = cu_of(LENGTHS)
    total, n_docs = int(cu[-1]), len(LENGTHS)
    x = torch.randn(1, total, mixer.d_model, generator=generator, dtype=torch.float64)
    weight = torch.randn(x.shape, generator=generator, dtype=torch.float64)
    state = random_state(mixer, kind, n_docs, generator) if with_state else None
    params = [p for p in mixer.parameters() if p.requires_grad]

    def run(packed: bool):
        xs = x.clone().requires_grad_()
        incoming = None if state is None else dataclasses.replace(state, **leaves(state))
        if packed:
            y, out = mixer(xs, incoming, cu_seqlens=cu)
            finals = out.tensors() if not kind.startswith("attn") else {"k": out.k, "v": out.v}
        else:
            ys, outs = [], []
            for i, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
                y_i, out_i = mixer(xs[:, a:b], document_state(incoming, kind, i))
                ys.append(y_i)
                outs.append(out_i)
            y = torch.cat(ys, dim=1)
            if kind.startswith("attn"):  # the returned store is that of the last document
                out = outs[-1]
                finals = {"k": out.k, "v": out.v}
            else:
                finals = {name: torch.cat([o.tensors()[name] for o in outs]) for name in outs[0].tensors()}
                out = dataclasses.replace(outs[-1], **finals)
        loss = (y * weight).sum() + sum((t * torch.cos(torch.arange(t.numel(), dtype=t.dtype)).view(t.shape)).sum()
                                        for t in finals.values())
        wrt = [xs, *params, *([] if incoming is None else incoming.tensors().values())]
        grads = torch.autograd.grad(loss, wrt, allow_unused=True)
        return y, finals, out.offset, grads

    y_p, finals_p, offset_p, grads_p = run(True)
    y_s, finals_s, offset_s, grads_s = run(False)
    assert rel_err(y_p, y_s) <= TOL, f"{kind}: output {rel_err(y_p, y_s):.3g}"
    assert finals_p.keys() == finals_s.keys()
    for name in finals_p:
        assert finals_p[name].shape == finals_s[name].shape, name
        assert rel_err(finals_p[name], finals_s[name]) <= TOL, f"{kind}: final {name}"
    assert offset_p == offset_s
    for i, (gp, gs) in enumerate(zip(grads_p, grads_s, strict=True)):
        assert (gp is None) == (gs is None), i
        if gp is not None:
            assert rel_err(gp, gs) <= TOL, f"{kind}: gradient {i}: {rel_err(gp, gs):.3g}"


@pytest.mark.parametrize("kind", ["gla", "attn"])
def test_documents_do_not_leak(kind: str):
    """A later document's output does not change when an earlier document's tokens do."""
    mixer = build(kind)
    cu = cu_of([6, 7])
    x = torch.randn(1, 13, mixer.d_model, dtype=torch.float64)
    y, _ = mixer(x, cu_seqlens=cu)
    x2 = x.clone()
    x2[:, :6] += 1.0
    y2, _ = mixer(x2, cu_seqlens=cu)
    assert torch.equal(y[:, 6:], y2[:, 6:])
    assert not torch.equal(y[:, :6], y2[:, :6])


def test_packed_errors():
    mixer = build("gla")
    x = torch.randn(2, 5, mixer.d_model, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"GLA: with cu_seqlens .* \[1, total, d_model\]"):
        mixer(x, cu_seqlens=cu_of([5]))
    with pytest.raises(ValueError, match="GLA: cu_seqlens must end at"):
        mixer(x[:1], cu_seqlens=cu_of([2, 2]))
    state = random_state(mixer, "gla", 1, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="batch size 1, input has 2"):  # one state row per document
        mixer(x[:1], state, cu_seqlens=cu_of([2, 3]))
