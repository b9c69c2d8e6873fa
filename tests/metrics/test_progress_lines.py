"""Progress lines carry lr and an ETA, messages go above a bar, and the launching process's
live bar follows rank 0's lines (issue 28, item 16)."""

from __future__ import annotations

import io
import time
from pathlib import Path

from subnetdp.metrics.progress import LiveBar, Progress


def test_lines_carry_lr_and_eta_and_start_at_the_first_step_of_a_resume() -> None:
    out = io.StringIO()
    with Progress(10, enabled=True, desc="b-sdp", every=5, stream=out, start=3) as p:
        for s in range(4, 11):
            p.update(s, loss=1.0, tps=100.0, lr=3e-4)
        p.message("validation at step 10/10: val_loss 1.0000")
    lines = out.getvalue().splitlines()
    assert [ln.split(" | ")[0] for ln in lines[:3]] == [
        "b-sdp step  4/10", "b-sdp step  5/10", "b-sdp step 10/10"]
    assert all(" | lr 3.00e-04 | " in ln and " | ETA " in ln for ln in lines[:3])
    assert lines[2].endswith("ETA 0s") and lines[3].startswith("validation at step 10/10")


def test_message_in_bar_mode_is_a_line_of_its_own() -> None:
    out = io.StringIO()
    with Progress(3, enabled=True, desc="tr", stream=out, bar=True) as p:
        p.update(1, loss=0.5, lr=1e-3)
        p.message("validating the full model (2 batches) ...")
        p.update(3, loss=0.25, tps=10.0, lr=1e-3)
    text = out.getvalue()
    assert "\nvalidating the full model (2 batches) ...\n" in text.replace("\r", "\n")
    assert "lr=1.00e-03" in text


def test_live_bar_follows_rank0_lines(tmp_path: Path) -> None:
    log = tmp_path / "run-1_abc" / "attempt_0" / "0" / "stdout.log"
    log.parent.mkdir(parents=True)
    out = io.StringIO()
    with (LiveBar(tmp_path, "run-1_*/attempt_*/0/stdout.log", stream=out, poll_s=0.01),
          open(log, "w") as f):
            f.write("building the model and plan (2 workers) ...\n")
            f.write("b-sdp step 1/4 | loss 8.0000 | lr 1.00e-04 | 10 tok/s | 1.0s | ETA 3s\n")
            f.flush()
            time.sleep(0.1)
            f.write("b-sdp step 4/4 | loss 7.0000 | lr 1.00e-04 | 10 tok/s | 4.0s | ETA 0s\n")
            f.write("validating the full model (2 batches) ...\n")
    text = out.getvalue()
    assert "building the model and plan (2 workers) ...\n" in text
    assert "4/4" in text and "loss 7.0000" in text  # the bar, redrawn
    assert "\nvalidating the full model (2 batches) ...\n" in text.replace("\r", "\n")
    assert "b-sdp step 1/4" not in text  # progress lines became the bar


def _pty(columns: int) -> tuple[int, int]:
    """A pseudo-terminal (master, slave) of ``columns`` columns (0: nobody sized it)."""
    import fcntl
    import os
    import struct
    import termios

    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24 if columns else 0,
                                                        columns, 0, 0))
    return master, slave


def _read_all(master: int) -> str:
    import os
    import select

    text = b""
    while select.select([master], [], [], 0.2)[0]:
        text += os.read(master, 1 << 16)
    return text.decode(errors="replace")


def test_a_terminal_of_zero_columns_gets_periodic_lines() -> None:
    """Issue 41 item 11: tqdm(dynamic_ncols=True) draws nothing on a zero-width terminal."""
    import os

    from subnetdp.metrics.progress import draws_bar

    for columns, bar in ((0, False), (80, True)):
        master, slave = _pty(columns)
        with open(slave, "w", closefd=True) as term:
            assert draws_bar(term) is bar
            with Progress(4, enabled=True, desc="ddp", every=2, stream=term) as p:
                for s in range(1, 5):
                    p.update(s, loss=2.0, lr=1e-3)
            term.flush()
            text = _read_all(master)
        os.close(master)
        assert ("ddp step 4/4 | loss 2.0000" in text) is not bar, text
        assert ("4/4" in text) and ("%|" in text) is bar, text
    assert draws_bar(io.StringIO()) is False  # no file descriptor: lines
