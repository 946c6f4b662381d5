"""The ``hybridzoo`` command line.

Subcommands so far: ``demo`` (run the reference kernels and print a report). ``fit``,
``validate``, ``test``, ``generate``, ``eval``, ``convert`` and ``recipes`` arrive with the
model and training issues.
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hybridzoo", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run every reference kernel against its step loop and print a report")
    demo.add_argument("--seq-len", type=int, default=256, help="tokens per sequence (default 256)")
    args = parser.parse_args(argv)
    if args.command == "demo":
        from hybridzoo.demo import main as demo_main

        return demo_main(seq_len=args.seq_len)
    parser.error(f"unknown command {args.command!r}")  # pragma: no cover
    return 2


if __name__ == "__main__":
    sys.exit(main())
