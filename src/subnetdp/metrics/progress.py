"""Rank 0's progress display: a tqdm bar on a terminal, plain periodic lines otherwise.

Under CI or when output is piped to a file, a redrawn bar turns into thousands of carriage-return
fragments; there we print one readable line every ``every`` steps (and at the first and last
step), with the loss, learning rate, throughput, elapsed time and an ETA.

Workers' stdout is never a terminal (torch elastic redirects it to a log file, and the launching
process echoes rank 0's lines), so on a terminal the launching process draws the bar itself from
those lines (``LiveBar``).
"""

from __future__ import annotations

import math
import os
import re
import sys
import threading
import time
from pathlib import Path
from types import TracebackType
from typing import Any, TextIO

__all__ = ["LiveBar", "Progress", "draws_bar"]


def draws_bar(stream: TextIO) -> bool:
    """Can a bar be drawn on ``stream``: a terminal that reports a width? A terminal of zero
    columns (a pseudo-terminal nobody sized: some containers, CI runners and ``script``) makes
    ``tqdm(dynamic_ncols=True)`` draw nothing at all, so it gets the plain lines instead."""
    try:
        return stream.isatty() and os.get_terminal_size(stream.fileno()).columns > 0
    except (AttributeError, OSError, ValueError):  # no file descriptor, or a closed one
        return False


class Progress:
    """``Progress(total, enabled=rank == 0, desc="train")``; ``update(step, loss, tps, lr)``;
    ``message(text)`` for any other line (evaluation results).

    ``step`` counts completed steps (1..total); ``start``: the steps done before (a resumed
    run), so the ETA is the pace of this segment's. ``enabled=False`` makes every call a no-op,
    so all ranks can run the same code. ``every`` (plain mode only) defaults to about 20 lines
    per run. ``bar=None`` picks the bar when ``stream`` is a terminal with a width
    (``draws_bar``).
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
        start: int = 0,
    ) -> None:
        self.total = int(total)
        self.start = int(start)
        self.enabled = enabled
        self.desc = desc
        self.every = max(1, every if every is not None else math.ceil(self.total / 20))
        self._stream = stream if stream is not None else sys.stdout
        self._t0 = time.perf_counter()
        self._bar: Any = None
        if not enabled:
            return
        if bar is None:
            bar = draws_bar(self._stream)
        if bar:
            from tqdm import tqdm

            self._bar = tqdm(
                total=self.total, desc=desc, file=self._stream, dynamic_ncols=True, leave=True
            )

    def update(self, step: int, loss: float | None = None, tps: float | None = None,
               lr: float | None = None) -> None:
        """Show progress after ``step`` completed steps with the latest loss, tokens/s and
        learning rate."""
        if not self.enabled:
            return
        step = int(step)
        if self._bar is not None:
            post: dict[str, str] = {}
            if loss is not None:
                post["loss"] = f"{loss:.4f}"
            if lr is not None:
                post["lr"] = f"{lr:.2e}"
            if tps is not None:
                post["tok/s"] = f"{tps:,.0f}"
            self._bar.set_postfix(post, refresh=False)
            self._bar.update(step - self._bar.n)  # absolute position; tolerates skipped calls
        elif step % self.every == 0 or step == self.total or step == self.start + 1:
            self._print_line(step, loss, tps, lr)

    def message(self, text: str) -> None:
        """One line of rank 0's (above the bar, when there is one)."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(text, file=self._stream)
        else:
            print(text, file=self._stream, flush=True)

    def _print_line(self, step: int, loss: float | None, tps: float | None,
                    lr: float | None) -> None:
        width = len(str(self.total))
        parts = [f"{self.desc} step {step:>{width}}/{self.total}"]
        if loss is not None:
            parts.append(f"loss {loss:.4f}")
        if lr is not None:
            parts.append(f"lr {lr:.2e}")
        if tps is not None:
            parts.append(f"{tps:,.0f} tok/s")
        elapsed = time.perf_counter() - self._t0
        parts.append(f"{elapsed:.1f}s")
        if step > self.start:
            parts.append(f"ETA {_duration(elapsed / (step - self.start) * (self.total - step))}")
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


def _duration(seconds: float) -> str:
    """12.3 -> "12s", 754 -> "12m34s", 7384 -> "2h03m"."""
    s = round(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


# a progress line as Progress prints it (rank 0's, echoed with the launcher's "[rank 0] ")
_STEP_LINE = re.compile(r"^(?:\[rank 0\] )?(?P<desc>\S+) step +(?P<step>\d+)/(?P<total>\d+)"
                        r"(?: \| (?P<rest>.*))?$")


_BAR_FORMAT = ("{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} "
               "[{elapsed}<{remaining}{postfix}]")


class LiveBar:
    """The launching process's live bar on a terminal: follows rank 0's stdout file (found
    under ``log_dir`` by ``pattern``: torch elastic names it after the run and the attempt),
    turns its progress lines into a redrawn bar and prints every other line above it.

    ``with LiveBar(log_dir, pattern, stream=sys.stdout):`` around the launch; the newest
    matching file is followed, so a restarted group's attempt takes over."""

    def __init__(self, log_dir: str | Path, pattern: str, *, stream: TextIO | None = None,
                 poll_s: float = 0.2) -> None:
        self.log_dir, self.pattern, self.poll_s = Path(log_dir), pattern, poll_s
        self._stream = stream if stream is not None else sys.stdout
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._follow, daemon=True,
                                        name="subnetdp-progress")
        self._bar: Any = None

    def __enter__(self) -> LiveBar:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        if self._bar is not None:
            self._bar.close()

    def _follow(self) -> None:
        path: Path | None = None
        pos = 0
        pending = ""
        while True:
            stopping = self._stop.is_set()  # read what is there once more, then stop
            newest = max(self.log_dir.glob(self.pattern), default=None,
                         key=lambda p: p.stat().st_mtime)
            if newest is not None and newest != path:
                path, pos, pending = newest, 0, ""
            if path is not None:
                try:
                    with open(path, errors="replace") as f:
                        f.seek(pos)
                        chunk = f.read()
                        pos = f.tell()
                except OSError:
                    chunk = ""
                pending += chunk
                *lines, pending = pending.split("\n")
                for line in lines:
                    self._show(line)
            if stopping:
                return
            self._stop.wait(self.poll_s)

    def _show(self, line: str) -> None:
        m = _STEP_LINE.match(line)
        if m is None:
            if line.strip():
                if self._bar is not None:
                    self._bar.write(line, file=self._stream)
                else:
                    print(line, file=self._stream, flush=True)
            return
        from tqdm import tqdm

        total = int(m["total"])
        if self._bar is None or self._bar.total != total:
            if self._bar is not None:
                self._bar.close()
            self._bar = tqdm(total=total, desc=m["desc"], file=self._stream,
                             dynamic_ncols=True, leave=True, bar_format=_BAR_FORMAT)
        # the bar shows its own elapsed time and ETA; keep loss, lr and throughput
        kept = [f for f in (m["rest"] or "").split(" | ")
                if not (f.endswith("s") and f[:-1].replace(".", "").isdigit())
                and not f.startswith("ETA")]
        self._bar.set_postfix_str(", ".join(kept), refresh=False)
        self._bar.update(int(m["step"]) - self._bar.n)
