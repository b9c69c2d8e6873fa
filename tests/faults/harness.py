"""Helpers of the fault suite: run the CLI, start a training run and wait for its metrics or
checkpoints, fingerprint a folder, judge an error message."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from subnetdp import cli

REPO = Path(__file__).resolve().parents[2]
MAX_MESSAGE_LINES = 1  # our own errors: exactly one line on stderr
long_faults = pytest.mark.long  # minutes each: only with SUBNETDP_LONG_TESTS=1 (conftest.py)
# 2 workers of the default recipe, a metrics line a step (tests/launch: add --out, --steps, ...)
TRAIN = ["train", "--nproc", "2", "--no-progress", "--log-every", "1", "--batch-size", "2",
         "--seq-len", "32", "--eval-batches", "1"]


def fingerprint(root: Path) -> dict[str, str]:
    """sha256 of every file under ``root`` (and the folder names), by relative path."""
    if not root.exists():
        return {}
    out = {}
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root).as_posix()
        out[rel] = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "<dir>"
    return out


def run_cli(argv: Sequence[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """``subnetdp ARGV`` in this process: (exit code, stderr). argparse's exits included; any
    other exception escapes (a traceback is a failure of the test)."""
    capsys.readouterr()
    try:
        code = cli.main(list(argv))
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    return code, capsys.readouterr().err


def clear_message(stderr: str) -> str | None:
    """The message when ``stderr`` is a clear error: no traceback, one line of ours (argparse's
    usage lines before its own ``error:`` line allowed). None otherwise."""
    if "Traceback" in stderr:
        return None
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    if not lines:
        return None
    if lines[0].startswith("usage:"):  # argparse: usage, then "subnetdp X: error: ..."
        return lines[-1] if ": error: " in lines[-1] else None
    return lines[0] if len(lines) <= MAX_MESSAGE_LINES else None


def subnetdp(args: Sequence[str], **kw: object) -> subprocess.Popen[str]:
    """``python -m subnetdp.cli ARGS`` as a child process (stdout/stderr piped)."""
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "subnetdp.cli", *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            **kw)  # type: ignore[call-overload]


def start_training(out: Path, *extra: str) -> subprocess.Popen[str]:
    """``subnetdp train`` of ``TRAIN`` into ``out`` (and ``extra``) as a child process."""
    return subnetdp([*TRAIN, "--out", str(out), *extra])


def wait_for_checkpoint(out: Path, timeout: float = 300) -> None:
    """Until a first checkpoint of run folder ``out`` is complete (its manifest written)."""
    wait_for(lambda: any((out / "checkpoints").glob("step_*/manifest.json")), timeout,
             "a first checkpoint")


def wait_for_metrics(out: Path, rank: int, timeout: float = 300) -> None:
    """Until ``rank`` of run folder ``out`` has logged a first metrics line."""
    path = out / "metrics" / f"rank{rank}.jsonl"
    wait_for(lambda: path.exists() and path.stat().st_size > 0, timeout,
             f"rank {rank}'s first metrics")


def wait_for(pred: object, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.2)


def worker_pids(out: Path) -> dict[int, int]:
    """{rank: pid} of the training workers writing ``out``'s metrics (from their open files)."""
    found = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            for fd in (proc / "fd").iterdir():
                target = os.readlink(fd)
                if target.startswith(str(out / "metrics" / "rank")):
                    found[int(Path(target).stem.removeprefix("rank"))] = int(proc.name)
        except OSError:
            continue
    return found


def kill_quietly(p: subprocess.Popen[str]) -> None:
    if p.poll() is None:
        p.send_signal(signal.SIGKILL)
        p.wait()
