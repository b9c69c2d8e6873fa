"""A node-local ``--out`` is refused when the workers start (issue 28 item 7): rank 0 writes a
marker into the run folder and every rank must read it back ([Note: a folder all ranks share]
in train/shared_folder.py). Simulated with rank 1 looking at another folder, as a second node
with its own local disk would."""

from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest

from subnetdp.cli import main
from subnetdp.train.shared_folder import MARKER
from tests.workers import patch_workers

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]

TINY = ["--recipe", "llama-tiny", "--strategy", "ddp", "--nproc", "2", "--batch-size", "2",
        "--seq-len", "32", "--eval-batches", "1", "--memory-step", "-1", "--no-progress",
        "--steps", "1"]


def _rank_1_sees(other: str) -> None:
    """In a worker: rank 1's run folder is ``other`` (its node's own disk)."""
    import subnetdp.train.trainer as trainer

    if os.environ["RANK"] == "1":
        check = trainer.check_shared_folder
        trainer.check_shared_folder = lambda out, rank: check(Path(other), rank)


def test_a_rank_that_cannot_see_out_stops_the_run_at_start(tmp_path: Path, capsys,
                                                           monkeypatch) -> None:
    out, local = tmp_path / "run", tmp_path / "node1-local"
    patch_workers(monkeypatch, functools.partial(_rank_1_sees, str(local)))
    code = main(["train", *TINY, "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1, err
    # every rank raises the same error; rank 1 names the folder it looked at, which on real
    # nodes is the same path, here the patched one: whichever rank the launcher reports first
    assert err.startswith((f"subnetdp train: --out {out}: rank 1 on ",
                           f"subnetdp train: --out {local}: rank 1 on ")), err
    assert "--out must be on a filesystem all nodes share" in err
    assert not (out / "metrics").exists() and not (out / "config.json").exists()  # no step
    assert not (out / MARKER).exists()


def test_a_run_leaves_no_marker(tmp_path: Path) -> None:
    out = tmp_path / "run"
    assert main(["train", *TINY, "--out", str(out)]) == 0
    assert (out / "summary.json").exists() and not (out / MARKER).exists()
