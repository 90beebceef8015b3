"""The package's import graph, read from the source (``ast``, function-level imports included):
no cycle between its parts, the layers the design asks for, and a tuner that imports without
torch.

Parts: each subpackage (``plan``, ``placement``, ``schedule``, ``sim``, ``cost``, ``tuner``,
``runtime``, ``emulate``, ``profiler``, ``launch``, ``cli``, ``hardware``, ``mcore``,
``telemetry``) is one
node, each top-level module (``models``, ``errors``, ...) is its own. Modules are checked too:
no cycle between two modules, inside one package or across. Imports by string
(``importlib.import_module``) are not seen.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "megatron_hetero"

EXECUTION = ("runtime", "emulate", "profiler")
"""Parts that run megatron-core: each depends on the plan and on ``mcore``, never on another."""
PLAN_LEVEL = ("tuner", "cost", "sim", "plan", "placement", "schedule", "models", "hardware",
              "telemetry")
"""Pure Python: never imports an execution part or the megatron-core builder."""


def _modules(package: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every module under ``package``."""
    out = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def part_of(module: str) -> str:
    """The graph node of a module: its subpackage, or the top-level module itself."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _imported(node, module: str, is_package: bool, known: set[str]) -> list[str]:
    """The package's modules one import statement reaches."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    base = module.split(".") if is_package else module.split(".")[:-1]
    if node.level:
        base = base[:len(base) - (node.level - 1)]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    # ``from pkg import sub`` reaches the submodule pkg.sub when there is one
    return [f"{target}.{a.name}" if f"{target}.{a.name}" in known else target for a in node.names]


def import_edges(package: Path = PACKAGE, *, node=None) -> dict[tuple[str, str], list[str]]:
    """(importing part, imported part) -> where: ``path:line`` of each import statement.
    ``node`` maps a module to its graph node (default :func:`part_of`; the identity gives the
    module graph)."""
    node_of = node or part_of
    modules = _modules(package)
    known = set(modules)
    root = package.name
    edges: dict[tuple[str, str], list[str]] = {}
    for module, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for target in _imported(node, module, path.name == "__init__.py", known):
                if target != root and not target.startswith(root + "."):
                    continue
                src, dst = node_of(module), node_of(target)
                where = f"{path.relative_to(package.parent)}:{node.lineno}"
                if src != dst and where not in edges.get((src, dst), ()):
                    edges.setdefault((src, dst), []).append(where)
    return edges


def find_cycle(edges) -> list[str] | None:
    """One cycle of parts ``[a, b, ..., a]``, or None."""
    graph: dict[str, set[str]] = {}
    for src, dst in edges:
        graph.setdefault(src, set()).add(dst)
    state: dict[str, int] = {}  # 1 on the current path, 2 done

    def visit(node, path):
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt, path + [nxt])
                if found:
                    return found
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state:
            found = visit(start, [start])
            if found:
                return found
    return None


def describe(edges, pairs) -> str:
    return "\n".join(f"  {a} -> {b}: {', '.join(edges[(a, b)])}" for a, b in pairs)


def test_no_cycle_between_parts():
    edges = import_edges()
    cycle = find_cycle(edges)
    assert cycle is None, "import cycle between parts of megatron_hetero:\n" + describe(
        edges, zip(cycle, cycle[1:]))


def module_of(module: str) -> str:
    """The module graph's node: the module itself."""
    return module


def test_no_cycle_between_modules():
    """Inside one package too, and through imports inside functions: such an import only hides
    a cycle (the tuner's grid and tables, the rehearsal and the mesh rehearsal had one)."""
    edges = import_edges(node=module_of)
    cycle = find_cycle(edges)
    assert cycle is None, "import cycle between modules of megatron_hetero:\n" + describe(
        edges, zip(cycle, cycle[1:]))


def test_package_root_holds_few_modules():
    """The package is laid out by role: at most 8 modules sit at its root."""
    root = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(root) <= 8, f"{len(root)} modules at the package root: {root}"


def test_execution_parts_do_not_import_each_other():
    edges = import_edges()
    bad = [(a, b) for a, b in edges if a in EXECUTION and b in EXECUTION]
    assert not bad, "runtime, emulate and profiler must share code through mcore:\n" + describe(
        edges, bad)


def test_plan_level_code_imports_no_execution_part():
    edges = import_edges()
    bad = [(a, b) for a, b in edges if a in PLAN_LEVEL and b in EXECUTION + ("mcore",)]
    assert not bad, "the tuner's side must not import what runs megatron-core:\n" + describe(
        edges, bad)


def test_megatron_core_builder_sits_below_its_users():
    edges = import_edges()
    bad = [(a, b) for a, b in edges
           if a == "mcore" and b in EXECUTION + ("tuner", "cost", "sim", "cli", "launch")]
    assert not bad, "mcore may use the plan and models only:\n" + describe(edges, bad)


def test_checker_finds_a_cycle_through_a_function_level_import(tmp_path):
    """The checks above can fail: a cycle made by an import inside a function is found and
    reported with the file and line of each edge."""
    pkg = tmp_path / "pkg"
    for sub in ("a", "b"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "a" / "x.py").write_text("from ..b.y import f\n")
    (pkg / "b" / "y.py").write_text(textwrap.dedent("""
        def f():
            from ..a import x
            return x
    """))
    (pkg / "top.py").write_text("from . import a\n")
    edges = import_edges(pkg)
    assert edges == {("a", "b"): ["pkg/a/x.py:1"], ("b", "a"): ["pkg/b/y.py:3"],
                     ("top", "a"): ["pkg/top.py:1"]}
    cycle = find_cycle(edges)
    assert cycle == ["a", "b", "a"]
    assert "b -> a: pkg/b/y.py:3" in describe(edges, zip(cycle, cycle[1:]))


def test_checker_finds_a_cycle_inside_one_package(tmp_path):
    """Two modules of one package importing each other (one inside a function, one under
    ``TYPE_CHECKING``) are a cycle of the module graph, and no cycle of the part graph."""
    pkg = tmp_path / "pkg"
    (pkg / "a").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a" / "__init__.py").write_text("")
    (pkg / "a" / "x.py").write_text("from typing import TYPE_CHECKING\n"
                                    "if TYPE_CHECKING:\n    from .y import g\n")
    (pkg / "a" / "y.py").write_text("def g():\n    from . import x\n    return x\n")
    assert find_cycle(import_edges(pkg)) is None
    edges = import_edges(pkg, node=module_of)
    assert edges == {("pkg.a.x", "pkg.a.y"): ["pkg/a/x.py:3"],
                     ("pkg.a.y", "pkg.a.x"): ["pkg/a/y.py:2"]}
    assert find_cycle(edges) == ["pkg.a.x", "pkg.a.y", "pkg.a.x"]


@pytest.mark.parametrize("heavy", ["torch", "megatron"])
def test_tuner_and_cli_import_without_torch(heavy):
    script = ("import sys; import megatron_hetero.tuner, megatron_hetero.cli; "
              "import megatron_hetero.telemetry.report, megatron_hetero.cli.report; "
              f"print(sorted(m for m in sys.modules if m.split('.')[0] == {heavy!r}))")
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True,
                         text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", f"importing the tuner and the CLI imported {heavy}: " \
        f"{out.stdout.strip()[:500]}"
