"""Reading a prepared set (``hybridzoo prepare``): its manifest, its token stream, its rows.

A prepared set is a directory written by :mod:`hybridzoo.training.prepare`::

    OUT/manifest.json          written last: a set without it is unfinished
    OUT/train/shard-00000.arrow ...   Hugging Face ``datasets`` Arrow files
    OUT/val/shard-00000.arrow ...

Each Arrow file is a ``datasets`` dataset (``datasets.Dataset.from_file(path)`` opens it) with one
column ``input_ids`` (a list of ``uint8`` / ``uint16`` / ``uint32`` token ids per row) and one row
per document, its end-of-document id included: the Arrow list offsets are the document
boundaries.

Training reads the token values straight from the files with ``os.pread`` at the offsets Arrow
reports for each record batch (:class:`TokenStream`), so that reading a 20 GB set neither maps
it into the process (resident memory would then count every page read) nor copies more than the
rows asked for: resident memory stays flat whatever the size of the set; the operating system's
page cache does the caching.

Rows (:class:`ShardRows`): the documents of a split, in file order, form one token stream; row
``i`` is the stream's tokens ``[i * seq_len, (i + 1) * seq_len)`` (the rest of the stream is
dropped). ``packing="stream"`` gives ``{"input_ids", "labels"}`` with ``labels == input_ids``;
``packing="documents"`` adds ``position_ids`` that restart at 0 at every document start and at
the row start (a document cut by a row edge continues as a document of its own), and ``labels``
are -100 at each of those starts, so that no target crosses a document boundary (the batch
format of :mod:`hybridzoo.training.packing`, without padding: rows are cut from the stream, not
filled best-fit).

This module imports pyarrow only when a set is opened; ``datasets`` is not needed to read.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset, DistributedSampler

from hybridzoo.training.manifest import MANIFEST, PreparedSet, tokenizer_identity

__all__ = ["MANIFEST", "PreparedSet", "ShardRows", "ShardSampler", "TokenStream", "open_split", "tokenizer_identity"]


# --------------------------------------------------------------------------- the token stream


def _record_batches(path: Path) -> Iterator[tuple[int, np.ndarray]]:
    """``(file offset of the first token, document offsets int64 [docs + 1] from 0)`` of each
    record batch of one Arrow file (IPC stream, as ``datasets`` writes it)."""
    try:
        import pyarrow as pa
    except ImportError:
        raise ImportError("reading a prepared set needs pyarrow: pip install 'hybridzoo[data]'") from None

    with pa.memory_map(str(path)) as source:
        base = source.read_buffer(1).address  # zero-copy: the address of the file's first byte
        source.seek(0)
        reader = pa.ipc.open_stream(source)
        column = reader.schema.get_field_index("input_ids")
        if column < 0:
            raise ValueError(f"shard {path}: no input_ids column (columns: {', '.join(reader.schema.names)})")
        for batch in reader:
            lists = batch.column(column)
            if lists.null_count:
                raise ValueError(f"shard {path}: null documents")
            offsets = lists.offsets.to_numpy().astype(np.int64)
            values = lists.values
            start = values.buffers()[1].address - base + (values.offset + offsets[0]) * values.type.byte_width
            yield int(start), offsets - offsets[0]


def open_split(prepared: PreparedSet, split: str) -> TokenStream:
    """The :class:`TokenStream` of a prepared set's ``split`` (``"train"`` / ``"val"``)."""
    return TokenStream(prepared.files(split), prepared.dtype)


class TokenStream:
    """The documents of some Arrow shard files as one token stream, read with ``os.pread``.

    Args:
        files: the shard files in order.
        dtype: the token dtype of the files.

    ``len(stream)`` is the number of tokens; ``stream.read(lo, hi)`` the tokens ``[lo, hi)`` as a
    numpy array of ``dtype``; ``stream.document_starts()`` the stream position of every document
    start, int64 ``[documents]``. File handles are opened lazily in each process (loader workers).
    """

    def __init__(self, files: list[Path], dtype):
        self.files, self.dtype = [str(f) for f in files], np.dtype(dtype)
        segment_file, segment_offset, starts, doc_offsets, total = [], [], [0], [], 0
        for n, path in enumerate(self.files):
            for offset, docs in _record_batches(Path(path)):
                if docs[-1] == 0:
                    continue
                segment_file.append(n)
                segment_offset.append(offset)
                doc_offsets.append(docs[:-1] + total)
                total += int(docs[-1])
                starts.append(total)
        self._file = np.array(segment_file, dtype=np.int32)
        self._offset = np.array(segment_offset, dtype=np.int64)
        self._starts = np.array(starts, dtype=np.int64)  # stream position of each segment, [segments + 1]
        self._doc_offsets = doc_offsets  # concatenated on first use (packed mode only)
        self._doc_starts: np.ndarray | None = None
        self._fds: dict[int, int] = {}
        self._pid = os.getpid()

    def __len__(self) -> int:
        return int(self._starts[-1])

    @property
    def num_documents(self) -> int:
        return sum(len(d) for d in self._doc_offsets)

    def document_starts(self) -> np.ndarray:
        if self._doc_starts is None:
            self._doc_starts = (np.concatenate(self._doc_offsets) if self._doc_offsets
                                else np.empty(0, dtype=np.int64))
            self._doc_offsets = [self._doc_starts]
        return self._doc_starts

    def _fd(self, n: int) -> int:
        if self._pid != os.getpid():  # a forked loader worker: its own descriptors
            self._fds, self._pid = {}, os.getpid()
        fd = self._fds.get(n)
        if fd is None:
            fd = self._fds[n] = os.open(self.files[n], os.O_RDONLY)
        return fd

    def read(self, lo: int, hi: int) -> np.ndarray:
        """Tokens ``[lo, hi)`` of the stream (``0 <= lo <= hi <= len(self)``)."""
        size = self.dtype.itemsize
        out = np.empty(hi - lo, dtype=self.dtype)
        seg = int(np.searchsorted(self._starts, lo, side="right")) - 1
        at = lo
        while at < hi:
            seg_lo, seg_hi = int(self._starts[seg]), int(self._starts[seg + 1])
            end = min(hi, seg_hi)
            count = (end - at) * size
            data = os.pread(self._fd(int(self._file[seg])), count, int(self._offset[seg]) + (at - seg_lo) * size)
            if len(data) != count:
                raise ValueError(f"shard {self.files[int(self._file[seg])]} is shorter than its Arrow metadata says "
                                 "(truncated file?): prepare the set again")
            out[at - lo : end - lo] = np.frombuffer(data, dtype=self.dtype)
            at, seg = end, seg + 1
        return out

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_fds": {}}

    def __del__(self):
        if getattr(self, "_pid", None) == os.getpid():
            for fd in getattr(self, "_fds", {}).values():
                try:
                    os.close(fd)
                except OSError:
                    pass


# --------------------------------------------------------------------------- rows and their order


class ShardRows(Dataset):
    """Rows of ``seq_len`` tokens cut from a :class:`TokenStream` (see the module docstring).

    Items: ``input_ids`` and ``labels`` int64 ``[seq_len]`` (``packing="stream"``), plus
    ``position_ids`` int64 ``[seq_len]`` (``packing="documents"``).
    """

    def __init__(self, stream: TokenStream, seq_len: int, packing: str = "stream"):
        self.stream, self.seq_len, self.packing = stream, seq_len, packing
        self._doc_starts = stream.document_starts() if packing == "documents" else None

    def __len__(self) -> int:
        return len(self.stream) // self.seq_len

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(f"row {i} out of range for {len(self)} rows")
        lo, hi = i * self.seq_len, (i + 1) * self.seq_len
        ids = torch.from_numpy(self.stream.read(lo, hi).astype(np.int64))
        if self.packing != "documents":
            return {"input_ids": ids, "labels": ids.clone()}
        starts = self._doc_starts
        inside = starts[np.searchsorted(starts, lo) : np.searchsorted(starts, hi)] - lo
        is_start = torch.zeros(self.seq_len, dtype=torch.bool)
        is_start[0] = True
        is_start[torch.from_numpy(inside)] = True
        index = torch.arange(self.seq_len)
        position_ids = index - torch.cummax(torch.where(is_start, index, 0), dim=0).values
        labels = torch.where(is_start, torch.full_like(ids, -100), ids)
        return {"input_ids": ids, "labels": labels, "position_ids": position_ids}


class ShardSampler(DistributedSampler):
    """:class:`~hybridzoo.training.data.ResumableSampler` for many rows: the permutation
    (``torch.randperm`` seeded with ``seed + epoch``) stays a tensor, the last
    ``num_rows % num_replicas`` rows of it are dropped, so the ranks' rows are disjoint
    (rank ``r`` takes positions ``r, r + R, ...``), and indices are handed out in chunks. Its
    memory is the permutation: 4 bytes a row (8 beyond 2**31 rows)."""

    def __init__(self, num_rows: int, seed: int = 0, num_replicas: int = 1, rank: int = 0):
        super().__init__(range(num_rows), num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed,
                         drop_last=True)
        if self.num_samples == 0:
            raise ValueError(f"{num_rows} training rows cannot feed {num_replicas} ranks: each needs at least one")
        self.start = 0  # rows of this epoch already consumed (set by ResumableLoader)

    def __iter__(self) -> Iterator[int]:
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)
        rows = len(self.dataset)  # int32 when it fits: 4 bytes a row (the same permutation as int64)
        order = torch.randperm(rows, generator=generator, dtype=torch.int32 if rows < 2**31 else torch.int64)
        mine = order[self.rank : self.total_size : self.num_replicas][self.start :]
        for at in range(0, len(mine), 8192):
            yield from mine[at : at + 8192].tolist()
