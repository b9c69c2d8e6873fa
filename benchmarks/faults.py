"""Count how the CLI answers the bad inputs of tests/cli/test_bad_inputs.py.

    PYTHONPATH=src python benchmarks/faults.py [--label NAME] [--json FILE] [--md FILE]

Each case runs in this process, as the test does, with ``launch`` replaced by a stub that
records an accepted input instead of starting workers. Outcomes: ``clear`` (exit != 0, one line,
no traceback), ``traceback`` (an exception escaped, or stderr holds a traceback), ``unclear``
(exit != 0 but several lines), ``launched`` (accepted before launch: the workers would start
and either fail with a dump of every rank's traceback or train on a silently changed input),
``exit0`` (accepted and nothing done about it).
Point PYTHONPATH at another checkout's src to count it (the "before" column of the results).
Writes benchmarks/results/faults.{json,md} with ``--json``/``--md``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.cli import test_bad_inputs as suite
from tests.faults.harness import clear_message


class _Launched(Exception):
    pass


def _stub_launch(*args: object, **kwargs: object) -> None:
    raise _Launched


def classify(argv: list[str]) -> tuple[str, str]:
    from subnetdp import cli

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            code = cli.main(argv)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except _Launched:
        return "launched", "accepted before launch: the workers would start"
    except Exception:  # what a user would have seen as a traceback
        return "traceback", traceback.format_exc().strip().splitlines()[-1]
    text = err.getvalue()
    if code == 0:
        return "exit0", "accepted: exit 0"
    message = clear_message(text)
    if message is not None:
        return "clear", message
    return ("traceback" if "Traceback" in text else "unclear"), text.strip().splitlines()[-1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--label", default="this checkout")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--md", type=Path)
    ap.add_argument("--before", type=Path,
                    help="a --json of another checkout, shown as the 'before' column")
    args = ap.parse_args()

    import subnetdp.distributed.launch

    mp = pytest.MonkeyPatch()
    mp.setattr(subnetdp.distributed.launch, "launch", _stub_launch)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        factory = _Factory(Path(tmp))
        inputs = suite.inputs.__wrapped__(factory)  # type: ignore[attr-defined]
        for i, (name, argv, _) in enumerate(suite.CASES):
            out = Path(tmp) / f"out{i}" / "new-run"
            outcome, text = classify(suite._argv(argv, inputs, out))
            rows.append({"case": name, "outcome": outcome, "message": text[:200]})
            print(f"{outcome:9s} {name}: {text[:110]}", flush=True)
    mp.undo()
    counts = {k: sum(r["outcome"] == k for r in rows)
              for k in ("clear", "traceback", "unclear", "launched", "exit0")}
    print(f"\n{args.label}: {len(rows)} bad inputs: " +
          ", ".join(f"{v} {k}" for k, v in counts.items()))
    if args.json:
        args.json.write_text(json.dumps({"label": args.label, "counts": counts, "rows": rows},
                                        indent=1))
    if args.md:
        before = json.loads(args.before.read_text()) if args.before else None
        old = {r["case"]: r["outcome"] for r in before["rows"]} if before else {}
        head = f" {before['label']} |" if before else ""
        lines = [f"# Bad inputs: {len(rows)} cases of tests/cli/test_bad_inputs.py", "",
                 f"| outcome |{head} {args.label} |", "|---|---|" + ("---|" if before else ""),
                 *(f"| {k} |" + (f" {before['counts'][k]} |" if before else "") + f" {v} |"
                   for k, v in counts.items()), "",
                 f"| case |{head} {args.label} | message |",
                 "|---|---|---|" + ("---|" if before else ""),
                 *(f"| {r['case']} |" + (f" {old.get(r['case'], '-')} |" if before else "")
                   + f" {r['outcome']} | {r['message'].replace('|', '/')} |" for r in rows)]
        args.md.write_text("\n".join(lines) + "\n")
    return 0


class _Factory:
    """The bits of pytest's TempPathFactory the ``inputs`` fixture uses."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def mktemp(self, name: str) -> Path:
        p = self.root / name
        p.mkdir()
        return p


if __name__ == "__main__":
    sys.exit(main())
