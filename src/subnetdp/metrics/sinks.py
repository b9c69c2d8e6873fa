"""Where metrics go: one JSONL file per rank (a line per logged step), rank 0's validation
lines (``metrics/val.jsonl``) and atomic JSON summaries.

Metric names follow torchtitan; what each means: ``metrics/tracking.py``. Use the constants
rather than string literals so that plots and comparisons find the same keys.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import time
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import IO, Any

from subnetdp.filemode import append_text, write_atomic

__all__ = [
    "COMM_BYTES",
    "LOSS",
    "LR",
    "PEAK_ACTIVE",
    "STEP_TIME",
    "THROUGHPUT",
    "JsonlSink",
    "rank_jsonl_path",
    "read_jsonl",
    "val_jsonl_path",
    "write_json_atomic",
]

LOSS = "loss"
THROUGHPUT = "throughput(tps)"
PEAK_ACTIVE = "memory/peak_active(GiB)"
COMM_BYTES = "comm/bytes_per_step"
STEP_TIME = "time/step_s"
LR = "lr"


def rank_jsonl_path(run_dir: str | os.PathLike[str], rank: int) -> Path:
    """The conventional per-rank metrics file of a run: ``<run_dir>/metrics/rank<r>.jsonl``."""
    return Path(run_dir) / "metrics" / f"rank{rank}.jsonl"


def val_jsonl_path(run_dir: str | os.PathLike[str]) -> Path:
    """Rank 0's validation lines (``--eval-every`` and the end): ``<run_dir>/metrics/val.jsonl``."""
    return Path(run_dir) / "metrics" / "val.jsonl"


class JsonlSink:
    """Append one JSON object per ``log`` call to ``path``, flushed at once.

    Flushing each line (not fsyncing) means a crashed or killed run still leaves every logged
    step readable, at the cost of one write syscall per step. Appending lets a resumed run
    continue the same file. Non-finite floats become ``null`` so the file stays strict JSON.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # never through a link planted at the name ([Note: no links inside a run folder])
        self._f: IO[str] | None = append_text(self.path)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        """Write ``{"step": step, "time": <unix seconds>, **metrics}`` as one line (``step``:
        the steps done, counted from 1 as on the console and in every sink)."""
        if self._f is None:
            raise ValueError(f"JsonlSink({self.path}) is closed; create a new sink to log again")
        record = {"step": int(step), "time": time.time(), **metrics}
        with self._naming_the_file():
            self._f.write(_dumps(record) + "\n")
            self._f.flush()

    def close(self) -> None:
        if self._f is not None:
            f, self._f = self._f, None
            with self._naming_the_file():
                f.close()

    @contextlib.contextmanager
    def _naming_the_file(self) -> Iterator[None]:
        """A failed write (a full disk) names this file and says the fix (the OS error of a
        write names no file)."""
        try:
            yield
        except OSError as e:
            if e.filename is not None:
                raise
            raise OSError(e.errno, f"{e.strerror} while writing metrics; free space there, or "
                                   "train into another --out", str(self.path)) from None

    def __enter__(self) -> JsonlSink:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def read_jsonl(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """All records of a JSONL file; a torn last line (run killed mid-write: no newline) is
    skipped. Any other line that is not a JSON object raises ``ValueError`` naming the file and
    the line: a damaged record is never silently left out of a curve."""
    out: list[dict[str, Any]] = []
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = f.read().split("\n")
    torn = lines.pop()  # after the last newline: empty, or a line cut short
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            record = None
        if not isinstance(record, dict):
            raise ValueError(f"{path}, line {number}: not a metrics record (a JSON object): "
                             f"{line[:60]!r}; fix or delete that line")
        out.append(record)
    if torn.strip():
        with contextlib.suppress(json.JSONDecodeError):
            record = json.loads(torn)
            if isinstance(record, dict):  # complete, only its newline is missing
                out.append(record)
    return out


def write_json_atomic(path: str | os.PathLike[str], obj: Any) -> None:
    """Write ``obj`` as indented JSON so that readers see the old file or the new, never half.

    Writes a temporary file in the same directory (same filesystem, so the rename is atomic),
    fsyncs it, then ``os.replace``s it over ``path``.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, _dumps(obj, indent=2) + "\n", durable=True)


def _dumps(obj: Any, indent: int | None = None) -> str:
    return json.dumps(_clean(obj), indent=indent, default=_default, allow_nan=False)


def _clean(obj: Any) -> Any:
    """Replace NaN/inf by None (strict JSON) in the containers json would walk."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_clean(v) for v in obj]
    return obj


def _default(obj: Any) -> Any:
    """JSON for the values metrics commonly hold: 0-d tensors, numpy scalars, paths, dataclasses."""
    if hasattr(obj, "item") and getattr(obj, "ndim", 0) == 0:  # torch / numpy scalar
        return _clean(obj.item())
    if hasattr(obj, "tolist"):  # small tensors / arrays
        return _clean(obj.tolist())
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return _clean(dataclasses.asdict(obj))
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    if isinstance(obj, set | frozenset):
        return sorted(obj, key=str)
    # A logger must never crash a training run over an odd value; keep it readable instead.
    return str(obj)
