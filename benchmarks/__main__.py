"""``python -m benchmarks <name> [args]``: run the benchmark module ``benchmarks/<name>.py``.

Any module of this package that defines ``main(argv)`` is a command; its docstring's first line
is its description in ``--help``. ``python -m benchmarks <name> --help`` shows its options.
"""

from __future__ import annotations

import ast
import importlib
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
NOT_COMMANDS = {"__init__", "__main__", "meta"}


def commands() -> dict[str, str]:
    """``{name: first docstring line}`` of every module here with a top-level ``main`` function,
    read without importing it (a benchmark's imports can be heavy or need a GPU)."""
    found = {}
    for path in sorted(HERE.glob("*.py")):
        if path.stem in NOT_COMMANDS:
            continue
        tree = ast.parse(path.read_text())
        if any(isinstance(node, ast.FunctionDef) and node.name == "main" for node in tree.body):
            found[path.stem] = ((ast.get_docstring(tree) or "").strip().splitlines() or [""])[0]
    return found


def usage(names: dict[str, str]) -> str:
    width = max((len(n) for n in names), default=0)
    lines = ["usage: python -m benchmarks <name> [args]   (python -m benchmarks <name> --help for its options)",
             "", "benchmarks:"]
    lines += [f"  {name:{width}s}  {text}" for name, text in names.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    names = commands()
    if not argv or argv[0] in ("-h", "--help"):
        print(usage(names))
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in names:
        print(f"python -m benchmarks: no benchmark named {name!r}; choose one of: {', '.join(names)}",
              file=sys.stderr)
        return 2
    return int(importlib.import_module(f"benchmarks.{name}").main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
