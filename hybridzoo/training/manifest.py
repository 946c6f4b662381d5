"""The manifest of a prepared set (``hybridzoo prepare``): tokenizer identity, dtype, splits.

See :mod:`hybridzoo.training.shards` for the layout of a prepared set and how it is read. This
module imports neither torch nor an optional package.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

__all__ = ["MANIFEST", "PreparedSet", "token_dtype", "tokenizer_identity"]

MANIFEST = "manifest.json"
FORMAT = "hybridzoo-prepared"
VERSION = 1
DTYPES = {"uint8": np.uint8, "uint16": np.uint16, "uint32": np.uint32}


def token_dtype(vocab_size: int) -> str:
    """The smallest unsigned dtype that holds ids ``0 .. vocab_size - 1``."""
    return "uint8" if vocab_size <= 1 << 8 else "uint16" if vocab_size <= 1 << 16 else "uint32"


def tokenizer_identity(tokenizer) -> dict:
    """``{"name", "vocab_size", "eos_id", "sha256"}`` of a tokenizer of
    :mod:`hybridzoo.training.tokenizers`: ``sha256`` hashes its vocabulary (token -> id, added
    tokens included) and, for BPE, its merges; two tokenizers with the same hash give the same ids."""
    from hybridzoo.training.tokenizers import ByteTokenizer

    if isinstance(tokenizer, ByteTokenizer):
        return {"name": "bytes", "vocab_size": 256, "eos_id": 0,
                "sha256": hashlib.sha256(b"hybridzoo byte tokenizer: ids 0..255 are the UTF-8 bytes").hexdigest()}
    digest = hashlib.sha256()
    if getattr(tokenizer, "_hf", None) is not None:
        vocab = tokenizer._hf.get_vocab()
        merges = None
    else:
        vocab = tokenizer._tok.get_vocab(with_added_tokens=True)
        merges = json.loads(tokenizer._tok.to_str()).get("model", {}).get("merges")
    digest.update(json.dumps(sorted(vocab.items()), ensure_ascii=False).encode("utf-8"))
    if merges:
        digest.update(json.dumps(merges, ensure_ascii=False).encode("utf-8"))
    return {"name": str(tokenizer.path), "vocab_size": int(tokenizer.vocab_size),
            "eos_id": tokenizer.eos_id, "sha256": digest.hexdigest()}


# --------------------------------------------------------------------------- the manifest


class PreparedSet:
    """A prepared set's directory and manifest (see the module docstring).

    Raises ``FileNotFoundError`` / ``ValueError`` naming the directory when it is not a complete
    prepared set (no manifest, an unfinished prepare, a missing shard).
    """

    def __init__(self, directory: str | Path):
        self.directory = Path(directory).expanduser()
        if not self.directory.is_dir():
            raise FileNotFoundError(f"prepared set {str(directory)!r} does not exist (make one with "
                                    f"hybridzoo prepare SRC {directory})")
        path = self.directory / MANIFEST
        if not path.is_file():
            if (self.directory / ".prepare").is_dir():
                raise ValueError(f"prepared set {str(self.directory)!r} is unfinished (no {MANIFEST}; its prepare was "
                                 "interrupted): rerun the same hybridzoo prepare command to finish it")
            raise ValueError(f"{str(self.directory)!r} has no {MANIFEST}: not a prepared set "
                             f"(make one with hybridzoo prepare SRC {self.directory})")
        try:
            manifest = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}: not valid JSON ({err.msg}, line {err.lineno})") from None
        if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
            raise ValueError(f"{path}: not a {FORMAT} manifest of version {VERSION}")
        self.path, self.manifest = path, manifest
        self.dtype = DTYPES[manifest["dtype"]]
        for split in ("train", "val"):
            for shard in manifest["splits"][split]["shards"]:
                if not (self.directory / shard["file"]).is_file():
                    raise FileNotFoundError(f"prepared set {str(self.directory)!r}: shard {shard['file']} listed in "
                                            f"{MANIFEST} is missing")

    @property
    def tokenizer(self) -> dict:
        return self.manifest["tokenizer"]

    @property
    def vocab_size(self) -> int:
        return int(self.tokenizer["vocab_size"])

    def check_tokenizer(self, tokenizer) -> None:
        """Raise ``ValueError`` when ``tokenizer`` is not the one the set was prepared with."""
        mine, theirs = tokenizer_identity(tokenizer), self.tokenizer
        if mine["sha256"] != theirs["sha256"] or mine["vocab_size"] != theirs["vocab_size"]:
            raise ValueError(
                f"{self.path}: the set was prepared with tokenizer {theirs['name']!r} (vocab {theirs['vocab_size']}, "
                f"sha256 {theirs['sha256'][:12]}), this run uses {mine['name']!r} (vocab {mine['vocab_size']}, "
                f"sha256 {mine['sha256'][:12]}): prepare the data again with this tokenizer, or leave "
                "data.tokenizer unset to use the set's own")

    def check_vocab(self, vocab_size: int) -> None:
        """Raise ``ValueError`` when the set's ids do not fit a model of ``vocab_size``."""
        needed = max(self.vocab_size, int(self.manifest.get("max_token_id", -1)) + 1)
        if needed > vocab_size:
            raise ValueError(f"{self.path}: the tokenizer {self.tokenizer['name']!r} has {self.vocab_size} ids, "
                             f"the model's vocab_size is {vocab_size}: set model.config.vocab_size to at least "
                             f"{needed} or prepare the data with a smaller tokenizer")

    def files(self, split: str) -> list[Path]:
        return [self.directory / s["file"] for s in self.manifest["splits"][split]["shards"]]
