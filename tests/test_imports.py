"""The import graph of hybridzoo's own modules has no cycle.

Every ``import`` / ``from ... import`` of a hybridzoo module counts, at module level or inside a
function (a lazy import hides a cycle from the interpreter, not from the reader), except those
under ``if TYPE_CHECKING:``. ``from a.b import c`` is an edge to ``a.b.c`` when that is a module,
else to ``a.b``; importing a submodule is not counted as depending on its parent package.

The same graph collapsed to hybridzoo's top-level subpackages (``kernels``, ``parallel``, ``layers``,
...) has no cycle either, and the five layers of the design import one way only:
``kernels`` <- ``parallel`` <- ``layers`` <- ``zoo`` <- ``training`` (docs: /DESIGN.md).
"""

from __future__ import annotations

import ast
from pathlib import Path

import hybridzoo

PACKAGE = Path(hybridzoo.__file__).parent


def module_files(package: Path = PACKAGE) -> dict[str, Path]:
    """``{"hybridzoo.zoo.model": path, "hybridzoo.zoo": path/__init__.py, ...}``."""
    out = {}
    for path in package.rglob("*.py"):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _is_type_checking(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


def _imports(tree: ast.AST):
    """Import nodes of ``tree``, anywhere but under ``if TYPE_CHECKING:``."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(child for child in ast.iter_child_nodes(node) if not _is_type_checking(child))


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """``{module: the hybridzoo modules it imports}`` (see the module docstring)."""
    def owner(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = set()
        for node in _imports(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                edges.update(owner(alias.name) for alias in node.names)
                continue
            base = node.module or ""
            if node.level:  # relative import
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                edges.add(full if full in modules else owner(base))
        edges.discard(None)
        edges.discard(name)
        graph[name] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(component)
    return found


def test_cycle_finder_finds_planted_cycles():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"} - {"e"}}
    assert cycles(graph) == [{"a", "b", "c"}]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_graph_counts_lazy_relative_and_type_checking_imports(tmp_path):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "sub" / "a.py").write_text("def f():\n    from pkg.sub import b\n")
    (package / "sub" / "b.py").write_text("from . import c\n")
    (package / "sub" / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.sub.a import f\n"
        "import pkg.sub.a as x\n")
    graph = import_graph(module_files(package))
    assert graph["pkg.sub.a"] == {"pkg.sub.b"}
    assert graph["pkg.sub.b"] == {"pkg.sub.c"}
    assert graph["pkg.sub.c"] == {"pkg.sub.a"}
    assert cycles(graph) == [{"pkg.sub.a", "pkg.sub.b", "pkg.sub.c"}]


def test_hybridzoo_has_no_import_cycle():
    found = [sorted(c) for c in cycles(import_graph(module_files()))]
    assert not found, f"import cycles among hybridzoo's modules: {found}"


#: the design's dependency direction: a folder may import only folders to its left
DIRECTION = ("kernels", "parallel", "layers", "zoo", "training")


def folder_graph(graph: dict[str, set[str]]) -> dict[str, dict[str, set[tuple[str, str]]]]:
    """``{folder: {folder it imports: {(module, imported module), ...}}}`` for the top-level
    subpackages and modules of the package (``hybridzoo.layers.conv`` -> ``layers``); imports
    within one folder and of the package root are left out."""
    def folder(name: str) -> str | None:
        parts = name.split(".")
        return parts[1] if len(parts) > 1 else None

    out: dict[str, dict[str, set[tuple[str, str]]]] = {}
    for module, edges in graph.items():
        for target in edges:
            a, b = folder(module), folder(target)
            if a and b and a != b:
                out.setdefault(a, {}).setdefault(b, set()).add((module, target))
    return out


def folder_problems(graph: dict[str, set[str]]) -> list[str]:
    """Every folder cycle (each pair importing each other both ways named with its imports) and
    every import against :data:`DIRECTION`."""
    folders = folder_graph(graph)
    problems = []
    for component in cycles({a: set(b) for a, b in folders.items()}):
        pairs = [f"{a} -> {b} ({sorted(folders[a][b])[:3]})" for a in sorted(component)
                 for b in sorted(folders.get(a, {})) if b in component]
        problems.append("folder cycle: " + "; ".join(pairs))
    for a, targets in folders.items():
        for b, why in targets.items():
            if a in DIRECTION and b in DIRECTION and DIRECTION.index(b) > DIRECTION.index(a):
                problems.append(f"{a} imports {b} against the direction {' <- '.join(DIRECTION)}: {sorted(why)[:3]}")
    return problems


def test_folder_check_finds_planted_loops(tmp_path):
    """The folder check fails on the loop this package once had: a layer consulting
    ``parallel.context`` while a lazy import in ``parallel`` reads the layers' state types."""
    package = tmp_path / "pkg"
    for sub in ("parallel", "layers", "zoo"):
        (package / sub).mkdir(parents=True)
        (package / sub / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "parallel" / "context.py").write_text("")
    (package / "parallel" / "link.py").write_text("def f():\n    from pkg.layers.state import S\n")
    (package / "layers" / "state.py").write_text("from pkg.parallel.context import x\n")
    (package / "zoo" / "model.py").write_text("from pkg.layers import state\n")
    graph = import_graph(module_files(package))
    assert cycles(graph) == []  # no module-level cycle: only the folders loop
    problems = folder_problems(graph)
    assert len(problems) == 2 and problems[0].startswith("folder cycle: layers -> parallel"), problems
    assert "parallel imports layers against the direction" in problems[1], problems
    (package / "parallel" / "link.py").write_text("")
    assert folder_problems(import_graph(module_files(package))) == []


def test_hybridzoo_folders_import_one_way():
    problems = folder_problems(import_graph(module_files()))
    assert not problems, "\n".join(problems)


def test_backward_kernel_modules_import_first():
    """Each op's backward kernel module imported before anything else of its op, in a fresh
    interpreter (with a forward module that imports its backward at the top, a cycle back to the
    forward would fail here on a partly initialised module)."""
    import subprocess
    import sys

    code = ("import hybridzoo.kernels.triton.delta_rule_bwd as d, hybridzoo.kernels.triton.linear_attn_bwd as la\n"
            "print(d.delta_rule_backward.__name__, la.chunk_linear_attn_bwd.__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["delta_rule_backward", "chunk_linear_attn_bwd"]
