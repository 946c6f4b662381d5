"""The command line of ``hybridzoo prepare`` (kept apart so that ``hybridzoo --help`` imports
nothing heavy); the work is in :mod:`hybridzoo.training.prepare`."""

from __future__ import annotations

import argparse

DEFAULT_SHARD_BYTES = 64 << 20


def add_prepare_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``hybridzoo prepare`` (see :mod:`hybridzoo.training.prepare`)."""
    parser.add_argument("src", nargs="+", help="text / jsonl / parquet files, folders of them, or a saved "
                                               "Hugging Face dataset (save_to_disk)")
    parser.add_argument("out", help="the prepared set's directory (then: hybridzoo fit --data.prepared OUT)")
    parser.add_argument("--tokenizer", default=None, metavar="DIR",
                        help="a local Hugging Face tokenizer directory or tokenizer.json (default: UTF-8 bytes)")
    parser.add_argument("--workers", type=int, default=None, help="processes (default: all cores)")
    parser.add_argument("--shard-mb", type=float, default=DEFAULT_SHARD_BYTES / 2**20,
                        help="input per shard, MiB (default 64)")
    parser.add_argument("--val-fraction", type=float, default=0.05,
                        help="share of documents held out for validation (default 0.05)")
    parser.add_argument("--text-field", default="text", help="the jsonl field / column holding the text")
    parser.add_argument("--vocab-size", type=int, default=None,
                        help="the model's vocab_size: refuse a tokenizer with more ids")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing prepared set in OUT")
