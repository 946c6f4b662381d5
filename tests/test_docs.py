"""Every command and Python snippet in README.md and docs/*.md stays runnable.

Conventions for the documents:

* A fenced ```python block is executed (all blocks in one subprocess, each in a fresh namespace,
  in a temporary directory that holds an untrained ``tiny-hybrid`` export at
  ``runs/tiny-hybrid/export``, the main command's, and at ``runs/quickstart/export``, the
  quickstart's) unless the line before its fence is ``<!-- no-run: REASON -->``
  (the reason is required: a bare marker fails).
* A fenced ```bash block is executed command by command in that directory (the repository's
  ``benchmarks/`` and ``scripts/`` linked in) unless it carries the same marker. Every command,
  executed or not, is checked: ``hybridzoo <sub>`` names a subcommand and only its flags,
  ``hybridzoo fit`` only recipes and dotted flags that ``--print_config`` knows,
  ``python -m benchmarks <name>`` a benchmark module and only its flags, ``python scripts/X.py`` a
  file that exists and flags it defines.
* ```yaml blocks parse. Relative links and backticked repository paths (``benchmarks/results/...``,
  ``scripts/...``, ...) point at files that exist.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
NO_RUN = re.compile(r"<!-- no-run: (\S.*?) -->")
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
# written on other branches; until they are merged, links to them and their commands may dangle
REPO_PATH = re.compile(r"`((?:benchmarks|docs|scripts|tests|hybridzoo)/[^`\s]*)`")


def blocks(lang: str) -> list[tuple[str, int, str, str | None]]:
    """``(document, line, code, no-run reason or None)`` of every ``lang`` block."""
    found = []
    for path in DOCS:
        text = path.read_text()
        for match in FENCE.finditer(text):
            if match.group(1) != lang:
                continue
            before = text[: match.start()].rstrip().splitlines()
            marker = NO_RUN.fullmatch(before[-1].strip()) if before else None
            line = text[: match.start()].count("\n") + 1
            found.append((str(path.relative_to(ROOT)), line, match.group(2), marker.group(1) if marker else None))
    return found


def commands(code: str) -> list[list[str]]:
    """The commands of a bash block: continuations joined, comments dropped, split at ``&&``."""
    result = []
    for line in code.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        while words:
            cut = words.index("&&") if "&&" in words else len(words)
            result.append(words[:cut])
            words = words[cut + 1:]
    return result


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """The documents' working directory: the repository's benchmarks/, scripts/, tests/ (the
    shipped lm-eval tasks) and hybridzoo/ (a data file the docs use) linked in (the driver adds an
    untrained tiny-hybrid export where the quickstart expects one)."""
    work = tmp_path_factory.mktemp("docs")
    for name in ("benchmarks", "scripts", "tests", "hybridzoo"):
        (work / name).symlink_to(ROOT / name)
    return work


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
                OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")


# ---- markers ---------------------------------------------------------------------------------------
def test_every_skipped_block_gives_a_reason():
    for path in DOCS:
        for line in path.read_text().splitlines():
            if "no-run" in line:
                assert NO_RUN.fullmatch(line.strip()), f"{path.name}: write `<!-- no-run: REASON -->`, got {line!r}"
    runnable = [b for lang in ("python", "bash") for b in blocks(lang) if b[3] is None]
    assert len(runnable) >= 8, "most snippets must run; mark only what needs a GPU, a download or minutes"


# ---- running the documents ------------------------------------------------------------------------
# One process runs every runnable Python block (each in a fresh namespace), then every runnable
# bash command in document order, then ``hybridzoo fit --print_config`` (for test_fit_flags_exist).
# A command runs in that process through the entry point its shell form names: ``hybridzoo ARGS``
# is the console script's ``hybridzoo.cli:main(ARGS)``, ``python -m MODULE ARGS`` is
# ``runpy.run_module(MODULE)`` with ``sys.argv`` set, as ``python -m`` does; anything else runs as a
# subprocess. torch, Lightning and lm-eval are then imported once, not once per command.
DRIVER = textwrap.dedent("""
    import contextlib, io, json, runpy, subprocess, sys, traceback
    from hybridzoo import HybridLM
    HybridLM.from_recipe("tiny-hybrid").save_pretrained("runs/tiny-hybrid/export")
    HybridLM.from_recipe("tiny-hybrid").save_pretrained("runs/quickstart/export")

    def run_block(doc, line, code):
        try:
            exec(compile(code, f"{doc}:{line}", "exec"), {"__name__": "__main__"})
        except BaseException:
            return f"{doc}, block at line {line}:\\n" + traceback.format_exc()

    def run_command(cmd):
        out, err, code, argv = io.StringIO(), io.StringIO(), 0, sys.argv
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                if cmd[0] == "hybridzoo":
                    from hybridzoo.cli import main
                    code = main(cmd[1:]) or 0
                elif cmd[:2] == ["python", "-m"]:
                    sys.argv = [cmd[2], *cmd[3:]]
                    runpy.run_module(cmd[2], run_name="__main__", alter_sys=True)
                else:
                    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
                    code = done.returncode
                    out.write(done.stdout), err.write(done.stderr)
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        except BaseException:
            code = 1
            err.write(traceback.format_exc())
        finally:
            sys.argv = argv
        return {"returncode": code, "stdout": out.getvalue(), "stderr": err.getvalue()}

    todo = json.load(sys.stdin)
    blocks = [run_block(*b) for b in todo["python"]]
    commands = [run_command(c) for c in todo["commands"]]
    print("RESULTS " + json.dumps({"python": blocks, "commands": commands}))
""")
PRINT_CONFIG = ["hybridzoo", "fit", "--config", "tiny-hybrid", "--print_config"]


@pytest.fixture(scope="module")
def documents_run(workdir) -> dict:
    """``{"python": [failure or None per runnable block], "commands": {command: result}}`` from
    one driver process in ``workdir`` (see DRIVER)."""
    python = [(doc, line, code) for doc, line, code, reason in blocks("python") if reason is None]
    commands_ = [cmd for _, _, code, reason in blocks("bash") if reason is None for cmd in commands(code)]
    commands_ = list(dict.fromkeys(map(tuple, commands_ + [PRINT_CONFIG])))
    done = subprocess.run([sys.executable, "-c", DRIVER], input=json.dumps({"python": python, "commands": commands_}),
                          capture_output=True, text=True, cwd=workdir, env=_env(), timeout=1200)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULTS ")]
    assert lines, done.stdout[-2000:] + done.stderr[-4000:]
    results = json.loads(lines[-1][len("RESULTS "):])
    return {"python": results["python"], "commands": dict(zip(commands_, results["commands"]))}


def test_python_blocks_run(documents_run):
    assert documents_run["python"]
    failures = [f for f in documents_run["python"] if f]
    assert not failures, "\n\n".join(failures)


def test_yaml_blocks_parse():
    for doc, line, code, _ in blocks("yaml"):
        assert isinstance(yaml.safe_load(code), dict), f"{doc}:{line}"


# ---- bash ------------------------------------------------------------------------------------------
def _help(main, argv: list[str]) -> str:
    """What ``main(argv + ['--help'])`` prints (argparse exits after printing it)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        main([*argv, "--help"])
    return out.getvalue()


def _flags(words: list[str]) -> list[str]:
    return [w.split("=", 1)[0] for w in words if w.startswith("--")]


def _all_commands() -> list[tuple[str, int, list[str]]]:
    return [(doc, line, cmd) for doc, line, code, _ in blocks("bash") for cmd in commands(code)]


def test_bash_commands_name_real_subcommands_flags_and_files():
    from benchmarks.__main__ import commands as benchmark_commands
    from hybridzoo.cli import main as hybridzoo_main
    from hybridzoo.zoo.recipes import recipe_names

    benchmarks = benchmark_commands()
    for doc, line, cmd in _all_commands():
        where = f"{doc}:{line}: {' '.join(cmd)}"
        if cmd[:1] == ["hybridzoo"]:
            sub = cmd[1]
            if sub in ("fit", "validate", "test"):
                for i, word in enumerate(cmd):
                    if word == "--config":
                        value = cmd[i + 1]
                        assert value in recipe_names() or (ROOT / value).is_file(), where
                continue  # dotted flags: test_fit_flags_exist
            text = _help(hybridzoo_main, [sub])
            for flag in _flags(cmd[2:]):
                assert flag in text, f"{where}: `hybridzoo {sub}` has no {flag}"
        elif cmd[:3] == ["python", "-m", "benchmarks"]:
            if len(cmd) == 4 and cmd[3] == "--help":
                continue
            name = cmd[3]
            assert name in benchmarks, f"{where}: no benchmarks/{name}.py"
            import importlib

            text = _help(importlib.import_module(f"benchmarks.{name}").main, [])
            for flag in _flags(cmd[4:]):
                assert flag in text, f"{where}: `python -m benchmarks {name}` has no {flag}"
        elif cmd[:1] == ["python"] and cmd[1].startswith("scripts/"):
            script = ROOT / cmd[1]
            assert script.is_file(), where
            source = script.read_text()
            for flag in _flags(cmd[2:]):
                assert f'"{flag}"' in source, f"{where}: {cmd[1]} defines no {flag}"
        elif cmd[:1] == ["bash"] and cmd[1].startswith("scripts/"):
            assert (ROOT / cmd[1]).is_file(), where
        elif cmd[:3] == ["python", "-m", "hybridzoo.eval_harness"]:
            # lm_eval's own command line with the model registered: its flags are lm_eval's,
            # and the block is run by test_bash_blocks_run
            assert (ROOT / "hybridzoo" / "eval_harness.py").is_file(), where
            assert "--model" in cmd and cmd[cmd.index("--model") + 1] == "hybridzoo", where
        else:
            known = cmd[:3] in (["python3", "-m", "venv"], ["python", "-m", "pytest"]) or cmd[0] in (".", "pip")
            assert known, f"{where}: a command form tests/test_docs.py does not check; teach it or mark the block"


def test_fit_flags_exist(documents_run):
    """Every dotted flag of every ``hybridzoo fit`` in the documents is a key of the recipe's
    resolved configuration (``hybridzoo fit --print_config``)."""
    flags = {flag for _, _, cmd in _all_commands() if cmd[:2] == ["hybridzoo", "fit"]
             for flag in _flags(cmd[2:]) if "." in flag}
    assert flags
    done = documents_run["commands"][tuple(PRINT_CONFIG)]
    assert done["returncode"] == 0, done["stderr"][-3000:]
    config = yaml.safe_load(done["stdout"])
    for flag in sorted(flags):
        node = config
        for key in flag[2:].split("."):
            assert isinstance(node, dict) and key in node, f"hybridzoo fit: no configuration key {flag}"
            node = node[key]


def test_bash_blocks_run(documents_run):
    ran = 0
    for doc, line, code, reason in blocks("bash"):
        if reason is not None:
            continue
        for cmd in commands(code):
            done = documents_run["commands"][tuple(cmd)]
            assert done["returncode"] == 0, f"{doc}:{line}: {' '.join(cmd)}\n{done['stdout'][-2000:]}\n{done['stderr'][-3000:]}"
            ran += 1
    assert ran >= 5


# ---- links and paths -------------------------------------------------------------------------------
def _expand(path: str) -> list[str]:
    match = re.search(r"\{([^}]*)\}", path)
    if not match:
        return [path]
    return [p for part in match.group(1).split(",") for p in _expand(path[: match.start()] + part + path[match.end():])]


def test_links_and_cited_paths_exist():
    for path in DOCS:
        text = path.read_text()
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+://", target) or target.startswith("#"):
                continue
            file = (path.parent / target.split("#", 1)[0]).resolve()
            rel = file.relative_to(ROOT).as_posix() if file.is_relative_to(ROOT) else str(file)
            assert file.exists(), f"{path.name}: broken link {target}"
        for cited in REPO_PATH.findall(text):
            if any(mark in cited for mark in ("<", "*", "...", "$")):
                continue
            for one in _expand(cited):
                assert (ROOT / one).exists(), f"{path.name}: `{cited}` does not exist"


# ---- published figures -----------------------------------------------------------------------------
# A README table that publishes figures ends in a ``source`` column of links into benchmarks/results/
# (several where a row's cells come from several files). Every figure in the row's other cells
# (a number outside backticks, outside the ``GPU, commit`` column) must be held by one of the row's
# files: the same digits as text, or a number there that rounds to it (a JSON's 148364.27 holds the
# README's 148,364; its 0.8612 holds 0.86; a byte count holds its GiB).
RESULTS = ROOT / "benchmarks" / "results"
FIGURE = re.compile(r"(?<![\w.])(\d{1,3}(?:,\d{3})+|\d+(?:\.\d+)?)(?![\w.])|(?<![\w.])(\d+(?:\.\d+)?)(?=x|%|s\b|ms\b)")
NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")


def figures(cell: str) -> list[str]:
    """The figures of one table cell: numbers outside backticks (``gla-340m``, a shape such as
    ``B2`` or a hash such as ``c8f52cf`` are not figures), commas dropped."""
    text = re.sub(r"`[^`]*`", " ", cell)
    return [(a or b).replace(",", "") for a, b in FIGURE.findall(text)]


def holds(text: str, figure: str) -> bool:
    """Whether a results file's ``text`` holds ``figure`` (see above)."""
    if re.search(rf"(?<![\d.]){re.escape(figure)}(?!\d)", text.replace(",", "")):
        return True
    decimals = len(figure.split(".")[1]) if "." in figure else 0
    target = float(figure)
    values = [float(n) for n in NUMBER.findall(text)]
    values += [v / 2 ** 30 for v in values if v >= 2 ** 20]  # peak_bytes read as GiB
    return any(abs(round(v, decimals) - target) < 10 ** -(decimals + 3) for v in values)


def published_rows(text: str) -> list[tuple[int, list[str], list[str]]]:
    """``(line, [figures], [cited results files])`` of every table row that ends in a source column."""
    rows, header = [], None
    for number, line in enumerate(text.splitlines(), 1):
        if not line.startswith("|"):
            header = None
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if header is None:
            header = [c.lower() for c in cells]
            continue
        if set(line) <= set("|-: ") or header[-1] != "source":
            continue
        sources = re.findall(r"\]\((benchmarks/results/[^)#\s]+)\)", cells[-1])
        skip = {i for i, name in enumerate(header) if name in ("gpu, commit", "source")}
        found = [f for i, cell in enumerate(cells) if i not in skip for f in figures(cell)]
        rows.append((number, found, sources))
    return rows


def missing_figures(text: str) -> list[str]:
    """Each problem of ``text``'s published rows: a row with no source, a source that does not
    exist, a figure none of the row's sources holds."""
    problems = []
    for line, found, sources in published_rows(text):
        if not sources:
            problems.append(f"line {line}: no benchmarks/results/ file in its source column")
        texts = []
        for source in sources:
            if not (ROOT / source).is_file():
                problems.append(f"line {line}: {source} does not exist")
            else:
                texts.append((ROOT / source).read_text())
        for figure in found:
            if texts and not any(holds(t, figure) for t in texts):
                problems.append(f"line {line}: {figure} is in none of {sources}")
    return problems


def test_figure_check_fails_on_a_figure_its_file_does_not_hold():
    source = "benchmarks/results/2026-12-05-kernels-h100-c8f52cf.md"
    table = ("| op | ours | ours / anchor | GPU, commit | source |\n|---|---|---|---|---|\n"
             f"| `chunk_delta_rule` | {{}} | 2.09x | H100, 14f973d | [md]({source}) |\n")
    assert figures("`mamba2-130m` B2 T16384 1.65 (1.55–1.77) 148,364 0.86x") == ["1.65", "1.55", "1.77", "148364", "0.86"]
    assert missing_figures(table.format("8.55")) == []
    assert missing_figures(table.format("8.57")) == [f"line 3: 8.57 is in none of ['{source}']"]
    assert missing_figures(table.replace(source, "benchmarks/results/nothing.md").format("8.55"))[0].endswith("does not exist")
    assert holds('{"tokens_per_s": 148364.27}', "148364") and not holds('{"tokens_per_s": 148365.7}', "148364")
    assert holds('{"peak_bytes": 19907378176}', "18.5") and not holds('{"peak_bytes": 19907378176}', "18.6")


def test_readme_figures_are_held_by_their_results_files():
    readme = (ROOT / "README.md").read_text()
    rows = published_rows(readme)
    assert len(rows) >= 15, "the README's results tables end in a source column"
    problems = missing_figures(readme)
    assert not problems, "\n".join(problems)


def test_results_index_lists_every_results_file_the_documents_cite():
    """benchmarks/results/README.md names every results file that README.md (in its tables' source
    columns or in backticks) or a docs/ page cites, and links only to files that exist."""
    index = (RESULTS / "README.md").read_text()
    cited = {s for _, _, sources in published_rows((ROOT / "README.md").read_text()) for s in sources}
    for path in DOCS:
        cited.update(one for c in REPO_PATH.findall(path.read_text()) if c.startswith("benchmarks/results/")
                     and not any(mark in c for mark in ("<", "*", "...", "$")) for one in _expand(c))
    assert len(cited) >= 15
    missing = sorted(s for s in cited if (ROOT / s).is_file() and Path(s).name not in index)
    assert not missing, f"benchmarks/results/README.md does not list {missing}"
    for target in re.findall(r"\]\(([^)#\s]+)\)", index):
        if not re.match(r"[a-z]+://", target):
            assert (RESULTS / target).exists(), f"benchmarks/results/README.md: broken link {target}"
