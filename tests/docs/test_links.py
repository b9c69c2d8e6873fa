"""Every relative link and every repository path in README.md, CHANGELOG.md and docs/*.md resolves.

- ``[text](path)``, ``[text](path#anchor)``, ``[text](#anchor)`` and ``![alt](path)``: the path
  exists relative to the page, and the anchor is a heading of the target page (GitHub's slugs:
  lowercase, punctuation but ``-`` and ``_`` dropped, spaces to ``-``, repeats get ``-1``,
  ``-2``). http(s) and mailto links are not followed (no network).
- A path in backticks that starts with a top-level folder of the repository (``src/…``,
  ``tests/…``, ``benchmarks/…``, ``docs/…``, ``examples/…``) and names a file (an extension) or
  a folder (a trailing ``/``) exists; so does a pytest id's test (``file.py::test_name``, and a
  bare ``::test_name`` after it on the same line). A ``.py`` file or a folder named from inside
  ``src/``, ``src/subnetdp/`` or ``tests/`` (``train/trainer.py``, ``runtime/test_bsdp.py``:
  its first folder is one of theirs) exists in one of them. A missing path with a glob or
  placeholder in it (``*``, ``<name>``, ``{a,b}``, ``stepN``, ``NAME``) is not reported.

Fenced code blocks are skipped (their commands run in test_code_blocks.py), and so are links
inside inline code. In-process, well under a second.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PAGES = [p for p in [REPO / "README.md", REPO / "CHANGELOG.md",
                     *sorted((REPO / "docs").glob("*.md"))] if p.exists()]
TOP = ("src", "tests", "benchmarks", "docs", "examples")
# Where a bare path is read from (`subnetdp/_moved.py`, `train/trainer.py`, `runtime/test_bsdp.py`)
BARE_ROOTS = [REPO / "src", REPO / "src" / "subnetdp", REPO / "tests"]

_FENCE = re.compile(r"^\s*(```+|~~~+)")
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REF_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s+<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$")
_CODE_SPAN = re.compile(r"(`+)(.+?)\1")
_HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
_HTML_ID = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"")
_PLACEHOLDER = re.compile(r"[*<>{}$…]|\.\.\.|(?<![A-Za-z])[A-Z]+(?![a-z])")


def prose_lines(page: Path) -> list[tuple[int, str]]:
    """(line number, text) of the lines outside fenced code blocks."""
    kept, fence = [], None
    for n, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
        m = _FENCE.match(line)
        if fence is None and m:
            fence = m.group(1)
        elif fence is not None and m and line.strip().startswith(fence[0] * len(fence)):
            fence = None
        elif fence is None:
            kept.append((n, line))
    return kept


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link: its text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    found: set[str] = set()
    seen: dict[str, int] = {}
    for _, line in prose_lines(page):
        found.update(_HTML_ID.findall(line))
        m = _HEADING.match(line)
        if not m:
            continue
        s = slug(m.group(2))
        n = seen.get(s, 0)
        seen[s] = n + 1
        found.add(s if n == 0 else f"{s}-{n}")
    return found


def links(page: Path) -> list[tuple[int, str]]:
    found = []
    for n, line in prose_lines(page):
        line = _CODE_SPAN.sub("", line)
        found += [(n, target) for target in _LINK.findall(line)]
        m = _REF_DEF.match(line)
        if m:
            found.append((n, m.group(1)))
    return found


def link_errors(page: Path) -> list[str]:
    errors = []
    rel = page.relative_to(REPO)
    for n, target in links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:, ...
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            errors.append(f"{rel}:{n}: link to {target!r}: {path} does not exist")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            errors.append(f"{rel}:{n}: link to {target!r}: no heading #{anchor} in "
                          f"{dest.relative_to(REPO)}")
    return errors


def _defines(file: Path, name: str) -> bool:
    """Whether a test file defines the test (function, class or method) named by a pytest id."""
    name = re.sub(r"\[.*$", "", name)  # a parametrised case: its function
    if not name:
        return True
    text = file.read_text(encoding="utf-8")
    return re.search(rf"^\s*(?:async\s+)?(?:def|class)\s+{re.escape(name)}\b", text, re.M) \
        is not None


def _candidates(path: str) -> list[Path] | None:
    """Where a backticked path may live; None when it does not look like a repository path."""
    first = path.split("/", 1)[0]
    if first in TOP:
        return [REPO / path]
    if not re.search(r"(\.py|/)$", path):  # run-folder files (metrics/val.jsonl) are not ours
        return None
    roots = [root for root in BARE_ROOTS if first and (root / first).is_dir()]
    return [root / path for root in roots] or None


def path_errors(page: Path) -> list[str]:
    errors = []
    rel = page.relative_to(REPO).as_posix()
    for n, line in prose_lines(page):
        last_file: Path | None = None  # for a bare `::test_name` after `file.py::test_a`
        for _, span in _CODE_SPAN.findall(line):
            span = span.strip()
            if span.startswith("::") and last_file is not None:
                errors += [f"{rel}:{n}: `{span}`: no test {name} in "
                           f"{last_file.relative_to(REPO)}"
                           for name in span[2:].split("::") if not _defines(last_file, name)]
                continue
            path, *names = span.split("::")
            path = re.sub(r":\d+(-\d+)?$", "", path)  # file.py:123
            if " " in path or "/" not in path:
                continue
            if not (path.endswith("/") or re.search(r"\.\w+$", path)):
                continue
            candidates = _candidates(path)
            if candidates is None:
                continue
            found = [c for c in candidates if c.exists()]
            if not found:
                if not _PLACEHOLDER.search(path):
                    errors.append(f"{rel}:{n}: `{span}` does not exist (looked in "
                                  f"{', '.join(str(c.relative_to(REPO)) for c in candidates)})")
                continue
            files = [f for f in found if f.is_file() and f.suffix == ".py"]
            if not files:
                continue
            last_file = next((f for f in files if all(_defines(f, m) for m in names)), files[0])
            errors += [f"{rel}:{n}: `{span}`: no test {name} in {last_file.relative_to(REPO)}"
                       for name in names if not _defines(last_file, name)]
    return errors


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_relative_links_resolve(page: Path) -> None:
    errors = link_errors(page)
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_repository_paths_exist(page: Path) -> None:
    errors = path_errors(page)
    assert not errors, "\n".join(errors)


def test_slugs_follow_github() -> None:
    """The slug rule on headings of the kinds these pages use (the checker's own oracle)."""
    assert slug("The demo") == "the-demo"
    assert slug("`--max-groups` and communicators") == "--max-groups-and-communicators"
    assert slug("Floors by concern (bottom up; a floor imports only its own floor)") == \
        "floors-by-concern-bottom-up-a-floor-imports-only-its-own-floor"
    assert slug("Hugging Face: [init-from](init-from.md), export") == \
        "hugging-face-init-from-export"
    assert slug("snake_case names, C = 0.5") == "snake_case-names-c--05"


def test_testing_page_lists_every_test_folder() -> None:
    """docs/testing.md's layout table has a row for every tests/<feature>/ folder that holds
    tests, and names no folder that does not (tests/dist/ holds helpers only)."""
    text = (REPO / "docs" / "testing.md").read_text(encoding="utf-8")
    rows = {m for line in text.splitlines() if line.startswith("| `tests/")
            for m in re.findall(r"`tests/(\w+)/`", line.split(" | ")[0])}
    folders = {d.name for d in (REPO / "tests").iterdir()
               if d.is_dir() and any(d.glob("test_*.py"))}
    assert rows == folders, f"in the table only: {sorted(rows - folders)}; " \
                            f"in tests/ only: {sorted(folders - rows)}"
