"""A run keeps its final state by default (issue 41 item 9): which steps save, the flag that
leaves it out, the baselines without checkpoints, and what the summary says. The end-to-end
check (a default run's checkpoint, read by ``eval``) is tests/cli/test_train.py's."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from subnetdp.checkpoint.checkpointer import Checkpointer
from subnetdp.cli import build_parser
from subnetdp.commands.train_cmd import config_from_args
from subnetdp.train.config import TrainConfig
from subnetdp.train.trainer import _checkpoint_record


def _saved_steps(cfg: TrainConfig) -> list[int]:
    ckpt = SimpleNamespace(cfg=cfg)
    return [s for s in range(1, cfg.steps + 1) if Checkpointer.due(ckpt, s)]  # type: ignore[arg-type]


def _cfg(*argv: str) -> TrainConfig:
    return config_from_args(build_parser().parse_args(["train", *argv]))


def test_the_final_state_is_saved_unless_asked_not_to() -> None:
    assert _saved_steps(_cfg("--steps", "10")) == [10]
    assert _saved_steps(_cfg("--steps", "10", "--no-final-ckpt")) == []
    assert _saved_steps(_cfg("--steps", "10", "--ckpt-every", "4")) == [4, 8, 10]
    assert _saved_steps(_cfg("--steps", "10", "--ckpt-every", "4", "--no-final-ckpt")) == [4, 8]


def test_baselines_without_checkpoints_train_on_without_one() -> None:
    fsdp, zero1 = _cfg("--strategy", "ddp", "--fsdp"), _cfg("--strategy", "ddp", "--zero", "1")
    assert _saved_steps(fsdp) == _saved_steps(zero1) == []
    with pytest.raises(ValueError, match=r"^--no-final-ckpt has no effect on this run"):
        _cfg("--strategy", "ddp", "--fsdp", "--no-final-ckpt")
    assert _checkpoint_record(fsdp, None) == {
        "checkpoint": None,
        "checkpoint_note": "checkpoints of the plain FSDP2 baseline (ddp with --fsdp) are not "
                           "built"}


def test_the_summary_names_the_checkpoint_or_how_to_keep_one(tmp_path: Path) -> None:
    path = tmp_path / "checkpoints" / "step_00000010"
    assert _checkpoint_record(_cfg(), path) == {"checkpoint": str(path)}
    note = _checkpoint_record(_cfg("--no-final-ckpt"), None)["checkpoint_note"]
    assert note.startswith("--no-final-ckpt: drop it")
