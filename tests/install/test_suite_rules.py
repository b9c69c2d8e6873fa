"""Rules of docs/testing.md that a reader of one test file cannot see broken."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_no_test_skips_for_a_missing_package() -> None:
    """`make setup` installs every extra the suite imports: a missing one must fail the run,
    not turn its tests into skips that a green summary hides."""
    found = []
    for path in sorted(TESTS.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "importorskip"):
                found.append(f"{path.relative_to(TESTS.parent)}:{node.lineno}")
    assert not found, ("import the package instead of importorskip (make setup installs "
                       "it; add it to the extras if not): " + ", ".join(found))
