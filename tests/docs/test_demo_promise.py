"""The README's demo promise (issue 41 item 8). A demo's figures are deterministic on its
machine but its validation losses follow the CPU kernels (a run records them: summary.json's
``numerics``, tests/cli/test_demo_determinism.py), so the README says which kernels its table
came from and the tolerance elsewhere. Both must agree with the measurements in
docs/benchmarks.md: the README's figures are the row of its kernels, and the tolerance covers
every kernel set measured."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _readme() -> tuple[str, float, float, float]:
    """The README's kernels, tolerance, and DDP's and b-sdp's validation losses."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    promise = re.search(r"with (\w+) kernels[^)]*?repeats to the last digit[^)]*?"
                        r"within ±(\d\.\d+)", text, re.S)
    assert promise is not None, "README: the demo's kernels and tolerance are not stated"
    row = re.search(r"^val loss \(full model\) +(\d\.\d{4}) +(\d\.\d{4}) ", text, re.M)
    assert row is not None
    return promise[1], float(promise[2]), float(row[1]), float(row[2])


def _measured() -> list[tuple[str, str, float, float | None]]:
    """docs/benchmarks.md's rows: (kernels, how, DDP, b-sdp or None)."""
    text = (REPO / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    table = text[text.index('<a id="demo-kernels"></a>'):].split("\n\n")[1]
    rows = [[c.strip() for c in line.strip("|").split("|")]
            for line in table.splitlines()[2:]]
    return [(k, how, float(d), None if b == "-" else float(b)) for k, how, d, b in rows]


def test_the_readme_figures_are_its_kernels_row_and_the_tolerance_covers_the_others() -> None:
    kernels, tolerance, ddp, bsdp = _readme()
    rows = _measured()
    (own,) = [r for r in rows if "this README" in r[1]]
    assert own[0].startswith(kernels) and (own[2], own[3]) == (ddp, bsdp)
    assert len(rows) >= 3  # kernel sets measured
    for _, how, other_ddp, other_bsdp in rows:
        assert abs(other_ddp - ddp) <= tolerance, how
        assert other_bsdp is None or abs(other_bsdp - bsdp) <= tolerance, how
