"""``hybridzoo prepare SRC... OUT``: tokenize a corpus once, on all cores, into Arrow token shards.

Sources (files, or directories searched recursively):

* ``.jsonl``: one document per line, its ``"text"`` field (``--text-field``);
* ``.parquet``: the ``"text"`` column (needs pyarrow);
* a Hugging Face dataset saved with ``save_to_disk`` (a directory with ``dataset_info.json`` and
  ``state.json``): its ``"text"`` column;
* ``.txt`` (and, named directly, any other file): one document per file.

The work is cut into tasks of about ``shard_bytes`` of input (line-aligned byte ranges of a jsonl
file, row groups of a parquet file, row ranges of a saved dataset, groups of text files); a pool
of ``workers`` processes tokenizes them (the byte tokenizer, or a local Hugging Face tokenizer,
batch-encoded) and each task writes one shard per split with Hugging Face ``datasets``'
``ArrowWriter``: ``OUT/train/shard-NNNNN.arrow`` and ``OUT/val/shard-NNNNN.arrow``, one row per
document (its ids and the tokenizer's end-of-document id), column ``input_ids`` of the smallest
unsigned dtype that holds the vocabulary. ``datasets.Dataset.from_file`` opens each.

Validation is held out by document, as in :class:`~hybridzoo.training.data.TextDataModule`:
within each task, every ``round(1 / val_fraction)``-th document goes to ``val``.

Interruptions: the plan (sources with their sizes and modification times, tokenizer, settings)
is written first to ``OUT/.prepare/plan.json``; each shard is written under a temporary name and
renamed when complete, then its counts are recorded in ``OUT/.prepare/done-NNNNN.json``;
``OUT/manifest.json`` is written last (see :mod:`hybridzoo.training.shards`). Rerunning the same
command into an unfinished ``OUT`` resumes (finished shards are kept); a different command
refuses and names ``--overwrite``; a finished ``OUT`` is never rewritten without ``--overwrite``.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from hybridzoo.training.prepare_args import DEFAULT_SHARD_BYTES
from hybridzoo.training.manifest import DTYPES, FORMAT, MANIFEST, VERSION, token_dtype, tokenizer_identity
from hybridzoo.training.tokenizers import ByteTokenizer, load_tokenizer

__all__ = ["PrepareError", "Task", "plan_tasks", "prepare", "prepare_command"]

WRITER_BATCH_DOCS = 4096
ENCODE_BATCH_BYTES = 1 << 20


class PrepareError(ValueError):
    """Bad input or a refused output directory (one line, names the file and the fix)."""


@dataclass(frozen=True)
class Task:
    """One unit of work: ``kind`` in ``jsonl`` (byte range ``[start, stop)`` of ``files[0]``),
    ``parquet`` (row groups ``[start, stop)``), ``arrow`` (rows ``[start, stop)`` of a saved
    dataset) or ``text`` (whole files, one document each)."""

    kind: str
    files: tuple[str, ...]
    start: int = 0
    stop: int = 0
    bytes: int = 0


@dataclass
class _Settings:
    tokenizer: str | None
    text_field: str = "text"
    val_fraction: float = 0.05
    dtype: str = "uint8"
    eos_id: int | None = 0


# --------------------------------------------------------------------------- planning


def _is_saved_dataset(path: Path) -> bool:
    return path.is_dir() and (path / "state.json").is_file() and (path / "dataset_info.json").is_file()


def source_files(sources: list[str | Path]) -> list[Path]:
    """The files (and saved datasets) named by ``sources``, directories searched recursively for
    ``.txt``, ``.jsonl``, ``.parquet`` files and saved datasets, sorted."""
    found: list[Path] = []
    for source in sources:
        path = Path(source).expanduser()
        if not path.exists():
            raise FileNotFoundError(f"source {str(source)!r} does not exist")
        if _is_saved_dataset(path) or path.is_file():
            found.append(path)
            continue
        if (path / "dataset_dict.json").is_file():
            raise PrepareError(f"{path} is a saved DatasetDict: name one of its splits (e.g. {path / 'train'})")
        inside = []
        for root, dirs, files in os.walk(path):
            dirs.sort()
            if _is_saved_dataset(Path(root)):
                inside.append(Path(root))
                dirs.clear()
                continue
            inside += [Path(root) / f for f in sorted(files) if Path(f).suffix in (".txt", ".jsonl", ".parquet")]
        if not inside:
            raise PrepareError(f"source directory {str(path)!r} holds no .txt, .jsonl or .parquet files "
                               "or saved datasets")
        found += sorted(inside)
    return found


def _jsonl_tasks(path: Path, shard_bytes: int) -> list[Task]:
    size = path.stat().st_size
    count = max(1, math.ceil(size / shard_bytes))
    bounds = [size * i // count for i in range(count + 1)]
    return [Task("jsonl", (str(path),), lo, hi, hi - lo) for lo, hi in zip(bounds, bounds[1:]) if hi > lo]


def _parquet_tasks(path: Path, shard_bytes: int) -> list[Task]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError(f"reading {path} needs pyarrow: pip install pyarrow") from None
    meta = pq.ParquetFile(path).metadata
    tasks, lo, size = [], 0, 0
    for group in range(meta.num_row_groups):
        size += meta.row_group(group).total_byte_size
        if size >= shard_bytes or group == meta.num_row_groups - 1:
            tasks.append(Task("parquet", (str(path),), lo, group + 1, size))
            lo, size = group + 1, 0
    return tasks


def _arrow_tasks(path: Path, shard_bytes: int) -> list[Task]:
    import datasets

    ds = datasets.load_from_disk(str(path))
    if not isinstance(ds, datasets.Dataset):
        raise PrepareError(f"{path} is a saved DatasetDict: name one of its splits")
    size = sum(f.stat().st_size for f in path.glob("*.arrow"))
    count = max(1, math.ceil(size / shard_bytes))
    bounds = [len(ds) * i // count for i in range(count + 1)]
    return [Task("arrow", (str(path),), lo, hi, size // count) for lo, hi in zip(bounds, bounds[1:]) if hi > lo]


def plan_tasks(files: list[Path], shard_bytes: int = DEFAULT_SHARD_BYTES) -> list[Task]:
    """The tasks of ``files`` (see the module docstring), in file order."""
    tasks, texts, text_bytes = [], [], 0

    def flush():
        nonlocal texts, text_bytes
        if texts:
            tasks.append(Task("text", tuple(texts), 0, 0, text_bytes))
        texts, text_bytes = [], 0

    for path in files:
        if _is_saved_dataset(path):
            flush()
            tasks += _arrow_tasks(path, shard_bytes)
        elif path.suffix == ".jsonl":
            flush()
            tasks += _jsonl_tasks(path, shard_bytes)
        elif path.suffix == ".parquet":
            flush()
            tasks += _parquet_tasks(path, shard_bytes)
        else:
            texts.append(str(path))
            text_bytes += path.stat().st_size
            if text_bytes >= shard_bytes:
                flush()
    flush()
    return tasks


# --------------------------------------------------------------------------- reading documents


def _line_number(path: str, offset: int) -> int:
    """The 1-based number of the line that starts at byte ``offset`` of ``path``."""
    count, done = 1, 0
    with open(path, "rb") as f:
        while done < offset:
            chunk = f.read(min(1 << 24, offset - done))
            if not chunk:
                break
            count += chunk.count(b"\n")
            done += len(chunk)
    return count


def _jsonl_documents(task: Task, text_field: str):
    path = task.files[0]
    with open(path, "rb") as f:
        position = task.start
        if position > 0:  # a line belongs to the task holding its first byte
            f.seek(position - 1)
            position += len(f.readline()) - 1
        while position < task.stop:
            line = f.readline()
            if not line:
                break
            where, position = position, position + len(line)
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError) as err:
                raise PrepareError(f"{path}, line {_line_number(path, where)}: not valid JSON "
                                   f"({getattr(err, 'msg', err)}); fix or remove the line and rerun") from None
            text = record.get(text_field) if isinstance(record, dict) else None
            if not isinstance(text, str):
                raise PrepareError(f"{path}, line {_line_number(path, where)}: expected an object with a "
                                   f"{text_field!r} string field (--text-field names another)")
            if text:
                yield text


def _table_documents(texts, where: str, text_field: str):
    for text in texts:
        if text is not None and not isinstance(text, str):
            raise PrepareError(f"{where}: column {text_field!r} holds {type(text).__name__}, not text")
        if text:
            yield text


def _parquet_documents(task: Task, text_field: str):
    import pyarrow.parquet as pq

    path = task.files[0]
    file = pq.ParquetFile(path)
    if text_field not in file.schema_arrow.names:
        raise PrepareError(f"{path}: no {text_field!r} column (columns: {', '.join(file.schema_arrow.names)}); "
                           "--text-field names another")
    for group in range(task.start, task.stop):
        texts = file.read_row_group(group, columns=[text_field]).column(0).to_pylist()
        yield from _table_documents(texts, f"{path}, row group {group}", text_field)


def _arrow_documents(task: Task, text_field: str):
    import datasets

    ds = datasets.load_from_disk(task.files[0])
    if text_field not in ds.column_names:
        raise PrepareError(f"{task.files[0]}: no {text_field!r} column (columns: {', '.join(ds.column_names)}); "
                           "--text-field names another")
    for lo in range(task.start, task.stop, 1000):
        hi = min(task.stop, lo + 1000)
        texts = ds.data.table.slice(lo, hi - lo).column(text_field).to_pylist()
        yield from _table_documents(texts, f"{task.files[0]}, rows {lo}-{hi - 1}", text_field)


def _text_documents(task: Task, text_field: str):
    for path in task.files:
        data = Path(path).read_bytes()
        if data:
            yield data


READERS = {"jsonl": _jsonl_documents, "parquet": _parquet_documents, "arrow": _arrow_documents,
           "text": _text_documents}


# --------------------------------------------------------------------------- the workers

_WORKER: dict = {}


def _init_worker(settings: dict) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one process per core already
    _WORKER["settings"] = _Settings(**settings)
    _WORKER["tokenizer"] = load_tokenizer(settings["tokenizer"])


def _encode(texts: list, tokenizer, dtype, eos_id) -> tuple[np.ndarray, np.ndarray]:
    """``(ids [total], lengths [docs])`` of documents, each followed by ``eos_id`` (if any)."""
    eos = b"" if eos_id is None else bytes([eos_id])
    if isinstance(tokenizer, ByteTokenizer):
        pieces = [t if isinstance(t, bytes) else t.encode("utf-8") for t in texts]
        lengths = np.fromiter((len(p) + len(eos) for p in pieces), dtype=np.int64, count=len(pieces))
        return np.frombuffer(eos.join(pieces) + eos, dtype=np.uint8), lengths
    texts = [t.decode("utf-8", errors="replace") if isinstance(t, bytes) else t for t in texts]
    fast = getattr(getattr(tokenizer, "_tok", None), "encode_batch_fast", None)
    if fast is not None and getattr(tokenizer, "_hf", None) is None:
        encoded = [e.ids for e in fast(texts, add_special_tokens=False)]
    else:
        encoded = tokenizer.encode_batch(texts)
    tail = [] if eos_id is None else [eos_id]
    lengths = np.fromiter((len(e) + len(tail) for e in encoded), dtype=np.int64, count=len(encoded))
    flat = itertools.chain.from_iterable(itertools.chain(e, tail) for e in encoded)
    return np.fromiter(flat, dtype=dtype, count=int(lengths.sum())), lengths


class _ShardWriter:
    """One split of one task: documents appended in batches, written with ``datasets``'
    ``ArrowWriter`` under a temporary name."""

    def __init__(self, path: Path, dtype: str):
        import datasets
        from datasets.arrow_writer import ArrowWriter

        self.path, self.tmp = path, path.with_name(path.name + ".tmp")
        self.features = datasets.Features({"input_ids": datasets.Sequence(datasets.Value(dtype))})
        self.writer = ArrowWriter(features=self.features, path=str(self.tmp), writer_batch_size=WRITER_BATCH_DOCS)
        self.documents = self.tokens = self.text_bytes = 0
        self.max_id = -1

    def write(self, ids: np.ndarray, lengths: np.ndarray, text_bytes: int) -> None:
        import pyarrow as pa

        if not len(lengths):
            return
        offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        column = pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(ids))
        self.writer.write_table(pa.table({"input_ids": column}))
        self.documents += len(lengths)
        self.tokens += len(ids)
        self.text_bytes += text_bytes
        if len(ids):
            self.max_id = max(self.max_id, int(ids.max()))

    def finish(self) -> dict:
        self.writer.finalize()
        self.writer.close()
        os.replace(self.tmp, self.path)
        return {"documents": self.documents, "tokens": self.tokens, "max_token_id": self.max_id,
                "text_bytes": self.text_bytes}


def _run_task(item: tuple[int, Task, str]) -> dict:
    """Tokenize one task into its train and val shards; returns its counts (also recorded in
    ``OUT/.prepare/done-NNNNN.json``)."""
    index, task, out = item
    settings, tokenizer = _WORKER["settings"], _WORKER["tokenizer"]
    period = max(2, round(1 / settings.val_fraction)) if settings.val_fraction > 0 else 0
    name = f"shard-{index:05d}.arrow"
    writers = {split: _ShardWriter(Path(out) / split / name, settings.dtype) for split in ("train", "val")}
    dtype = DTYPES[settings.dtype]
    batch, size, n = {"train": [], "val": []}, 0, 0

    def flush():
        nonlocal size
        for split, texts in batch.items():
            if texts:
                ids, lengths = _encode(texts, tokenizer, dtype, settings.eos_id)
                # UTF-8 bytes + 1 per document, as TextDataModule counts them for bits per byte
                text_bytes = len(ids) if isinstance(tokenizer, ByteTokenizer) else \
                    sum(len(t) if isinstance(t, bytes) else len(t.encode("utf-8")) for t in texts) + len(texts)
                writers[split].write(ids, lengths, text_bytes)
                texts.clear()
        size = 0

    for doc in READERS[task.kind](task, settings.text_field):
        held_out = period and n % period == period - 1
        batch["val" if held_out else "train"].append(doc)
        size += len(doc)
        n += 1
        if size >= ENCODE_BATCH_BYTES:
            flush()
    flush()
    record = {"task": index, "bytes": task.bytes,
              "train": {"file": f"train/{name}", **writers["train"].finish()},
              "val": {"file": f"val/{name}", **writers["val"].finish()}}
    done = Path(out) / ".prepare" / f"done-{index:05d}.json"
    done.with_suffix(".tmp").write_text(json.dumps(record))
    os.replace(done.with_suffix(".tmp"), done)
    return record


# --------------------------------------------------------------------------- the command


def _plan_record(files: list[Path], tasks: list[Task], settings: _Settings, identity: dict) -> dict:
    sources = []
    for path in files:
        stat = path.stat() if path.is_file() else None
        size = stat.st_size if stat else sum(f.stat().st_size for f in path.glob("*.arrow"))
        mtime = stat.st_mtime_ns if stat else max((f.stat().st_mtime_ns for f in path.glob("*.arrow")), default=0)
        sources.append({"path": str(path.resolve()), "bytes": size, "mtime_ns": mtime})
    return {"sources": sources, "tasks": [asdict(t) for t in tasks], "tokenizer": identity,
            "settings": asdict(settings)}


def _prepare_out(out: Path, plan: dict, overwrite: bool) -> set[int]:
    """Create ``out`` or check it: returns the tasks already done (resume)."""
    state = out / ".prepare"
    plan = json.loads(json.dumps(plan))  # as read back from plan.json (tuples become lists)
    if out.exists() and not out.is_dir():
        raise PrepareError(f"output {out} is a file; choose a directory")
    if out.is_dir() and any(out.iterdir()):
        ours = (out / MANIFEST).is_file() or state.is_dir()
        if overwrite and ours:
            shutil.rmtree(out)
        elif overwrite:
            raise PrepareError(f"output {out} is a non-empty directory that is not a prepared set: "
                               "--overwrite deletes only prepared sets; choose another directory")
        elif (out / MANIFEST).is_file():
            raise PrepareError(f"output {out} already holds a prepared set; pass --overwrite to replace it")
        elif not state.is_dir():
            raise PrepareError(f"output {out} is a non-empty directory that is not a prepared set; "
                               "choose another directory")
        else:
            previous = json.loads((state / "plan.json").read_text()) if (state / "plan.json").is_file() else None
            if previous != plan:
                raise PrepareError(f"output {out} holds an unfinished prepare of other sources or settings; "
                                   "rerun that command to finish it, or pass --overwrite to start again")
            for tmp in itertools.chain(out.glob("*/*.tmp"), state.glob("*.tmp")):
                tmp.unlink()
            done = set()
            for record in state.glob("done-*.json"):
                data = json.loads(record.read_text())
                if all((out / data[s]["file"]).is_file() for s in ("train", "val")):
                    done.add(int(data["task"]))
            return done
    for sub in ("train", "val", ".prepare"):
        (out / sub).mkdir(parents=True, exist_ok=True)
    (state / "plan.json").write_text(json.dumps(plan, indent=1))
    return set()


class _Progress:
    """A tqdm bar on a terminal, a plain line per finished shard otherwise."""

    def __init__(self, total_bytes: int, total_tasks: int, done_bytes: int, done_tasks: int):
        self.tty = sys.stderr.isatty()
        self.total_tasks, self.tasks, self.bytes, self.started = total_tasks, done_tasks, done_bytes, time.time()
        self.first = done_bytes
        if self.tty:
            from tqdm import tqdm

            self.bar = tqdm(total=total_bytes, initial=done_bytes, unit="B", unit_scale=True,
                            desc="prepare", file=sys.stderr)

    def update(self, nbytes: int) -> None:
        self.tasks += 1
        self.bytes += nbytes
        if self.tty:
            self.bar.update(nbytes)
            return
        rate = (self.bytes - self.first) / max(1e-9, time.time() - self.started)
        print(f"prepare: shard {self.tasks}/{self.total_tasks}, {self.bytes / 1e6:.1f} MB read, "
              f"{rate / 1e6:.1f} MB/s", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.tty:
            self.bar.close()


def prepare(sources: list[str | Path], out: str | Path, tokenizer: str | None = None, *,
            workers: int | None = None, shard_bytes: int = DEFAULT_SHARD_BYTES, val_fraction: float = 0.05,
            text_field: str = "text", vocab_size: int | None = None, overwrite: bool = False,
            progress: bool = True) -> dict:
    """Tokenize ``sources`` into the prepared set ``out`` (see the module docstring); returns the
    manifest. ``workers``: processes (default: all cores); ``vocab_size``: the model's, refuse a
    tokenizer that does not fit it.

    Raises:
        PrepareError (a ValueError): bad input (naming the file and line) or a refused ``out``.
    """
    if not 0 <= val_fraction <= 0.5:
        raise PrepareError(f"--val-fraction must be in [0, 0.5], got {val_fraction}")
    if shard_bytes < 1:
        raise PrepareError(f"shard size must be >= 1 byte, got {shard_bytes}")
    try:
        import datasets  # noqa: F401  (the shards' engine)
    except ImportError:
        raise ImportError("hybridzoo prepare writes Hugging Face datasets shards: pip install 'hybridzoo[data]' "
                          "(or pip install datasets)") from None
    out = Path(out).expanduser()
    tok = load_tokenizer(tokenizer)
    identity = tokenizer_identity(tok)
    if vocab_size is not None and tok.vocab_size > vocab_size:
        raise PrepareError(f"tokenizer {identity['name']!r} has {tok.vocab_size} ids, more than the model's "
                           f"vocab_size {vocab_size}: use a smaller tokenizer or a larger model.config.vocab_size")
    spec = None if isinstance(tok, ByteTokenizer) else str(Path(tokenizer).expanduser().resolve())
    settings = _Settings(tokenizer=spec, text_field=text_field, val_fraction=val_fraction,
                         dtype=token_dtype(tok.vocab_size), eos_id=tok.eos_id)
    files = source_files(sources)
    tasks = plan_tasks(files, shard_bytes)
    plan = _plan_record(files, tasks, settings, identity)
    done = _prepare_out(out, plan, overwrite)
    pending = [(i, t, str(out)) for i, t in enumerate(tasks) if i not in done]
    workers = max(1, min(workers or os.cpu_count() or 1, len(pending) or 1))
    bar = _Progress(sum(t.bytes for t in tasks), len(tasks), sum(tasks[i].bytes for i in done), len(done)) \
        if progress else None
    try:
        if workers == 1:
            _init_worker(asdict(settings))
            for item in pending:
                record = _run_task(item)
                bar and bar.update(record["bytes"])
        else:
            import multiprocessing

            with multiprocessing.get_context("fork" if sys.platform == "linux" else "spawn").Pool(workers, _init_worker, (asdict(settings),)) as pool:
                for record in pool.imap_unordered(_run_task, pending):
                    bar and bar.update(record["bytes"])
    except KeyboardInterrupt:
        raise PrepareError(f"interrupted: {out} is unfinished (no {MANIFEST}); rerun the same command "
                           "to resume it") from None
    finally:
        bar and bar.close()
    return _write_manifest(out, plan, tasks)


def _write_manifest(out: Path, plan: dict, tasks: list[Task]) -> dict:
    records = [json.loads((out / ".prepare" / f"done-{i:05d}.json").read_text()) for i in range(len(tasks))]
    splits = {}
    for split in ("train", "val"):
        shards = [dict(r[split], source=tasks[r["task"]].files[0] if len(tasks[r["task"]].files) == 1
                       else f"{len(tasks[r['task']].files)} text files") for r in records]
        splits[split] = {"documents": sum(s["documents"] for s in shards), "tokens": sum(s["tokens"] for s in shards),
                         "text_bytes": sum(s["text_bytes"] for s in shards), "shards": shards}
    settings = plan["settings"]
    import datasets

    manifest = {
        "format": FORMAT, "version": VERSION,
        "engine": {"name": "datasets", "version": datasets.__version__, "column": "input_ids",
                   "rows": "one per document (its ids, then eos_id)"},
        "tokenizer": plan["tokenizer"], "dtype": settings["dtype"], "eos_id": settings["eos_id"],
        "text_field": settings["text_field"], "val_fraction": settings["val_fraction"],
        "sources": plan["sources"], "source_bytes": sum(s["bytes"] for s in plan["sources"]),
        "max_token_id": max((r[s]["max_token_id"] for r in records for s in ("train", "val")), default=-1),
        "splits": splits,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    tmp = out / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1))
    os.replace(tmp, out / MANIFEST)
    shutil.rmtree(out / ".prepare", ignore_errors=True)
    return manifest


def prepare_command(args) -> int:
    """``hybridzoo prepare``: returns the exit status (2 on bad input, one error line)."""
    from hybridzoo.cli_errors import user_error_exit, user_errors

    try:
        manifest = prepare(args.src, args.out, args.tokenizer, workers=args.workers,
                           shard_bytes=int(args.shard_mb * 2**20), val_fraction=args.val_fraction,
                           text_field=args.text_field, vocab_size=args.vocab_size, overwrite=args.overwrite)
    except user_errors(ImportError) as error:
        return user_error_exit("prepare", error)
    train, val = manifest["splits"]["train"], manifest["splits"]["val"]
    print(f"prepared {args.out}: {train['documents']:,} documents / {train['tokens']:,} tokens to train, "
          f"{val['documents']:,} / {val['tokens']:,} held out, {len(train['shards'])} shards "
          f"({manifest['dtype']}, tokenizer {manifest['tokenizer']['name']})")
    print(f"train on it: hybridzoo fit --config RECIPE --data.prepared {args.out}")
    return 0
