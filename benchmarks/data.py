"""Pretraining data larger than memory: prepare speed, loader throughput and resident memory.

    python -m benchmarks data                      # a 20 GB corpus, and a 1 GB one to compare memory
    python -m benchmarks data --size 4 --compare-size 1 --tmp /data/tmp

For each size it generates a jsonl corpus in a temporary directory (deleted afterwards; never
committed), prepares it with ``hybridzoo prepare`` (byte tokenizer, all cores), deletes the
corpus, then streams the prepared set through ``TextDataModule(prepared=...)``'s training loader
(shuffled rows of ``--seq-len`` tokens, batches of ``--batch-size``) for ``--batches`` batches:

* from one process (``num_workers=0``, packed ``stream`` and ``documents`` rows): tokens/s;
* with ``--workers`` loader workers: tokens/s and the peak resident memory (VmRSS) of the main
  process and of its workers together, sampled every 50 ms.

Each measurement runs in a fresh (spawned) interpreter, as a training process would: its memory
is the loader's plus torch's and Lightning's, not what the benchmark allocated before.

It also measures ``prepare``'s speed with a Hugging Face BPE tokenizer: a byte-level BPE of
``--bpe-vocab`` ids trained locally with ``tokenizers`` on the corpus's first 16 MB (no
download), then used to prepare the first ``--bpe-mb`` MB of the corpus: MB/s per worker.

Targets (issue 58): resident memory at most 2 GB at 20 GB; loader at least 2M tokens/s from one
process; BPE prepare at least 5 MB/s per core. The record (JSON + markdown) goes to
``benchmarks/results/DATE-data.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
TARGETS = {"rss_gb": 2.0, "loader_tokens_per_s": 2e6, "bpe_mb_per_s_per_core": 5.0}


# --------------------------------------------------------------------------- the corpus


def _words(seed: int = 0) -> list[str]:
    """About 20k word-like tokens: the identifiers and words of some standard-library files."""
    import re
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    text = " ".join(p.read_text(errors="replace") for p in sorted(root.glob("*.py"))[:200])
    words = sorted(set(re.findall(r"[A-Za-z_]{2,14}", text)))
    return words or ["lorem", "ipsum"]


def generate_corpus(path: Path, size_bytes: int, seed: int = 0) -> int:
    """A jsonl file of about ``size_bytes``: documents of 200-8000 bytes of words drawn with
    Zipf-like frequencies (``p ~ 1 / (rank + 2.7)``, as in natural text) and some punctuation. A pool of 64 MB of unique documents is generated, then written repeatedly (each
    repetition with its own document numbers) until the size is reached. Returns the bytes."""
    rng = np.random.default_rng(seed)
    words = np.array(_words(), dtype=object)
    rng.shuffle(words)
    weights = 1.0 / (np.arange(len(words)) + 2.7)
    weights /= weights.sum()
    lines, pool_size = [], 0
    while pool_size < min(size_bytes, 64 << 20):
        n = int(rng.integers(30, 1200))
        picks = words[rng.choice(len(words), n, p=weights)]
        text = " ".join(picks)
        text = text.replace(" a", ". A").replace(" i", ",\ni")
        line = json.dumps({"text": text})[:-1]  # the id is appended per repetition
        lines.append(line)
        pool_size += len(line) + 20
    written = 0
    with open(path, "w") as f:
        rep = 0
        while written < size_bytes:
            block = "".join(f'{line}, "id": {rep * len(lines) + i}}}\n' for i, line in enumerate(lines))
            f.write(block)
            written += len(block)
            rep += 1
    return written


# --------------------------------------------------------------------------- memory


def _rss(pid: int, field: str = "VmRSS:", file: str = "status") -> int:
    """A memory figure of ``/proc/PID/<file>`` in bytes (0 once the process is gone)."""
    try:
        with open(f"/proc/{pid}/{file}") as f:
            for line in f:
                if line.startswith(field):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _pss(pid: int) -> int:
    """Proportional set size: shared pages (the forked workers share the parent's) counted once."""
    return _rss(pid, "Pss:", "smaps_rollup")


def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return found


class PeakRSS:
    """Samples the resident memory of this process and its children (loader workers) every 50 ms;
    ``peak`` is the largest sum of VmRSS seen (pages shared by the processes counted once per
    process), ``peak_pss`` the largest sum of PSS (shared pages counted once), ``peak_main`` this
    process's largest VmRSS."""

    def __init__(self):
        self.peak = self.peak_main = self.peak_pss = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        pid = os.getpid()
        while not self._stop.is_set():
            main, children = _rss(pid), _children(pid)
            total = main + sum(_rss(c) for c in children)
            pss = _pss(pid) + sum(_pss(c) for c in children)
            self.peak, self.peak_main = max(self.peak, total), max(self.peak_main, main)
            self.peak_pss = max(self.peak_pss, pss)
            self._stop.wait(0.05)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


# --------------------------------------------------------------------------- measurements


def stream(prepared: Path, batches: int, seq_len: int, batch_size: int, workers: int, packing: str) -> dict:
    """Tokens/s and peak RSS of ``batches`` training batches from the prepared set."""
    from hybridzoo.training.data import TextDataModule

    with PeakRSS() as rss:
        dm = TextDataModule(prepared=str(prepared), seq_len=seq_len, batch_size=batch_size,
                            num_workers=workers, packing=packing)
        started = time.perf_counter()
        dm.setup("fit")
        setup_s = time.perf_counter() - started
        loader = dm.train_dataloader()
        tokens, started = 0, time.perf_counter()
        for n, batch in enumerate(loader):
            tokens += batch["input_ids"].numel()
            if n + 1 >= batches:
                break
        seconds = time.perf_counter() - started
        rows = len(dm._train_set)
        del loader, dm
    return {"packing": packing, "workers": workers, "batches": batches, "tokens": tokens, "seconds": seconds,
            "tokens_per_s": tokens / seconds, "setup_s": setup_s, "train_rows": rows,
            "peak_rss_gb": rss.peak / 1e9, "peak_pss_gb": rss.peak_pss / 1e9,
            "peak_rss_main_gb": rss.peak_main / 1e9}


def _stream_child(queue, args: tuple) -> None:
    queue.put(stream(*args))


def stream_in_fresh_process(*args) -> dict:
    """:func:`stream` in a fresh interpreter (spawned), so that its memory is the loader's and the
    training process's imports only, not what this benchmark allocated before (the corpus
    generator, the BPE training)."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    child = ctx.Process(target=_stream_child, args=(queue, args))
    child.start()
    result = queue.get()
    child.join()
    return result


def prepare_speed(corpus: Path, work: Path, mb: int, vocab: int, workers: int) -> dict:
    """Train a byte-level BPE on the corpus's first 16 MB, then time ``prepare`` on its first
    ``mb`` MB with ``workers`` processes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    sample = work / "bpe-sample.jsonl"
    with open(corpus, "rb") as src, open(sample, "wb") as dst:
        data = src.read(mb << 20)
        dst.write(data[: data.rfind(b"\n") + 1])
    texts = []
    with open(sample) as f:
        size = 0
        for line in f:
            texts.append(json.loads(line)["text"])
            size += len(line)
            if size > 16 << 20:
                break
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    started = time.perf_counter()
    tokenizer.train_from_iterator(texts, trainer)
    train_s = time.perf_counter() - started
    (work / "bpe").mkdir()
    tokenizer.save(str(work / "bpe" / "tokenizer.json"))
    # the tokenizer alone, in this process: its CPU time per MB is the ceiling of prepare's speed
    cpu = time.process_time()
    tokenizer.encode_batch_fast(texts, add_special_tokens=False)
    alone = sum(len(t.encode("utf-8")) for t in texts) / 1e6 / (time.process_time() - cpu)
    from hybridzoo.training.prepare import prepare

    import resource

    started, cpu = time.perf_counter(), _cpu_seconds(resource)
    manifest = prepare([sample], work / "bpe-prepared", str(work / "bpe"), workers=workers, shard_bytes=16 << 20,
                       progress=False)
    seconds, cpu = time.perf_counter() - started, _cpu_seconds(resource) - cpu
    nbytes = sample.stat().st_size
    tokens = manifest["splits"]["train"]["tokens"] + manifest["splits"]["val"]["tokens"]
    shutil.rmtree(work / "bpe-prepared")
    sample.unlink()
    return {"bpe_vocab": vocab, "bpe_train_s": train_s, "bytes": nbytes, "tokens": tokens, "workers": workers,
            "seconds": seconds, "mb_per_s": nbytes / 1e6 / seconds,
            "mb_per_s_per_core": nbytes / 1e6 / seconds / workers, "cpu_seconds": cpu,
            "mb_per_cpu_second": nbytes / 1e6 / cpu, "tokenizer_alone_mb_per_cpu_second": alone,
            "bytes_per_token": nbytes / tokens, "load_average": os.getloadavg()}


def _cpu_seconds(resource) -> float:
    """User + system CPU time of this process and its finished children (the prepare workers)."""
    return sum(u.ru_utime + u.ru_stime for u in (resource.getrusage(resource.RUSAGE_SELF),
                                                 resource.getrusage(resource.RUSAGE_CHILDREN)))


def run_size(size_gb: float, tmp: Path, args) -> dict:
    from hybridzoo.training.prepare import prepare

    work = Path(tempfile.mkdtemp(prefix="hybridzoo-data-bench-", dir=tmp))
    try:
        corpus = work / "corpus.jsonl"
        started = time.perf_counter()
        corpus_bytes = generate_corpus(corpus, int(size_gb * 1e9))
        row = {"size_gb": corpus_bytes / 1e9, "generate_s": time.perf_counter() - started}
        log(f"{size_gb} GB: corpus written ({row['generate_s']:.0f} s)")
        if args.bpe_mb:
            row["bpe_prepare"] = prepare_speed(corpus, work, args.bpe_mb, args.bpe_vocab, args.prepare_workers)
            bpe = row["bpe_prepare"]
            log(f"{size_gb} GB: BPE prepare {bpe['mb_per_s_per_core']:.2f} MB/s per core (wall), "
                f"{bpe['mb_per_cpu_second']:.2f} MB per CPU second (the tokenizer alone: "
                f"{bpe['tokenizer_alone_mb_per_cpu_second']:.2f})")
        started = time.perf_counter()
        manifest = prepare([corpus], work / "prepared", None, workers=args.prepare_workers, progress=False)
        seconds = time.perf_counter() - started
        row["byte_prepare"] = {"seconds": seconds, "mb_per_s": corpus_bytes / 1e6 / seconds,
                               "workers": args.prepare_workers,
                               "train_tokens": manifest["splits"]["train"]["tokens"],
                               "documents": manifest["splits"]["train"]["documents"],
                               "shards": len(manifest["splits"]["train"]["shards"]),
                               "prepared_gb": sum(f.stat().st_size for f in (work / "prepared").rglob("*")) / 1e9}
        log(f"{size_gb} GB: byte prepare {row['byte_prepare']['mb_per_s']:.0f} MB/s")
        corpus.unlink()
        row["stream"] = []
        for packing, workers in (("stream", 0), ("documents", 0), ("stream", args.workers)):
            result = stream_in_fresh_process(work / "prepared", args.batches, args.seq_len, args.batch_size,
                                             workers, packing)
            row["stream"].append(result)
            log(f"{size_gb} GB: {packing} rows, {workers} workers: {result['tokens_per_s'] / 1e6:.2f}M tokens/s, "
                f"peak RSS {result['peak_rss_gb']:.2f} GB (PSS {result['peak_pss_gb']:.2f} GB)")
        return row
    finally:
        shutil.rmtree(work, ignore_errors=True)


def log(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)


def markdown(record: dict) -> str:
    lines = [f"# Pretraining data larger than memory ({record['date']})", "",
             f"commit {record['commit']}{' (dirty)' if record.get('dirty') else ''}; {record['machine']}; "
             f"versions: {', '.join(f'{k} {v}' for k, v in record['versions'].items() if v)}", "",
             f"Command: `{record['command']}`", "",
             "| corpus | byte prepare | BPE prepare / core (wall) | loader 1 proc (stream) | loader 1 proc (documents) "
             f"| loader {record['args']['workers']} workers | peak RSS (main + workers) | peak PSS |",
             "|---|---|---|---|---|---|---|---|"]
    for row in record["rows"]:
        s = {(r["packing"], r["workers"]): r for r in row["stream"]}
        one, doc = s[("stream", 0)], s[("documents", 0)]
        many = s[("stream", record["args"]["workers"])]
        bpe = row.get("bpe_prepare")
        lines.append(
            f"| {row['size_gb']:.2f} GB | {row['byte_prepare']['mb_per_s']:.0f} MB/s "
            f"| {bpe['mb_per_s_per_core']:.1f} MB/s ({bpe['mb_per_cpu_second']:.1f} per CPU s) | " if bpe else
            f"| {row['size_gb']:.2f} GB | {row['byte_prepare']['mb_per_s']:.0f} MB/s | - | ")
        lines[-1] += (f"{one['tokens_per_s'] / 1e6:.1f}M tok/s | {doc['tokens_per_s'] / 1e6:.1f}M tok/s "
                      f"| {many['tokens_per_s'] / 1e6:.1f}M tok/s "
                      f"| {max(r['peak_rss_gb'] for r in row['stream']):.2f} GB "
                      f"| {max(r['peak_pss_gb'] for r in row['stream']):.2f} GB |")
    bpe = next((r["bpe_prepare"] for r in record["rows"] if "bpe_prepare" in r), None)
    if bpe:
        lines += ["", f"BPE prepare: {bpe['bytes'] / 1e6:.0f} MB with a {bpe['bpe_vocab']}-id byte-level BPE "
                      f"({bpe['bytes_per_token']:.2f} bytes/token), {bpe['workers']} workers: "
                      f"{bpe['mb_per_s']:.2f} MB/s wall, {bpe['mb_per_cpu_second']:.2f} MB per CPU second of the "
                      f"prepare processes; the tokenizer alone (encode_batch_fast, one process): "
                      f"{bpe['tokenizer_alone_mb_per_cpu_second']:.2f} MB per CPU second. Load average during "
                      f"the run: {record['load_average_start'][0]:.1f} at the start, "
                      f"{bpe['load_average'][0]:.1f} after the BPE prepare (other jobs shared the 2 cores)."]
    lines += ["", "Targets: " + "; ".join(f"{k}: {'met' if v else 'NOT met'}" for k, v in record["targets_met"].items()),
              "", record.get("note", "")]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks data", description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=float, default=20.0, help="corpus size in GB (default 20)")
    parser.add_argument("--compare-size", type=float, default=1.0,
                        help="a second, smaller corpus (GB) to show that memory does not grow (0: none)")
    parser.add_argument("--tmp", default=tempfile.gettempdir(), help="where the corpus is generated")
    parser.add_argument("--batches", type=int, default=3000, help="training batches streamed per measurement")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--workers", type=int, default=2, help="loader workers of the memory measurement")
    parser.add_argument("--prepare-workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--bpe-mb", type=int, default=256, help="MB of corpus prepared with the BPE (0: skip)")
    parser.add_argument("--bpe-vocab", type=int, default=8192)
    parser.add_argument("--out", default=None, help="record path without suffix (default benchmarks/results/DATE-data)")
    args = parser.parse_args(argv)

    from benchmarks.meta import run_metadata, write_json

    meta = run_metadata(peers=("datasets", "pyarrow", "tokenizers", "numpy"))
    out = Path(args.out) if args.out else HERE / "results" / f"{time.strftime('%Y-%m-%d')}-data"
    mem_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    record = {**meta, "machine": f"{os.cpu_count()} cores / {mem_gb:.0f} GB RAM, CPU only",
              "command": "python -m benchmarks data " + " ".join(argv if argv is not None else sys.argv[1:]),
              "args": vars(args), "targets": TARGETS, "rows": [],
              "load_average_start": os.getloadavg()}
    sizes = [args.size] + ([args.compare_size] if args.compare_size else [])
    for size in sizes:
        record["rows"].append(run_size(size, Path(args.tmp), args))
        record["load_average_end"] = os.getloadavg()
        big = record["rows"][0]
        bpe = next((r["bpe_prepare"] for r in record["rows"] if "bpe_prepare" in r), None)
        record["targets_met"] = {
            "rss <= 2 GB": max(r["peak_rss_gb"] for r in big["stream"]) <= TARGETS["rss_gb"],
            "loader >= 2M tokens/s (1 process)": min(r["tokens_per_s"] for r in big["stream"] if r["workers"] == 0)
            >= TARGETS["loader_tokens_per_s"],
            "BPE prepare >= 5 MB/s per core (wall)": bool(bpe)
            and bpe["mb_per_s_per_core"] >= TARGETS["bpe_mb_per_s_per_core"],
            "BPE prepare >= 5 MB per CPU second": bool(bpe)
            and bpe["mb_per_cpu_second"] >= TARGETS["bpe_mb_per_s_per_core"],
        }
        write_json(out.with_suffix(".json"), record)
        out.with_suffix(".md").write_text(markdown(record))
        args.bpe_mb = 0  # the BPE speed is measured once
    log(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.md')}")
    return 0
