"""The layers of qevolve_cli/ (docs/architecture.md): no import runs upward, no import circle.

Every import counts, lazy ones inside functions included (``ast``; nothing is imported). Cheap: parses
~60 files.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "qevolve_cli"


def layers() -> dict[str, int]:
    """{module or package: layer number} from the ``L<n>`` lines of docs/architecture.md."""
    table = {}
    for line in (ROOT / "docs" / "architecture.md").read_text().splitlines():
        m = re.match(r"^L(\d+) +\S+ +(.*)$", line)
        if m:
            for name in m.group(2).split():
                if name.startswith("qevolve_cli"):
                    table[name] = int(m.group(1))
    assert table, "docs/architecture.md: no layer table (lines 'L<n> <name> <modules>')"
    return table


def modules() -> dict[str, Path]:
    out = {}
    for p in PKG.rglob("*.py"):
        parts = list(p.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = p
    return out


def layer_of(mod: str, table: dict[str, int]) -> int | None:
    name = mod
    while name:
        if name in table:
            return table[name]
        name = name.rpartition(".")[0]
    return 1 if mod.count(".") <= 1 else None  # foundation: qevolve_cli and the modules directly under it


def import_graph() -> dict[str, set[str]]:
    mods = modules()

    def resolve(name: str) -> str:
        while name not in mods:
            name = name.rpartition(".")[0]
        return name

    graph: dict[str, set[str]] = {m: set() for m in mods}
    for m, p in mods.items():
        for node in ast.walk(ast.parse(p.read_text(), str(p))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                assert node.level == 0, f"{p}:{node.lineno}: relative import (use qevolve_cli.…)"
                names = [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            for n in names:
                if n.split(".")[0] == "qevolve_cli" and (t := resolve(n)) != m:
                    graph[m].add(t)
    return graph


def test_every_module_has_a_layer():
    table = layers()
    missing = sorted(m for m in modules() if layer_of(m, table) is None)
    assert not missing, f"modules in no layer (add them to docs/architecture.md): {missing}"


def upward(graph: dict[str, set[str]], table: dict[str, int]) -> list[str]:
    return sorted(f"{a} (L{layer_of(a, table)}) -> {b} (L{layer_of(b, table)})"
                  for a, ts in graph.items() for b in ts if layer_of(b, table) > layer_of(a, table))


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    # a package's __init__ importing its own submodules is how a package hands names on: not a circle
    edges = {a: {b for b in ts if not b.startswith(a + ".")} for a, ts in graph.items()}
    state: dict[str, int] = {}
    found: list[list[str]] = []

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for t in sorted(edges.get(m, ())):
            if state.get(t) == 1:
                found.append(path[path.index(t):] + [t])
            elif t not in state:
                visit(t, path + [t])
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m, [m])
    return found


def test_no_upward_import():
    up = upward(import_graph(), layers())
    assert not up, "imports that run upward (docs/architecture.md):\n" + "\n".join(up)


def test_no_import_circle():
    found = circles(import_graph())
    assert not found, "import circles:\n" + "\n".join(" -> ".join(c) for c in found)


def test_the_checks_can_fail():
    """Lazy imports are seen, and a circle or an upward import added to the real graph is reported."""
    graph, table = import_graph(), layers()
    assert "qevolve_cli.critic.trainer" in graph["qevolve_cli.evolve.loop"]  # imported inside a function
    bad = {**graph, "qevolve_cli.errors": graph["qevolve_cli.errors"] | {"qevolve_cli.atomic"},
           "qevolve_cli.training": graph["qevolve_cli.training"] | {"qevolve_cli.commands.common"}}
    bad["qevolve_cli.atomic"] = graph["qevolve_cli.atomic"] | {"qevolve_cli.errors"}
    assert [set(c) for c in circles(bad)] == [{"qevolve_cli.atomic", "qevolve_cli.errors"}]
    assert upward(bad, table) == ["qevolve_cli.training (L3) -> qevolve_cli.commands.common (L7)"]
    assert circles({"qevolve_cli.policy": {"qevolve_cli.policy.trainer"}}) == []  # a package's own face
