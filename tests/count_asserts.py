"""Count the assertions of the test suite per feature folder, at two git revisions.

    python tests/count_asserts.py [BASE [HEAD]]      (default: 40e75c9 and the work tree)

A file of BASE is counted under the feature folder it has at HEAD (git's rename detection), so
a reorganisation shows whether assertions were lost. Counted statically: ``assert`` statements,
and calls that check (``assert_*`` helpers such as ``torch.testing.assert_close``,
``pytest.raises``/``pytest.warns``). Helper modules count under ``helpers``.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HELPERS = {"conftest.py", "harness.py", "reference.py", "neuron_ref.py", "toy.py", "workers.py",
           "tensors.py", "count_asserts.py"}


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True,
                          text=True).stdout


def _files(rev: str | None) -> dict[str, str]:
    """{path: source} of every tests/**/*.py at ``rev`` (None: the work tree)."""
    if rev is None:
        return {str(p.relative_to(ROOT)): p.read_text() for p in (ROOT / "tests").rglob("*.py")}
    paths = _git("ls-tree", "-r", "--name-only", rev, "tests").split()
    return {p: _git("show", f"{rev}:{p}") for p in paths if p.endswith(".py")}


def _renames(base: str, head: str | None) -> dict[str, str]:
    out = _git("diff", "-M", "--name-status", base, *([head] if head else []), "--", "tests")
    moves = {}
    for line in out.splitlines():
        status, *paths = line.split("\t")
        if status.startswith("R"):
            moves[paths[0]] = paths[1]
    return moves


def _feature(path: str) -> str:
    parts = Path(path).parts  # ("tests", feature, file) or ("tests", file)
    if parts[-1] in HELPERS or not parts[-1].startswith("test_"):
        return "helpers"
    return parts[1] if len(parts) > 2 else "(top level)"


def _count(source: str) -> tuple[int, int]:
    """(assert statements, checking calls) in ``source``."""
    statements = calls = 0
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Assert):
            statements += 1
        elif isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
            if name.startswith("assert") or name in ("raises", "warns"):
                calls += 1
    return statements, calls


def count(rev: str | None, moves: dict[str, str] | None = None) -> Counter[tuple[str, str]]:
    totals: Counter[tuple[str, str]] = Counter()
    for path, source in _files(rev).items():
        feature = _feature((moves or {}).get(path, path))
        statements, calls = _count(source)
        totals[feature, "assert"] += statements
        totals[feature, "calls"] += calls
    return totals


def main(argv: list[str]) -> None:
    base = argv[0] if argv else "40e75c9"
    head = argv[1] if len(argv) > 1 else None
    before, after = count(base, _renames(base, head)), count(head)
    features = sorted({f for f, _ in before} | {f for f, _ in after})
    print("| feature | assert before | assert after | checking calls before | after |")
    print("|---|---:|---:|---:|---:|")
    for f in features:
        print(f"| {f} | {before[f, 'assert']} | {after[f, 'assert']} | {before[f, 'calls']} "
              f"| {after[f, 'calls']} |")
    print(f"| **total** | {sum(v for (_, k), v in before.items() if k == 'assert')} "
          f"| {sum(v for (_, k), v in after.items() if k == 'assert')} "
          f"| {sum(v for (_, k), v in before.items() if k == 'calls')} "
          f"| {sum(v for (_, k), v in after.items() if k == 'calls')} |")


if __name__ == "__main__":
    main(sys.argv[1:])
