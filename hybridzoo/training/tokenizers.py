"""Tokenizers for the data modules: raw UTF-8 bytes, or a local Hugging Face tokenizer.

Both kinds have the same small interface: ``vocab_size``, ``eos_id`` (the id that separates packed
documents, or ``None``), ``encode(text) -> list[int]``, ``encode_batch(texts)``,
``decode(ids) -> str`` and ``files() -> list[Path]`` (what to copy into an export so that the
checkpoint can be used without the training data). Nothing is downloaded: a Hugging Face tokenizer
is read from a local directory (or a ``tokenizer.json`` file) with the ``tokenizers`` library, or,
when the directory has no ``tokenizer.json``, with ``transformers.AutoTokenizer(local_files_only=True)``.
Both packages are imported only when such a tokenizer is asked for.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

# Files a Hugging Face tokenizer directory may hold; those present are copied into exports.
TOKENIZER_FILE_NAMES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
    "chat_template.jinja",
    "chat_template.json",
)
# Tried in this order when tokenizer_config.json names no eos_token.
_COMMON_EOS_TOKENS = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eos|>", "[SEP]")


class ByteTokenizer:
    """UTF-8 bytes as tokens: ids 0..255 are the byte values, ``vocab_size`` 256.

    Packed documents are separated by the NUL byte (id 0, ``eos_id``), which never occurs in text
    files. ``decode`` replaces invalid UTF-8 (e.g. a multi-byte character cut by a row boundary)
    with U+FFFD.
    """

    vocab_size = 256
    eos_id = 0

    def encode(self, text: str | bytes) -> list[int]:
        return list(text if isinstance(text, bytes) else text.encode("utf-8"))

    def encode_batch(self, texts: Sequence[str | bytes]) -> list[list[int]]:
        return [self.encode(text) for text in texts]

    def decode(self, ids) -> str:
        return bytes(_as_int_list(ids)).decode("utf-8", errors="replace")

    def files(self) -> list[Path]:
        return []

    def __repr__(self) -> str:
        return "ByteTokenizer()"


class HFTokenizer:
    """A local Hugging Face tokenizer: a directory (or a ``tokenizer.json`` file).

    ``vocab_size`` counts added tokens. ``eos_id`` is the id of ``eos_token`` from
    ``tokenizer_config.json`` when it names one, else of the first of ``<|endoftext|>``, ``</s>``,
    ``<|end_of_text|>``, ``<eos>``, ``<|eos|>``, ``[SEP]`` in the vocabulary, else ``None`` (packed
    documents are then simply concatenated). Text is encoded without special tokens.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path).expanduser()
        if not self.path.exists():
            raise FileNotFoundError(f"tokenizer path {str(path)!r} does not exist")
        directory = self.path if self.path.is_dir() else self.path.parent
        json_file = self.path if self.path.is_file() else self.path / "tokenizer.json"
        if self.path.is_file() and self.path.name != "tokenizer.json":
            raise ValueError(
                f"tokenizer path {str(path)!r} is a file but not a tokenizer.json; "
                "give a Hugging Face tokenizer directory or its tokenizer.json"
            )
        self._directory = directory
        self._hf = None  # transformers tokenizer, when there is no tokenizer.json
        if json_file.is_file():
            from tokenizers import Tokenizer

            self._tok = Tokenizer.from_file(str(json_file))
            self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
            self._files = [json_file] if self.path.is_file() else self._present_files()
            self.eos_id = self._find_eos(self._tok.token_to_id)
        else:
            if not self._present_files():
                raise ValueError(
                    f"tokenizer directory {str(path)!r} holds none of the files of a Hugging Face "
                    f"tokenizer ({', '.join(TOKENIZER_FILE_NAMES[:4])}, ...)"
                )
            try:
                from transformers import AutoTokenizer
            except ImportError as err:
                raise ImportError(
                    f"tokenizer directory {str(path)!r} has no tokenizer.json; reading it needs "
                    "transformers: pip install transformers"
                ) from err
            self._hf = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
            self.vocab_size = len(self._hf)
            self._files = self._present_files()
            self.eos_id = self._hf.eos_token_id

    def _present_files(self) -> list[Path]:
        return [self._directory / n for n in TOKENIZER_FILE_NAMES if (self._directory / n).is_file()]

    def _find_eos(self, token_to_id) -> int | None:
        config = self._directory / "tokenizer_config.json"
        if config.is_file():
            eos = json.loads(config.read_text(encoding="utf-8")).get("eos_token")
            if isinstance(eos, dict):
                eos = eos.get("content")
            if isinstance(eos, str) and token_to_id(eos) is not None:
                return token_to_id(eos)
        for token in _COMMON_EOS_TOKENS:
            if token_to_id(token) is not None:
                return token_to_id(token)
        return None

    def encode(self, text: str) -> list[int]:
        if self._hf is not None:
            return self._hf(text, add_special_tokens=False)["input_ids"]
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        texts = list(texts)
        if self._hf is not None:
            return self._hf(texts, add_special_tokens=False)["input_ids"] if texts else []
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids) -> str:
        ids = _as_int_list(ids)
        if self._hf is not None:
            return self._hf.decode(ids)
        return self._tok.decode(ids, skip_special_tokens=False)

    def files(self) -> list[Path]:
        return list(self._files)

    def __repr__(self) -> str:
        return f"HFTokenizer({str(self.path)!r}, vocab_size={self.vocab_size})"


Tokenizer = ByteTokenizer | HFTokenizer


def load_tokenizer(spec: str | Path | None = None) -> Tokenizer:
    """``None`` or ``"bytes"`` -> :class:`ByteTokenizer`; a local path -> :class:`HFTokenizer`.

    Raises ``FileNotFoundError`` naming the path when it does not exist.
    """
    if spec is None or (isinstance(spec, str) and spec.strip().lower() in ("bytes", "byte")):
        return ByteTokenizer()
    return HFTokenizer(spec)


def has_tokenizer(directory: str | Path) -> bool:
    """Whether ``directory`` holds any of the files of a Hugging Face tokenizer."""
    return any((Path(directory) / name).is_file() for name in TOKENIZER_FILE_NAMES)


def find_tokenizer(directory: str | Path) -> Tokenizer:
    """The tokenizer of an export directory: its Hugging Face tokenizer files if it has any,
    else bytes (exports of byte-level models carry no tokenizer files)."""
    return HFTokenizer(Path(directory)) if has_tokenizer(directory) else ByteTokenizer()


def _as_int_list(ids) -> list[int]:
    """A flat list of ints from a list, tuple or 1-D tensor / array of token ids."""
    if hasattr(ids, "tolist"):
        ids = ids.tolist()
    return [int(i) for i in ids]
