"""One tiny finished run shared by the run-folder tests (issue 27, root causes 1 and 4)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

# the smallest real run: one CPU worker, a 2-layer llama-tiny, checkpoints at steps 2 and 4
TINY_RUN = ["--recipe", "llama-tiny", "--batch-size", "2", "--seq-len", "32",
            "--eval-batches", "1", "--memory-step", "-1", "--no-progress", "--warmup", "1",
            "--nproc", "1", "--model-arg", "n_layers=2", "--model-arg", "dim=32",
            "--model-arg", "ffn_hidden=64", "--strategy", "ddp", "--ckpt-every", "2"]


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished 4-step run started with --overwrite (its config.json records it); copy it
    before changing it (``copy_run``)."""
    from subnetdp.cli import main

    out = tmp_path_factory.mktemp("tiny") / "R"
    assert main(["train", *TINY_RUN, "--steps", "4", "--overwrite", "--out", str(out)]) == 0
    return out


@pytest.fixture
def copy_run(tiny_run: Path, tmp_path: Path) -> Iterator[Path]:
    """A private copy of ``tiny_run`` at ``tmp_path/case/R``, its config.json naming it (as if
    it had been trained there: a replay of it targets the copy, not the original)."""
    run = Path(shutil.copytree(tiny_run, tmp_path / "case" / "R", symlinks=True))
    config = json.loads((run / "config.json").read_text())
    (run / "config.json").write_text(json.dumps({**config, "out": str(run)}))
    yield run


@pytest.fixture
def no_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """A ``train`` that gets past every check fails the test at once instead of training."""
    def launched(*_: object, **__: object) -> None:
        raise AssertionError("workers were launched: the command was not refused")

    monkeypatch.setattr("subnetdp.train.elastic.launch_shrinking", launched)
