"""The error boundary of the text readers: whatever a reader (pyarrow, ``datasets``, json, the
filesystem) raises over a file becomes one ``DataFormatError`` that names the file and the
reader's own reason, so a bad shard is one line from the launching process, not a traceback.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from subnetdp.data.images import DataFormatError
from subnetdp.data.locate import DatasetMissingError

__all__ = ["reading", "reason"]


@contextlib.contextmanager
def reading(path: str | Path, what: str) -> Iterator[None]:
    """Errors raised in the block while reading ``path`` as ``what`` (e.g. "parquet") become a
    ``DataFormatError`` naming it; errors that already name their file pass through."""
    try:
        yield
    except (DataFormatError, DatasetMissingError, ImportError):
        raise
    except Exception as e:  # the boundary: readers raise many types (ArrowInvalid, ParserError..)
        raise DataFormatError(f"{path} cannot be read as {what} ({reason(e)}); fix or remove "
                              "the file") from e


def reason(e: BaseException) -> str:
    """The innermost cause of ``e`` (``datasets`` wraps the reader's error in its own), on one
    line."""
    while e.__cause__ is not None:
        e = e.__cause__
    text = " ".join(str(e).split())[:300] or "no detail"
    return f"{type(e).__name__}: {text}"
