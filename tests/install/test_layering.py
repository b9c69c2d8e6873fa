"""The import graph of subnetdp against the floors of ``docs/architecture.md``.

The floor list in the doc is the one table: every top-level package (or module) of
``src/subnetdp`` sits on one floor, imports only its own floor or floors below, and no two
packages (nor two modules) import each other, directly or round a cycle. Every import counts:
lazy ones inside functions and those under ``TYPE_CHECKING`` too. ``subnetdp/__init__.py``
is the facade above every floor. The source checked is the ``subnetdp`` that imports
(``PYTHONPATH`` picks it).
"""

from __future__ import annotations

import ast
import importlib
import re
import sys
import warnings
from pathlib import Path

import pytest

import subnetdp

SRC = Path(subnetdp.__file__).resolve().parent
DOC = Path(__file__).resolve().parents[2] / "docs" / "architecture.md"


def doc_floors() -> dict[str, int]:
    """``{package or module name: floor}`` from the fenced block under "Floors by concern"."""
    block = DOC.read_text().split("## Floors by concern", 1)[1].split("```")[1]
    while True:  # drop the (descriptions), which may span lines and name other things
        shorter = re.sub(r"\([^()]*\)", "", block)
        if shorter == block:
            break
        block = shorter
    floors: dict[str, int] = {}
    floor = 0
    for line in block.splitlines():
        number = re.match(r"\s*(\d+)\s", line)
        if number:
            floor = int(number.group(1))
        for name in re.findall(r"(?:^|\s)(_?[a-z][a-z_]*)(?:/|\.py)(?=\s|$)", line):
            assert name not in floors, f"{name} is on two floors of {DOC}"
            floors[name] = floor
    return floors


def top_level(module: str) -> str:
    """``subnetdp.checkpoint.files`` -> ``checkpoint``; ``subnetdp`` -> ``""``."""
    return module.split(".")[1] if "." in module else ""


def modules() -> dict[str, Path]:
    out = {}
    for path in sorted(SRC.rglob("*.py")):
        parts = ["subnetdp", *path.relative_to(SRC).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The subnetdp modules ``name`` imports anywhere in its file."""
    base = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parent = base[: len(base) - node.level + 1]
                target = ".".join([*parent, *([node.module] if node.module else [])])
            else:
                target = node.module or ""
            # ``from pkg import sub`` imports the submodule; any other name, pkg itself. The
            # package's ``__version__`` is its metadata (one string), not the facade's code.
            targets = [f"{target}.{a.name}" if f"{target}.{a.name}" in known else target
                       for a in node.names
                       if (target, a.name) != ("subnetdp", "__version__")]
        else:
            continue
        for target in targets:
            while target not in known and "." in target:
                target = target.rsplit(".", 1)[0]
            if target in known and target != name:
                found.add(target)
    return found


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: imports(name, path, set(mods)) for name, path in mods.items()}


def test_doc_floors_name_the_tree() -> None:
    tree = {top_level(m) for m in modules()} - {""}
    floors = doc_floors()
    assert sorted(tree - set(floors)) == [], f"add these to the floor list of {DOC}"
    assert sorted(set(floors) - tree) == [], f"{DOC} lists what src/subnetdp does not hold"


def test_no_import_points_up() -> None:
    floors = doc_floors()
    up = [f"{m} (floor {floors[top_level(m)]}) imports {t} (floor {floors[top_level(t)]})"
          for m, targets in graph().items() if top_level(m)
          for t in sorted(targets) if floors[top_level(t)] > floors[top_level(m)]]
    assert not up, "imports that point up:\n" + "\n".join(up)


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return groups


def test_cycles_are_found() -> None:
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(edges) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_cycle_between_packages() -> None:
    edges: dict[str, set[str]] = {}
    for m, targets in graph().items():
        if top_level(m):
            edges.setdefault(top_level(m), set()).update(
                top_level(t) for t in targets if top_level(t) != top_level(m))
    found = cycles(edges)  # the floors allow same-floor imports; this keeps them one-way
    assert not found, f"packages that import each other: {found}"


def test_no_cycle_between_modules() -> None:
    found = cycles(graph())
    assert not found, f"modules that import each other: {found}"


def _moved() -> dict[str, str]:
    return dict(importlib.import_module("subnetdp._moved").MOVED)


@pytest.mark.parametrize("old", sorted(_moved()) if (SRC / "_moved.py").exists() else [])
def test_old_module_names_are_the_new_modules(old: str) -> None:
    new = _moved()[old]
    assert not (SRC / Path(*old.split(".")[1:])).with_suffix(".py").exists()  # moved, no shim
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=f"{old} moved to {new}"):
        module = importlib.import_module(old)
    assert module is importlib.import_module(new)
    parent, _, leaf = old.rpartition(".")
    assert getattr(sys.modules[parent], leaf) is module  # monkeypatch.setattr("old.x") patches it


def test_old_names_moved_out_of_a_module_still_import() -> None:
    moved_names = importlib.import_module("subnetdp._moved").MOVED_NAMES
    assert moved_names
    for (old, name), new in moved_names.items():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            value = getattr(importlib.import_module(old), name)
        assert value is getattr(importlib.import_module(new), name), (old, name)
