"""Fuzz the readers of user files: random bytes and random JSON into the data readers (txt, jsonl,
parquet) and the checkpoint loader (config.json, model.safetensors). Seeded, a few hundred cases.

Every case ends in one of two ways: the project's own error (``DataError`` / ``CheckpointError``,
both ValueErrors, which the CLI prints as one line) whose message names the file (and the line for
jsonl), or a correct result, checked against an oracle that does not use the code under test (the
texts the case was built from; the tensors as safetensors itself reads them). Never a KeyError,
IndexError, struct.error, UnicodeDecodeError or a library's own error from deep inside, and never
a silently wrong model.
"""

from __future__ import annotations

import json
import random
import shutil
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

from hybridzoo import HybridConfig, HybridLM
from hybridzoo.training.data import DataError, read_documents
from hybridzoo.zoo.checkpoint import CheckpointError
from tests.zoo.tiny import tiny_config

SEED = 56
CASES = 150  # per reader


# ---- random inputs ------------------------------------------------------------------------------
def random_text(rng: random.Random, nul: bool = False) -> str:
    """Text that is valid UTF-8: ASCII, accents, CJK, emoji, newlines; a NUL only when asked."""
    alphabet = "abc xyz\n\t{}[]\":,\\é中🙂" + ("\x00" if nul else "")
    text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 40)))
    return text + "\x00" if nul and "\x00" not in text else text


def random_json(rng: random.Random, depth: int = 0):
    """A random JSON value: numbers (huge ones too), strings ("NaN" among them), nested junk."""
    choice = rng.randrange(9 if depth < 3 else 6)
    if choice == 0:
        return rng.randrange(-10**6, 10**6)
    if choice == 1:
        return rng.choice([0, -1, 1, 2**31, 2**63, 10**30, -(10**30)])
    if choice == 2:
        return rng.choice([0.5, -1e-3, 1e308, -1e308, 2.5, 1e-300])
    if choice == 3:
        return rng.choice(["NaN", "Infinity", "-inf", "", "gdn", "attn", "true", "1e-5", "\u0000"])
    if choice == 4:
        return rng.choice([True, False, None])
    if choice == 5:
        return random_text(rng)
    if choice == 6:
        return [random_json(rng, depth + 1) for _ in range(rng.randrange(4))]
    if choice == 7:
        return {rng.choice(["text", "gdn", "layers", "x", ""]): random_json(rng, depth + 1)
                for _ in range(rng.randrange(4))}
    return {"text": random_json(rng, depth + 1)}


def junk_json_line(rng: random.Random) -> bytes:
    """One jsonl line that is NOT an object with a "text" string of valid, NUL-free text."""
    kind = rng.randrange(9)
    if kind == 0:  # valid JSON of the wrong shape
        value = random_json(rng)
        while isinstance(value, dict) and isinstance(value.get("text"), str):
            value = random_json(rng)
        return json.dumps(value).encode()
    if kind == 1:  # truncated JSON object
        full = json.dumps({"text": random_text(rng), "x": random_json(rng)})
        return full[: rng.randrange(1, len(full))].encode()
    if kind == 2:  # random bytes, not UTF-8 (0xff never is), no newline
        return bytes(rng.choice([b for b in range(256) if b != 10]) for _ in range(rng.randrange(20))) + b"\xff"
    if kind == 3:
        return json.dumps({"text": random_text(rng, nul=True)}).encode()  # a NUL character in the text
    if kind == 4:
        return b'{"text": "ab\\ud800cd"}'  # a lone surrogate: valid JSON, not encodable text
    if kind == 5:
        return b'{"text": ' + b"7" * rng.choice([20, 5000]) + b"}"  # a number (past Python's int limit too)
    if kind == 6:
        depth = rng.choice([10, 100_000])
        return b"[" * depth + b"]" * depth  # nested junk, deeper than the recursion limit too
    if kind == 7:
        return rng.choice([b"NaN", b"Infinity", b'{"text": NaN}', b'{"text": "a"} trailing', b"{text: 'a'}"])
    return json.dumps({"txt": random_text(rng)}).encode()


def assert_names(error: BaseException, expected: str) -> None:
    message = str(error)
    assert expected in message, (expected, message)
    assert "\n" not in message.strip(), message


# ---- the data readers -----------------------------------------------------------------------
def test_fuzz_txt_files(tmp_path):
    rng = random.Random(SEED)
    for case in range(CASES):
        path = tmp_path / f"c{case}.txt"
        kind = rng.randrange(3)
        if kind == 0:
            text = random_text(rng)
            path.write_bytes(text.encode())
            assert read_documents(path) == ([text.encode()] if text else [])
            continue
        if kind == 1:
            data = random_text(rng, nul=True).encode()  # valid UTF-8 with a NUL: a binary file
        else:
            data = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64))) + b"\xc3"  # cut short
        path.write_bytes(data)
        with pytest.raises(DataError) as caught:
            read_documents(path)
        assert_names(caught.value, str(path))


def test_fuzz_jsonl_files(tmp_path):
    rng = random.Random(SEED + 1)
    for case in range(CASES):
        path = tmp_path / f"c{case}.jsonl"
        texts = [random_text(rng) for _ in range(rng.randrange(1, 6))]
        lines = [json.dumps({"text": t, "meta": random_json(rng)}).encode() for t in texts]
        lines.insert(rng.randrange(len(lines) + 1), b"   ")  # a blank line is skipped
        junk_at = rng.randrange(len(lines) + 1) if rng.random() < 0.7 else None
        if junk_at is not None:
            lines.insert(junk_at, junk_json_line(rng))
        path.write_bytes(b"\n".join(lines) + rng.choice([b"", b"\n"]))
        if junk_at is None:
            assert read_documents(path) == [t for t in texts if t]
            continue
        with pytest.raises(DataError) as caught:
            read_documents(path)
        assert_names(caught.value, f"{path}, line {junk_at + 1}:")


def test_fuzz_parquet_files(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    rng = random.Random(SEED + 2)
    good = tmp_path / "good.parquet"
    pq.write_table(pa.table({"text": ["a", "bc"]}), good)
    good_bytes = good.read_bytes()
    for case in range(30):
        path = tmp_path / f"c{case}.parquet"
        kind = case % 5
        if kind == 0:
            texts = [rng.choice([random_text(rng), None]) for _ in range(rng.randrange(1, 5))]
            pq.write_table(pa.table({"text": texts}), path)
            assert read_documents(path) == [t for t in texts if t]
            continue
        if kind == 1:
            path.write_bytes(bytes(rng.randrange(256) for _ in range(rng.randrange(64))))
        elif kind == 2:  # a real parquet file cut short
            path.write_bytes(good_bytes[: rng.randrange(1, len(good_bytes))])
        elif kind == 3:
            pq.write_table(pa.table({"text": [rng.randrange(100), 3]}), path)  # not strings
        else:
            pq.write_table(pa.table({"body": ["a"]}), path)  # no text column
        with pytest.raises(DataError) as caught:
            read_documents(path)
        assert_names(caught.value, str(path))


# ---- the checkpoint loader ------------------------------------------------------------------
@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny checkpoint (Gated DeltaNet + attention, untied head) and its config as a dict."""
    torch.manual_seed(0)
    directory = tmp_path_factory.mktemp("ckpt") / "base"
    config = tiny_config("gdn attn", d_model=16, d_mlp=16, vocab_size=11, tie_embeddings=False,
                         gdn=dict(num_k_heads=2, num_v_heads=2, head_k_dim=4, head_v_dim=4, chunk_size=4),
                         attn=dict(n_heads=2, window=3))
    HybridLM(config).save_pretrained(directory)
    return directory, json.loads((directory / "config.json").read_text())


def mutate_config(rng: random.Random, config: dict) -> bytes:
    """config.json after one random change: bytes, truncated or non-standard JSON, a wrong shape,
    or one key of the (nested) dict set to random JSON, deleted, or added."""
    kind = rng.randrange(6)
    text = json.dumps(config)
    if kind == 0:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(40)))
    if kind == 1:
        return text[: rng.randrange(len(text))].encode()
    if kind == 2:
        return json.dumps(random_json(rng)).encode()
    if kind == 3:
        return rng.choice([b"NaN", b"[" * 50_000, b'{"d_model": ' + b"9" * 5000 + b"}",
                           text.replace('"norm_eps": 1e-06', '"norm_eps": NaN').encode()])
    changed = json.loads(text)
    block = changed
    if rng.random() < 0.5:
        block = changed[rng.choice(["gdn", "attn", "mamba2"])]
    key = rng.choice(sorted(block))
    if kind == 4:
        block[key] = random_json(rng)
    else:
        block.pop(key) if rng.random() < 0.5 else block.update({key + "_x": random_json(rng)})
    return json.dumps(changed).encode()


def mutate_weights(rng: random.Random, weights_path, out_path) -> None:
    """model.safetensors after one random change: random bytes, cut short, header bytes overwritten,
    or a valid file with a tensor missing, extra, or of another shape."""
    data = weights_path.read_bytes()
    kind = rng.randrange(5)
    if kind == 0:
        out_path.write_bytes(bytes(rng.randrange(256) for _ in range(rng.randrange(64))))
    elif kind == 1:
        out_path.write_bytes(data[: rng.randrange(len(data))])
    elif kind == 2:
        header_end = 8 + struct.unpack("<Q", data[:8])[0]
        changed = bytearray(data)
        for _ in range(rng.randrange(1, 4)):
            changed[rng.randrange(header_end)] = rng.randrange(256)
        out_path.write_bytes(bytes(changed))
    else:
        tensors = load_file(str(weights_path))
        name = rng.choice(sorted(tensors))
        if kind == 3:
            tensors.pop(name) if rng.random() < 0.5 else tensors.update({name + ".extra": torch.zeros(2)})
        else:
            shape = list(tensors[name].shape)
            shape[rng.randrange(len(shape))] += rng.choice([-1, 1]) if min(shape) > 1 else 1
            tensors[name] = torch.zeros(shape)
        save_file(tensors, str(out_path))


def test_fuzz_checkpoint_loader(saved, tmp_path):
    base, config = saved
    rng = random.Random(SEED + 3)
    loaded = 0
    for case in range(CASES):
        directory = tmp_path / f"c{case}"
        shutil.copytree(base, directory)
        if rng.random() < 0.5:
            (directory / "config.json").write_bytes(mutate_config(rng, config))
        else:
            mutate_weights(rng, base / "model.safetensors", directory / "model.safetensors")
        try:
            model = HybridLM.from_pretrained(directory)
        except CheckpointError as error:
            assert_names(error, str(directory))
            continue
        # a correct result: the config of the file, and exactly the tensors of the file
        loaded += 1
        expected_config = HybridConfig.from_dict(json.loads((directory / "config.json").read_text()))
        assert model.config.to_dict() == expected_config.to_dict()
        tensors = load_file(str(directory / "model.safetensors"))
        state = model.state_dict()
        assert set(tensors) <= set(state)
        for name, tensor in tensors.items():
            assert torch.equal(state[name], tensor), name
    assert 0 < loaded < CASES  # both outcomes were reached
