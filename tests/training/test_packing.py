"""Packed documents in the data: TextDataModule(packing="documents"), fine-tuning samples, and the
LightningModule passing the boundaries on. Ground truths are built here from the source documents."""

from __future__ import annotations

import json

import pytest
import torch

from hybridzoo.training.data import TextDataModule, read_documents
from hybridzoo.training.packing import DocumentRows, Sample, pack_rows, sample_from_record, tokenize_sequences
from hybridzoo.training.tokenizers import ByteTokenizer


def documents_of_row(item):
    """``[(token ids, labels)]`` of each document of one row, cut where position_ids == 0."""
    pos = item["position_ids"].tolist()
    starts = [t for t, p in enumerate(pos) if p == 0] + [len(pos)]
    assert starts[0] == 0
    for a, b in zip(starts[:-1], starts[1:]):
        assert pos[a:b] == list(range(b - a)), "positions count up by 1 inside a document"
    return [(item["input_ids"][a:b].tolist(), item["labels"][a:b].tolist()) for a, b in zip(starts[:-1], starts[1:])]


def test_pack_rows_best_fit_and_splits_only_long_sequences():
    rows = pack_rows([3, 7, 2, 5, 12, 1], seq_len=8)
    pieces = sorted(p for row in rows for p in row)
    # 12 tokens: pieces of 8 and 4; the others whole
    assert pieces == [(0, 0, 3), (1, 0, 7), (2, 0, 2), (3, 0, 5), (4, 0, 8), (4, 8, 12), (5, 0, 1)]
    assert all(sum(e - s for _, s, e in row) <= 8 for row in rows)
    # best fit decreasing by hand: 8 | 7+1 | 5+3 | 4+2
    assert [sorted(e - s for _, s, e in row) for row in rows] == [[8], [1, 7], [3, 5], [2, 4]]


def test_document_rows_boundaries_labels_and_coverage():
    g = torch.Generator().manual_seed(0)
    lengths = [1, 8, 9, 20, 3, 5, 2]
    sequences = []
    for n, length in enumerate(lengths):
        ids = torch.randint(1, 250, (length,), generator=g)
        trained = None if n % 2 == 0 else torch.rand(length, generator=g) < 0.5
        sequences.append((ids, trained))
    rows = DocumentRows(sequences, seq_len=8, pad_id=0)
    seen = []
    for i in range(len(rows)):
        item = rows[i]
        assert all(item[k].dtype == torch.int64 and item[k].shape == (8,) for k in item)
        for ids, labels in documents_of_row(item):
            assert labels[0] == -100  # no target at a document's first token: nothing crosses
            seen.append((ids, labels))
    real = [(ids, labels) for ids, labels in seen if any(i != 0 for i in ids)]
    assert sum(len(ids) for ids, _ in seen) == 8 * len(rows)
    assert sum(len(ids) for ids, _ in real) == sum(lengths)
    # every source sequence is found, in order, as its row-sized pieces
    for ids, trained in sequences:
        full = ids.tolist()
        pieces = [full[s:s + 8] for s in range(0, len(full), 8)]
        for k, piece in enumerate(pieces):
            match = [labels for got, labels in real if got == piece]
            assert match, f"piece {piece} not found"
            mask = [True] * len(piece) if trained is None else trained[8 * k: 8 * k + len(piece)].tolist()
            expected = [-100] + [t if m else -100 for t, m in zip(piece[1:], mask[1:])]
            assert expected in match
    padding = [labels for ids, labels in seen if all(i == 0 for i in ids)]
    assert all(set(labels) == {-100} for labels in padding) and rows.padding == sum(map(len, padding))


def test_text_datamodule_documents_mode_keeps_each_document_apart(tmp_path):
    docs = ["a" * 3, "bb" * 10, "ccc", "dddd" * 9, "e", "ff" * 4, "g" * 30, "hh"]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    dm = TextDataModule(paths=[str(tmp_path / "d.jsonl")], seq_len=16, batch_size=4, packing="documents",
                        val_fraction=0.25)
    dm.setup("fit")
    train_docs = [d for i, d in enumerate(docs) if i % 4 != 3]  # every 4th held out
    found = [bytes(ids).decode() for i in range(len(dm._train_set)) for ids, _ in documents_of_row(dm._train_set[i])]
    found = [f for f in found if f.strip("\0")]  # drop padding
    # each document + its NUL end, cut into 16-token pieces, each piece a document of its own
    expected = [(d + "\0")[s:s + 16] for d in train_docs for s in range(0, len(d) + 1, 16)]
    assert sorted(found) == sorted(expected)
    batch = next(iter(dm.train_dataloader()))
    assert set(batch) == {"input_ids", "labels", "position_ids"} and batch["position_ids"].shape == (4, 16)
    # no target crosses a boundary: a labelled token continues the document of the token before it
    labelled = batch["labels"][:, 1:] != -100
    assert (batch["position_ids"][:, 1:][labelled] == batch["position_ids"][:, :-1][labelled] + 1).all()


def test_stream_mode_stays_the_default():
    dm = TextDataModule(max_files=20, seq_len=64)
    dm.setup("fit")
    assert dm.packing == "stream" and set(dm._train_set[0]) == {"input_ids", "labels"}
    with pytest.raises(ValueError, match="packing must be one of 'stream', 'documents'"):
        TextDataModule(packing="rows")


def test_prompt_response_samples_train_the_response_only(tmp_path):
    records = [{"prompt": f"Question {i}? ", "response": f"Answer {i}."} for i in range(12)]
    path = tmp_path / "sft.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    dm = TextDataModule(paths=[str(path)], seq_len=64, batch_size=2, packing="documents", val_fraction=0.25)
    dm.setup("fit")
    trained_text = []
    for i in range(len(dm._train_set)):
        for ids, labels in documents_of_row(dm._train_set[i]):
            text = bytes(ids).decode()
            if text.strip("\0"):
                assert text.startswith("Question ")
                trained_text.append(bytes(t for t in labels if t != -100).decode())
    # ground truth: the response and the end-of-document NUL, for the 9 training samples
    expected = [r["response"] + "\0" for i, r in enumerate(records) if i % 4 != 3]
    assert sorted(trained_text) == sorted(expected)


def test_chat_messages_train_the_assistant_turns(tmp_path):
    record = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                           {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Bye"},
                           {"role": "assistant", "content": "Ciao"}]}
    sample = sample_from_record(record, "x")
    ((ids, trained),) = tokenize_sequences([sample], ByteTokenizer())
    text = bytes(ids.tolist()).decode()
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                    "<|im_start|>assistant\nHello<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n"
                    "<|im_start|>assistant\nCiao<|im_end|>\n")
    assert bytes(ids[trained].tolist()).decode() == "Hello<|im_end|>Ciao<|im_end|>"
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps(record) + "\n" + json.dumps({"text": "plain"}) + "\n")
    assert read_documents(path) == [sample, "plain"]


@pytest.mark.parametrize("record,message", [
    ({"prompt": "p"}, '"prompt" string and a non-empty "response"'),
    ({"prompt": "p", "response": ""}, '"prompt" string and a non-empty "response"'),
    ({"messages": [{"role": "user", "content": "hi"}]}, 'no "assistant" message'),
    ({"messages": [{"role": "user"}]}, r'messages\[0\] must be an object'),
    ({"messages": []}, '"messages" must be a non-empty list'),
])
def test_malformed_samples_name_file_and_line(tmp_path, record, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"prompt": "a", "response": "b"}) + "\n" + json.dumps(record) + "\n")
    with pytest.raises(ValueError, match=f"bad.jsonl, line 2: .*{message}"):
        read_documents(path)


def test_samples_need_documents_packing(tmp_path):
    path = tmp_path / "sft.jsonl"
    path.write_text("".join(json.dumps({"prompt": "p" * 40, "response": "r" * 40}) + "\n" for _ in range(30)))
    with pytest.raises(ValueError, match="pass packing='documents'"):
        TextDataModule(paths=[str(path)], seq_len=16).setup("fit")
    with pytest.raises(ValueError, match="needs at least 2"):
        one = tmp_path / "one.jsonl"
        one.write_text(json.dumps({"prompt": "p", "response": "r"}) + "\n")
        TextDataModule(paths=[str(one)], seq_len=16, packing="documents").setup("fit")


class _Recorder(torch.nn.Module):
    """Stands in for HybridLM: records the keywords of each call."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(()))
        self.calls = []

    def forward(self, input_ids, labels=None, **kwargs):
        self.calls.append(kwargs)
        logits = torch.zeros(*input_ids.shape, 256) + self.weight
        return logits, None, logits.mean()


def test_language_model_passes_position_ids_on():
    from hybridzoo.training.module import LanguageModel
    from hybridzoo.zoo import HybridConfig

    module = LanguageModel(HybridConfig(vocab_size=256, d_model=32, n_layers=1, layers="attn", attn={"n_heads": 4, "n_kv_heads": 2}))
    module.model = _Recorder()
    module.log = lambda *a, **k: None
    module.optimizers = lambda: type("O", (), {"param_groups": [{"lr": 0.0}]})()
    ids = torch.zeros(2, 8, dtype=torch.long)
    position_ids = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 0]] * 2)
    module.training_step({"input_ids": ids, "labels": ids, "position_ids": position_ids}, 0)
    module.training_step({"input_ids": ids, "labels": ids}, 1)
    module.on_validation_epoch_start()
    module.validation_step({"input_ids": ids, "labels": ids, "position_ids": position_ids}, 0)
    assert module.model.calls[0]["position_ids"] is position_ids
    assert module.model.calls[1] == {}
    assert module.model.calls[2]["position_ids"] is position_ids
    # the validation count skips the labels at document starts (positions 3 and 7 of 7 targets)
    assert module._val_sums[1].item() == 2 * 5


def test_packed_batch_trains_like_separate_documents():
    """A row of two documents gives the loss of the two documents run separately."""
    from hybridzoo.zoo import HybridConfig, HybridLM

    torch.manual_seed(0)
    model = HybridLM(HybridConfig(vocab_size=256, d_model=32, n_layers=2, layers="gla attn", attn={"n_heads": 4, "n_kv_heads": 2}, backend="reference")).double()
    dm_row = DocumentRows([(torch.arange(1, 6), None), (torch.arange(10, 13), None)], seq_len=8)
    item = dm_row[0]
    _, _, loss = model(item["input_ids"][None], labels=item["labels"][None], position_ids=item["position_ids"][None])
    parts = [item["input_ids"][:5], item["input_ids"][5:]]
    losses, counts = [], []
    for part in parts:
        logits, _ = model(part[None])
        if part.numel() > 1:
            losses.append(torch.nn.functional.cross_entropy(logits[0, :-1].double(), part[1:], reduction="sum"))
            counts.append(part.numel() - 1)
    assert torch.allclose(loss.double(), sum(losses) / sum(counts), atol=1e-10)
