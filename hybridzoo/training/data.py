"""Lightning data modules: packed text (embedded stdlib corpus or local files) and MQAR.

Batches are ``{"input_ids": int64 [B, T], "labels": int64 [B, T]}`` in the Hugging Face convention
of ``HybridLM`` (it shifts inside: logits at ``t`` predict ``labels[t+1]``; -100 = no loss), plus
``"position_ids": int64 [B, T]`` with ``packing="documents"``.

Text (:class:`TextDataModule`)
    ``packing="stream"`` (the default): documents are tokenized, each followed by the tokenizer's
    end-of-document id (the NUL byte, id 0, for the byte tokenizer; see
    :mod:`hybridzoo.training.tokenizers`), concatenated, and cut into rows of exactly ``seq_len``
    tokens (the remainder is dropped); ``labels`` equals ``input_ids``. Every state, convolution
    and attention of the model then reads across the end of one document into the next.

    ``packing="documents"``: the same documents (and end-of-document ids) are packed into rows
    with their boundaries (:mod:`hybridzoo.training.packing`): ``position_ids`` restart at 0 at
    every document, so the model resets every state at each one, and no label crosses a boundary;
    a document longer than a row is cut into row-sized pieces, and rows are filled best-fit with
    padding (no loss) at their ends. Fine-tuning samples (jsonl ``prompt`` / ``response`` or chat
    ``messages``, see :func:`read_documents`) need this mode; only their responses are trained. The held-out split is fixed by document: with ``period = round(1 / val_fraction)``
    every ``period``-th document (index ``i % period == period - 1``) is held out, so validation
    never overlaps training. When that cannot fill one validation row (fewer than ``period``
    documents, or short ones), the last ``val_fraction`` of the token stream is held out instead.

    ``paths=None`` reads the embedded corpus: the Python standard library's own ``*.py`` files,
    found through ``sysconfig.get_paths()["stdlib"]`` (real text on every machine, no download),
    without test directories and ``site-packages``; a deterministic subset of about
    :data:`DEFAULT_CORPUS_BYTES` bytes (or ``max_files`` files), one document per file.
    Otherwise ``paths`` lists files or directories: ``.jsonl`` (a ``"text"`` field per line, or
    a fine-tuning sample per line),
    ``.parquet`` (a ``"text"`` column, needs pyarrow), any other file is one text document;
    directories are searched recursively for ``.txt``, ``.jsonl`` and ``.parquet`` files.

Prepared sets
    ``prepared=DIR`` streams a set written by ``hybridzoo prepare`` (:mod:`hybridzoo.training.prepare`)
    instead of reading ``paths``: rows of ``seq_len`` tokens are read from its Arrow shards on
    demand (:mod:`hybridzoo.training.shards`), in ``packing="stream"`` or, with document
    boundaries cut at row edges, ``packing="documents"``; validation reads the set's held-out
    documents; ``tokenizer=None`` uses the set's tokenizer, and another tokenizer than the set's
    is refused. The order is :class:`~hybridzoo.training.shards.ShardSampler`'s (below, without
    padding the last rank: the ranks' rows are disjoint).

Data order and resuming
    Training rows are shuffled by a permutation seeded with ``seed + epoch`` (``torch.randperm``
    through :class:`torch.utils.data.DistributedSampler`, so each rank of a multi-GPU run gets
    its own slice and Lightning does not replace the sampler). The training loader counts the rows
    it has handed out in the current epoch; that position is saved in Lightning checkpoints (both
    through the data module's ``state_dict`` and as a stateful loader of the fit loop), and a run
    resumed from a checkpoint continues the epoch exactly where it stopped.
"""

from __future__ import annotations

import hashlib
import json
import math
import sysconfig
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from hybridzoo.training.mqar import check_mqar_args, multiquery_ar
from hybridzoo.training.packing import DocumentRows, Sample, sample_from_record, tokenize_sequences
from hybridzoo.training.tokenizers import ByteTokenizer, Tokenizer, load_tokenizer

__all__ = [
    "DEFAULT_CORPUS_BYTES",
    "DataError",
    "MQARDataModule",
    "PackedDataset",
    "ResumableLoader",
    "ResumableSampler",
    "TextDataModule",
    "read_documents",
    "split_documents",
    "stdlib_files",
]

DEFAULT_CORPUS_BYTES = 4_000_000
DIRECTORY_SUFFIXES = (".txt", ".jsonl", ".parquet")
_SKIPPED_DIRS = {"test", "tests", "idle_test", "site-packages", "__pycache__"}

Document = str | bytes | Sample
PACKINGS = ("stream", "documents")


# --------------------------------------------------------------------------- reading documents


def stdlib_files(max_files: int | None = None, max_bytes: int = DEFAULT_CORPUS_BYTES) -> list[Path]:
    """The standard library's ``*.py`` files of the embedded corpus, sorted by relative path.

    Test directories (``test``, ``tests``, ``idle_test``), ``site-packages`` and ``__pycache__``
    are skipped. Files are taken in a fixed pseudo-random order (MD5 of the relative path, the same
    on every machine with the same Python) until ``max_files`` files, or, when ``max_files`` is
    None, until ``max_bytes`` bytes; the chosen files are returned sorted.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    eligible = sorted(
        p.relative_to(root).as_posix()
        for p in root.rglob("*.py")
        if p.is_file() and not _SKIPPED_DIRS.intersection(p.relative_to(root).parts[:-1])
    )
    if not eligible:
        raise FileNotFoundError(f"no *.py files found in the standard library directory {root}")
    chosen, total = [], 0
    for rel in sorted(eligible, key=lambda r: hashlib.md5(r.encode()).hexdigest()):
        if max_files is not None and len(chosen) >= max_files:
            break
        if max_files is None and total >= max_bytes:
            break
        chosen.append(rel)
        total += (root / rel).stat().st_size
    return [root / rel for rel in sorted(chosen)]


def _expand(paths: Sequence[str | Path]) -> list[Path]:
    """Files named by ``paths``: files as given, directories searched recursively (sorted)."""
    files = []
    for path in paths:
        path = Path(path).expanduser()
        if not path.exists():
            raise FileNotFoundError(f"data path {str(path)!r} does not exist")
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in DIRECTORY_SUFFIXES)
            if not found:
                raise ValueError(
                    f"data directory {str(path)!r} holds no {', '.join(DIRECTORY_SUFFIXES)} files"
                )
            files += found
        else:
            files.append(path)
    return files


class DataError(ValueError):
    """A data file that cannot be read as documents: not UTF-8 text, a malformed jsonl line, a
    missing ``text`` field or column, ... The message names the file (and the line or row)."""


_DECODING_FIX = ("text files are read as UTF-8 (errors='strict'): convert the file to UTF-8 "
                 "(e.g. iconv -f latin1 -t utf-8) or leave it out")


def _check_text(text: str, where: str) -> str:
    """``text`` if it can be a document: no NUL character (the byte tokenizer's end-of-document
    id, and the mark of a binary file) and encodable as UTF-8 (no lone surrogate such as a JSON
    ``"\\ud800"``); else :class:`DataError` naming ``where``."""
    nul = text.find("\x00")
    if nul >= 0:
        raise DataError(f"{where}: holds a NUL character at position {nul}: not text "
                        f"(a binary file?); documents must be UTF-8 text without NUL, which marks the "
                        f"end of a document")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise DataError(f"{where}: not valid Unicode text (character {error.start} is a lone surrogate "
                        f"{text[error.start]!r})") from None
    return text


def _decode(data: bytes, where: str) -> str:
    """``data`` decoded as UTF-8 (``errors="strict"``) and checked by :func:`_check_text`; a
    :class:`DataError` naming ``where`` and the byte offset otherwise."""
    nul = data.find(b"\x00")
    if nul >= 0:
        raise DataError(f"{where}: NUL byte at offset {nul}: a binary file, not text (data files are read "
                        f"as UTF-8 text, errors='strict'); leave it out")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise DataError(f"{where}: not UTF-8 text (byte 0x{data[error.start]:02x} at offset {error.start}); "
                        f"{_DECODING_FIX}") from None
    return _check_text(text, where)


def read_documents(path: str | Path) -> list[Document]:
    """The documents of one file: ``.jsonl`` -> the ``"text"`` of each line, ``.parquet`` -> the
    ``"text"`` column, anything else -> the whole file as one document (UTF-8 bytes).

    A jsonl line may instead hold a fine-tuning sample (a :class:`~hybridzoo.training.packing.Sample`):
    ``{"prompt": str, "response": str}`` or ``{"messages": [{"role": str, "content": str}, ...]}``
    (see :func:`~hybridzoo.training.packing.sample_from_record`).

    Every file is read as UTF-8 with ``errors="strict"``: a byte sequence that is not UTF-8, or a
    NUL byte (the end-of-document id of the byte tokenizer, and the mark of a binary file), is a
    :class:`DataError` naming the file and the offset (the line for jsonl, the row for parquet),
    never a silently mangled document. Empty documents are dropped. Raises :class:`DataError`
    (a ``ValueError``) naming the file (and line) on a malformed jsonl line or a missing ``text``
    field/column, ``ImportError`` for parquet without pyarrow.
    """
    path = Path(path)
    if path.suffix == ".jsonl":
        docs = []
        with path.open("rb") as f:
            for number, raw in enumerate(f, start=1):
                where = f"{path}, line {number}"
                line = _decode(raw, where)
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except RecursionError:
                    raise DataError(f"{where}: not valid JSON (nested too deeply)") from None
                except json.JSONDecodeError as err:
                    raise DataError(f"{where}: not valid JSON ({err.msg.removesuffix(' at')}, "
                                    f"column {err.colno})") from None
                except ValueError as err:  # an integer of more than 4300 digits
                    raise DataError(f"{where}: not valid JSON ({err})") from None
                sample = sample_from_record(record, where) if isinstance(record, dict) else None
                if sample is not None:
                    docs.append(sample)
                    continue
                if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                    raise DataError(f'{where}: expected an object with a "text" string field '
                                    f'(or a fine-tuning sample: "prompt" and "response", or "messages")')
                docs.append(_check_text(record["text"], where))
    elif path.suffix == ".parquet":
        try:
            import pyarrow
            import pyarrow.parquet as pq
        except ImportError:
            raise ImportError(f"reading {path} needs pyarrow: install pyarrow (pip install pyarrow)") from None
        try:
            table = pq.read_table(path)
        except (pyarrow.ArrowException, OSError) as error:
            raise DataError(f"{path}: not a readable parquet file ({error})") from None
        if "text" not in table.column_names:
            raise DataError(f'{path}: no "text" column (columns: {", ".join(table.column_names)})')
        docs = table.column("text").to_pylist()
        for row, text in enumerate(docs):
            if text is not None and not isinstance(text, str):
                raise DataError(f'{path}, row {row}: the "text" column holds {type(text).__name__} values, '
                                f"not strings")
            if text is not None:
                _check_text(text, f"{path}, row {row}")
        docs = [t for t in docs if t is not None]
    else:
        data = path.read_bytes()
        _decode(data, str(path))
        docs = [data]
    return [d for d in docs if d]


def split_documents(docs: Sequence[Document], val_fraction: float) -> tuple[list, list]:
    """``(train, val)``: every ``round(1 / val_fraction)``-th document is held out."""
    period = max(2, round(1 / val_fraction))
    val = [d for i, d in enumerate(docs) if i % period == period - 1]
    train = [d for i, d in enumerate(docs) if i % period != period - 1]
    return train, val


def _pack(docs: Sequence[Document], tokenizer: Tokenizer) -> torch.Tensor:
    """1-D token stream: each document's tokens followed by ``tokenizer.eos_id`` (if any).

    uint8 for the byte tokenizer (fast path, no Python list of ints), int32 otherwise.
    """
    if isinstance(tokenizer, ByteTokenizer):
        buf = bytearray()
        for doc in docs:
            buf += doc if isinstance(doc, bytes) else doc.encode("utf-8")
            buf.append(tokenizer.eos_id)
        return torch.frombuffer(buf, dtype=torch.uint8).clone() if buf else torch.empty(0, dtype=torch.uint8)
    texts = [d.decode("utf-8", errors="replace") if isinstance(d, bytes) else d for d in docs]
    eos = [] if tokenizer.eos_id is None else [tokenizer.eos_id]
    ids = [i for doc_ids in tokenizer.encode_batch(texts) for i in (*doc_ids, *eos)]
    return torch.tensor(ids, dtype=torch.int32)


class PackedDataset(Dataset):
    """Rows of a packed token stream: row ``i`` is ``tokens[i * seq_len : (i + 1) * seq_len]``.

    ``tokens``: 1-D integer tensor (uint8 / int32). Items are
    ``{"input_ids": int64 [seq_len], "labels": int64 [seq_len]}`` with ``labels == input_ids``.
    """

    def __init__(self, tokens: torch.Tensor, seq_len: int):
        self.tokens, self.seq_len = tokens, seq_len

    def __len__(self) -> int:
        return self.tokens.numel() // self.seq_len

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(f"row {i} out of range for {len(self)} rows")
        row = self.tokens[i * self.seq_len : (i + 1) * self.seq_len].long()
        return {"input_ids": row, "labels": row.clone()}


class _ExampleDataset(Dataset):
    """Pre-made examples: ``input_ids`` and ``labels``, int64 ``[N, T]``."""

    def __init__(self, input_ids: torch.Tensor, labels: torch.Tensor):
        self.input_ids, self.labels = input_ids, labels

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.input_ids[i], "labels": self.labels[i]}


# --------------------------------------------------------------------------- resumable order


class ResumableSampler(DistributedSampler):
    """Row indices in a seeded order: ``torch.randperm`` seeded with ``seed + epoch``, sliced for
    this rank (``DistributedSampler`` with ``drop_last=False``, which pads the last ranks by
    repeating rows), starting at ``start`` (rows of this epoch already consumed).

    ``start`` is set by :class:`ResumableLoader` before each pass; ``len`` is always a full epoch.
    """

    def __init__(self, num_rows: int, seed: int = 0, num_replicas: int = 1, rank: int = 0):
        super().__init__(range(num_rows), num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed)
        self.start = 0

    def __iter__(self) -> Iterator[int]:
        return iter(list(super().__iter__())[self.start :])


class ResumableLoader(DataLoader):
    """A ``DataLoader`` over a :class:`ResumableSampler` that knows its position in the epoch.

    The position ``(epoch, samples_done)`` is counted in the main process as batches are handed
    out (Lightning does not prefetch from loaders that have a length), so it is exact with worker
    processes too. ``state_dict()`` / ``load_state_dict()`` save and restore it: after loading,
    the next pass over epoch ``epoch`` skips the ``samples_done`` rows already trained on.
    """

    def __init__(self, dataset: Dataset, batch_size: int, sampler: ResumableSampler, num_workers: int = 0):
        super().__init__(dataset, batch_size=batch_size, sampler=sampler, num_workers=num_workers)
        self._position = (sampler.epoch, 0)
        self._resume: tuple[int, int] | None = None

    def __iter__(self):
        sampler = self.sampler
        epoch, start = sampler.epoch, 0
        if self._resume is not None and self._resume[0] == epoch:
            start = self._resume[1]
        if self._resume is not None and self._resume[0] <= epoch:
            self._resume = None  # a resume point applies once, to its own epoch
        sampler.start = start
        self._position = (epoch, start)
        for batch in super().__iter__():
            start += len(batch["input_ids"])
            self._position = (epoch, start)
            yield batch

    def state_dict(self) -> dict:
        sampler = self.sampler
        epoch, done = self._position
        if sampler.epoch > epoch:  # a new epoch has been set and not started yet
            epoch, done = sampler.epoch, 0
        return {
            "epoch": epoch,
            "samples_done": done,
            "num_rows": len(sampler.dataset),
            "seed": sampler.seed,
            "num_replicas": sampler.num_replicas,
        }

    def load_state_dict(self, state: dict) -> None:
        sampler = self.sampler
        mine = {"num_rows": len(sampler.dataset), "seed": sampler.seed, "num_replicas": sampler.num_replicas}
        theirs = {k: state.get(k) for k in mine}
        if theirs != mine:
            warnings.warn(
                f"the checkpoint's data position was saved with {theirs}, this run has {mine}: "
                "the training data order restarts at the beginning of the epoch",
                stacklevel=2,
            )
            return
        epoch, done = int(state["epoch"]), min(int(state["samples_done"]), sampler.num_samples)
        self._resume = self._position = (epoch, done)
        sampler.set_epoch(epoch)


class _ResumableDataModule(L.LightningDataModule):
    """Shared training-loader logic: seeded order, rank slicing, resumable position."""

    _sampler_class = ResumableSampler

    def __init__(self):
        super().__init__()
        self._train_set: Dataset | None = None
        self._val_set: Dataset | None = None
        self._train_loader: ResumableLoader | None = None
        self._resume_state: dict | None = None

    def _ranks(self) -> tuple[int, int]:
        trainer = getattr(self, "trainer", None)
        if trainer is not None:
            return trainer.world_size, trainer.global_rank
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            return torch.distributed.get_world_size(), torch.distributed.get_rank()
        return 1, 0

    def train_dataloader(self) -> ResumableLoader:
        if self._train_set is None:
            self.setup("fit")
        world_size, rank = self._ranks()
        sampler = self._sampler_class(len(self._train_set), seed=self.seed, num_replicas=world_size, rank=rank)
        loader = ResumableLoader(self._train_set, self.batch_size, sampler, num_workers=self.num_workers)
        if self._resume_state:
            loader.load_state_dict(self._resume_state)
        self._train_loader = loader
        return loader

    def val_dataloader(self) -> DataLoader:
        if self._val_set is None:
            self.setup("validate")
        return DataLoader(self._val_set, batch_size=self.batch_size, shuffle=False, num_workers=self.num_workers)

    def test_dataloader(self) -> DataLoader:
        return self.val_dataloader()

    def state_dict(self) -> dict:
        """The training loader's position (saved in Lightning checkpoints)."""
        if self._train_loader is not None:
            return self._train_loader.state_dict()
        return dict(self._resume_state or {})

    def load_state_dict(self, state_dict: dict) -> None:
        """Resume the training order at a saved position (applies to the current loader too)."""
        self._resume_state = dict(state_dict)
        if self._train_loader is not None and state_dict:
            self._train_loader.load_state_dict(state_dict)

    def teardown(self, stage: str) -> None:
        # a later fit with this data module starts fresh unless it loads a checkpoint again
        self._train_loader, self._resume_state = None, None


# --------------------------------------------------------------------------- data modules


class TextDataModule(_ResumableDataModule):
    """Packed language-modelling rows from local text files or the embedded stdlib corpus.

    Args:
        paths: files or directories (see the module docstring); ``None`` = the embedded corpus.
        tokenizer: ``None`` (or ``"bytes"``) = UTF-8 bytes, vocab 256; else a local Hugging Face
            tokenizer directory (or its ``tokenizer.json``).
        seq_len: tokens per row (``T``).
        batch_size: rows per batch (per device).
        val_fraction: share of documents held out, in (0, 0.5].
        seed: seed of the training order (epoch ``e`` uses ``seed + e``).
        num_workers: DataLoader worker processes.
        max_files: read at most this many files (the first ones, sorted; for the embedded corpus
            see :func:`stdlib_files`).
        packing: ``"stream"`` (rows cut from one token stream, documents read each other) or
            ``"documents"`` (rows with document boundaries and ``position_ids``; needed for
            fine-tuning samples). See the module docstring.
        prepared: a directory written by ``hybridzoo prepare`` (instead of ``paths``): its token
            shards are streamed from disk (see "Prepared sets" in the module docstring).
    """

    def __init__(
        self,
        paths: list[str] | None = None,
        tokenizer: str | None = None,
        seq_len: int = 256,
        batch_size: int = 8,
        val_fraction: float = 0.05,
        seed: int = 0,
        num_workers: int = 0,
        max_files: int | None = None,
        packing: str = "stream",
        prepared: str | None = None,
    ):
        super().__init__()
        if prepared is not None and paths is not None:
            raise ValueError("give the data as paths (read at start-up) or as prepared (a prepared set), not both")
        if packing not in PACKINGS:
            raise ValueError(f"packing must be one of {', '.join(map(repr, PACKINGS))}, got {packing!r}")
        if isinstance(paths, (str, Path)):
            paths = [paths]
        if paths is not None and len(paths) == 0:
            raise ValueError("paths is an empty list; give files or directories, or None for the embedded corpus")
        if seq_len < 2:
            raise ValueError(f"seq_len must be >= 2, got {seq_len}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if not 0 < val_fraction <= 0.5:
            raise ValueError(f"val_fraction must be in (0, 0.5], got {val_fraction}")
        if max_files is not None and max_files < 1:
            raise ValueError(f"max_files must be >= 1 or None, got {max_files}")
        for path in paths or []:
            if not Path(path).expanduser().exists():
                raise FileNotFoundError(f"data path {str(path)!r} does not exist")
        self.paths = [str(p) for p in paths] if paths is not None else None
        self.tokenizer_spec = tokenizer
        self.seq_len, self.batch_size, self.val_fraction = seq_len, batch_size, val_fraction
        self.seed, self.num_workers, self.max_files = seed, num_workers, max_files
        self.packing = packing
        self.prepared = str(prepared) if prepared is not None else None
        self._prepared = None
        if prepared is not None:
            from hybridzoo.training.manifest import PreparedSet
            from hybridzoo.training.shards import ShardSampler

            self._prepared = PreparedSet(prepared)
            self._sampler_class = ShardSampler
        self._tokenizer: Tokenizer | None = None
        self.save_hyperparameters()

    @property
    def tokenizer(self) -> Tokenizer:
        if self._tokenizer is None:
            if self._prepared is None:
                self._tokenizer = load_tokenizer(self.tokenizer_spec)
            else:
                self._tokenizer = _prepared_tokenizer(self._prepared, self.tokenizer_spec)
        return self._tokenizer

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    def tokenizer_files(self) -> list[Path]:
        return self.tokenizer.files()

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def decode(self, ids) -> str:
        return self.tokenizer.decode(ids)

    @property
    def source(self) -> str:
        """Where the data comes from, in words (for messages)."""
        if self._prepared is not None:
            return f"the prepared set {self.prepared}"
        if self.paths is None:
            return f"the embedded stdlib corpus ({sysconfig.get_paths()['stdlib']})"
        return ", ".join(self.paths)

    def documents(self) -> list[Document]:
        """All documents, in a fixed order (files sorted as documented, lines in file order)."""
        if self.paths is None:
            return [p.read_bytes() for p in stdlib_files(self.max_files)]
        selected = [(path, f) for path in self.paths for f in _expand([path])]
        if self.max_files is not None:
            selected = selected[: self.max_files]
        docs, per_path = [], dict.fromkeys((p for p, _ in selected), 0)
        for path, file in selected:
            found = read_documents(file)
            docs += found
            per_path[path] += len(found)
        for path, count in per_path.items():
            if count == 0:
                raise ValueError(f"data path {path!r} holds no text (empty files or no documents)")
        return docs

    def setup(self, stage: str | None = None) -> None:
        if self._train_set is not None:
            return
        if self._prepared is not None:
            return self._setup_prepared()
        docs = self.documents()
        if not docs:
            raise ValueError(f"{self.source}: no text")
        if self.packing == "documents":
            return self._setup_documents(docs)
        if any(isinstance(d, Sample) for d in docs):
            raise ValueError(f"{self.source} holds fine-tuning samples (prompt/response or messages): they are "
                             "packed with their boundaries only; pass packing='documents' (--data.packing documents)")
        train_docs, val_docs = split_documents(docs, self.val_fraction)
        val = _pack(val_docs, self.tokenizer)
        if val.numel() >= self.seq_len:
            train = _pack(train_docs, self.tokenizer)
            self.bytes_per_token = _utf8_bytes(val_docs) / val.numel()
        else:  # too few or too short held-out documents: hold out the end of the token stream
            stream = _pack(docs, self.tokenizer)
            self.bytes_per_token = _utf8_bytes(docs) / max(1, stream.numel())
            n_val = math.ceil(self.val_fraction * stream.numel())
            train, val = stream[: stream.numel() - n_val], stream[stream.numel() - n_val :]
            if min(train.numel(), val.numel()) < self.seq_len:
                needed = math.ceil(self.seq_len / self.val_fraction)
                raise ValueError(
                    f"{self.source} has {stream.numel()} tokens: too few for seq_len={self.seq_len} with "
                    f"val_fraction={self.val_fraction}; the training split ({train.numel()} tokens) and the "
                    f"validation split ({val.numel()} tokens) each need at least {self.seq_len} tokens, "
                    f"about {needed} tokens in all. Use a smaller seq_len or more data."
                )
        if train.numel() < self.seq_len:
            raise ValueError(
                f"the training split of {self.source} has {train.numel()} tokens; one row of "
                f"seq_len={self.seq_len} needs {self.seq_len}. Use a smaller seq_len or more data."
            )
        if isinstance(self.tokenizer, ByteTokenizer):
            self.bytes_per_token = 1.0  # one byte per token; document separators count as tokens
        self._train_set = PackedDataset(train, self.seq_len)
        self._val_set = PackedDataset(val, self.seq_len)


    def _setup_documents(self, docs: list[Document]) -> None:
        """``packing="documents"``: held-out documents as in stream mode (the last document when
        that holds out none), each split packed into rows with boundaries."""
        train_docs, val_docs = split_documents(docs, self.val_fraction)
        if not val_docs:
            train_docs, val_docs = docs[:-1], docs[-1:]
        if not train_docs:
            raise ValueError(f"{self.source} holds {len(docs)} document: packing='documents' needs at least 2 "
                             "(one to train on, one held out); add documents or use packing='stream'")
        pad = self.tokenizer.eos_id if self.tokenizer.eos_id is not None else 0
        train = DocumentRows(tokenize_sequences(train_docs, self.tokenizer), self.seq_len, pad)
        val = DocumentRows(tokenize_sequences(val_docs, self.tokenizer), self.seq_len, pad)
        real = val.tokens.numel() - val.padding
        if isinstance(self.tokenizer, ByteTokenizer):
            self.bytes_per_token = 1.0
        elif real and not any(isinstance(d, Sample) for d in val_docs):
            self.bytes_per_token = _utf8_bytes(val_docs) / real
        self._train_set, self._val_set = train, val


    def _setup_prepared(self) -> None:
        """Rows streamed from a prepared set's shards; its own held-out documents validate."""
        from hybridzoo.training.shards import ShardRows, open_split

        prepared = self._prepared
        tokenizer = self.tokenizer  # checks the run's tokenizer against the set's
        model = getattr(getattr(self, "trainer", None), "lightning_module", None)
        vocab = getattr(getattr(model, "config", None), "vocab_size", None)
        prepared.check_vocab(int(vocab) if vocab is not None else tokenizer.vocab_size)
        train = ShardRows(open_split(prepared, "train"), self.seq_len, self.packing)
        val = ShardRows(open_split(prepared, "val"), self.seq_len, self.packing)
        for name, rows, stream in (("training", train, train.stream), ("validation", val, val.stream)):
            if len(rows) == 0:
                raise ValueError(
                    f"{self.source}: the {name} split has {len(stream)} tokens; one row of seq_len={self.seq_len} "
                    f"needs {self.seq_len}. Use a smaller seq_len, more data"
                    + (", or prepare with a larger --val-fraction" if name == "validation" else ""))
        text_bytes = prepared.manifest["splits"]["val"].get("text_bytes")
        self.bytes_per_token = 1.0 if isinstance(tokenizer, ByteTokenizer) else (
            text_bytes / len(val.stream) if text_bytes else None)
        self._train_set, self._val_set = train, val


def _prepared_tokenizer(prepared, spec: str | None) -> Tokenizer:
    """The run's tokenizer for a prepared set: ``spec`` (checked against the set's manifest), or,
    when None, the set's own (the byte tokenizer, or the directory it was prepared with)."""
    if spec is None:
        name = prepared.tokenizer["name"]
        if name != "bytes" and not Path(name).exists():
            raise FileNotFoundError(f"{prepared.path}: the set was prepared with tokenizer {name!r}, which no "
                                    "longer exists there; pass data.tokenizer (the same tokenizer)")
        spec = None if name == "bytes" else name
    tokenizer = load_tokenizer(spec)
    prepared.check_tokenizer(tokenizer)
    return tokenizer


def _utf8_bytes(docs: Sequence[Document]) -> int:
    """UTF-8 bytes of the documents, plus one per document for its separator token: bits per
    byte are then comparable between byte-level and subword tokenizers on the same text."""
    return sum((len(d) if isinstance(d, bytes) else len(d.encode("utf-8"))) + 1 for d in docs)


class MQARDataModule(_ResumableDataModule):
    """Multi-query associative recall (Zoology), see :mod:`hybridzoo.training.mqar`.

    ``num_train`` training and ``num_val`` validation examples of ``seq_len`` tokens with
    ``num_pairs`` key-value pairs each; the two sets come from different seeds
    (``2 * seed`` and ``2 * seed + 1``). Zoology's settings: vocab 8192, seq_len 64-512,
    4-64 pairs, ``power_a = 0.01``, random filler tokens.
    """

    def __init__(
        self,
        vocab_size: int = 8192,
        seq_len: int = 128,
        num_pairs: int = 8,
        num_train: int = 20000,
        num_val: int = 1000,
        batch_size: int = 64,
        seed: int = 0,
        power_a: float = 0.01,
        random_non_queries: bool = True,
        num_workers: int = 0,
    ):
        super().__init__()
        check_mqar_args(vocab_size, seq_len, num_pairs)
        if num_train < 1 or num_val < 1:
            raise ValueError(f"num_train and num_val must be >= 1, got {num_train} and {num_val}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if power_a <= 0:
            raise ValueError(f"power_a must be > 0, got {power_a}")
        self.vocab_size, self.seq_len, self.num_pairs = vocab_size, seq_len, num_pairs
        self.num_train, self.num_val, self.batch_size, self.seed = num_train, num_val, batch_size, seed
        self.power_a, self.random_non_queries, self.num_workers = power_a, random_non_queries, num_workers
        self.save_hyperparameters()

    def _generate(self, num_examples: int, seed: int) -> _ExampleDataset:
        return _ExampleDataset(
            *multiquery_ar(
                num_examples, self.seq_len, self.vocab_size, self.num_pairs, seed,
                power_a=self.power_a, random_non_queries=self.random_non_queries,
            )
        )

    def setup(self, stage: str | None = None) -> None:
        if self._train_set is None:
            self._train_set = self._generate(self.num_train, 2 * self.seed)
            self._val_set = self._generate(self.num_val, 2 * self.seed + 1)

    def tokenizer_files(self) -> list[Path]:
        return []

    def encode(self, text: str) -> list[int]:
        """MQAR ids written as whitespace-separated integers."""
        return [int(token) for token in text.split()]

    def decode(self, ids) -> str:
        return " ".join(str(int(i)) for i in (ids.tolist() if hasattr(ids, "tolist") else ids))
