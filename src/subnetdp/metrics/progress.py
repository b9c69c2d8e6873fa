"""Rank 0's progress display: a tqdm bar on a terminal, plain periodic lines otherwise.

Under CI or when output is piped to a file, a redrawn bar turns into thousands of carriage-return
fragments; there we print one readable line every ``every`` steps (and at the last step).
"""

from __future__ import annotations

import math
import sys
import time
from types import TracebackType
from typing import Any, TextIO

__all__ = ["Progress"]


class Progress:
    """``Progress(total, enabled=rank == 0, desc="train")``; ``update(step, loss, tps)``.

    ``step`` counts completed steps (1..total). ``enabled=False`` makes every call a no-op, so
    all ranks can run the same code. ``every`` (plain mode only) defaults to about 20 lines
    per run. ``bar=None`` picks the bar when ``stream`` is a terminal.
    """

    def __init__(
        self,
        total: int,
        enabled: bool = True,
        desc: str = "train",
        *,
        every: int | None = None,
        stream: TextIO | None = None,
        bar: bool | None = None,
    ) -> None:
        self.total = int(total)
        self.enabled = enabled
        self.desc = desc
        self.every = max(1, every if every is not None else math.ceil(self.total / 20))
        self._stream = stream if stream is not None else sys.stdout
        self._t0 = time.perf_counter()
        self._bar: Any = None
        if not enabled:
            return
        if bar is None:
            bar = bool(getattr(self._stream, "isatty", lambda: False)())
        if bar:
            from tqdm import tqdm

            self._bar = tqdm(
                total=self.total, desc=desc, file=self._stream, dynamic_ncols=True, leave=True
            )

    def update(self, step: int, loss: float | None = None, tps: float | None = None) -> None:
        """Show progress after ``step`` completed steps with the latest loss and tokens/s."""
        if not self.enabled:
            return
        step = int(step)
        if self._bar is not None:
            post: dict[str, str] = {}
            if loss is not None:
                post["loss"] = f"{loss:.4f}"
            if tps is not None:
                post["tok/s"] = f"{tps:,.0f}"
            self._bar.set_postfix(post, refresh=False)
            self._bar.update(step - self._bar.n)  # absolute position; tolerates skipped calls
        elif step % self.every == 0 or step == self.total or step == 1:
            self._print_line(step, loss, tps)

    def _print_line(self, step: int, loss: float | None, tps: float | None) -> None:
        width = len(str(self.total))
        parts = [f"{self.desc} step {step:>{width}}/{self.total}"]
        if loss is not None:
            parts.append(f"loss {loss:.4f}")
        if tps is not None:
            parts.append(f"{tps:,.0f} tok/s")
        parts.append(f"{time.perf_counter() - self._t0:.1f}s")
        print(" | ".join(parts), file=self._stream, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
