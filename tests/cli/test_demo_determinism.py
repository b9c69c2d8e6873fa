"""``subnetdp demo`` reproduces its figures bit for bit (issue 28 item 11): two runs of the
demo's training path give the same losses and validation loss, whatever ``OMP_NUM_THREADS``
the caller has (each worker computes on one thread)."""

from __future__ import annotations

import argparse
import dataclasses
import os
from pathlib import Path
from typing import Any

import pytest

from subnetdp.cli import main
from subnetdp.commands.demo import demo_config, one_thread_per_worker
from subnetdp.metrics.sinks import rank_jsonl_path, read_jsonl
from subnetdp.train.config import TrainConfig

pytestmark = [pytest.mark.dist, pytest.mark.timeout(600)]

NPROC = 2


def _losses(out: Path) -> list[list[str]]:
    return [[float(r["loss"]).hex() for r in read_jsonl(rank_jsonl_path(out, rank))]
            for rank in range(NPROC)]


def test_two_demo_runs_are_bit_identical(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from subnetdp.train.run import run_training

    args = argparse.Namespace(recipe="llama-tiny", coverage=0.5, nproc=NPROC, progress=False,
                              out=str(tmp_path))
    runs = []
    for i, threads in enumerate(("1", "2")):  # the caller's setting must not matter
        monkeypatch.setenv("OMP_NUM_THREADS", threads)
        cfg = dataclasses.replace(demo_config(args, "ddp", 3), eval_batches=2,
                                  out=str(tmp_path / f"run{i}"))
        with one_thread_per_worker():
            summary = run_training(cfg)
        runs.append((_losses(Path(cfg.out)), float(summary["val_loss"]).hex()))
        _check_numerics(summary["numerics"])
    assert all(len(r) == 3 for r in runs[0][0])
    assert runs[0] == runs[1]


def _check_numerics(recorded: dict[str, Any]) -> None:
    """Issue 41 item 8: the run records the kernels its figures came from (the README's table
    holds for one set of them: tests/docs/test_demo_promise.py)."""
    import torch

    assert recorded["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert recorded["threads"] == 1 and recorded["env"]["OMP_NUM_THREADS"] == "1"
    assert recorded["torch"] == torch.__version__ and recorded["gpu"] is None
    if torch.backends.mkl.is_available():
        assert recorded["mkl"] and recorded["mkl"][0].isdigit()
    assert recorded["cpu"]


def test_demo_workers_compute_on_one_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = []

    def fake_run_training(cfg: TrainConfig, **_: Any) -> dict[str, Any]:
        seen.append(os.environ.get("OMP_NUM_THREADS"))  # what the launched workers inherit
        return {"strategy": cfg.strategy, "recipe": cfg.recipe, "coverage": 0.5, "world": 2,
                "steps": cfg.steps, "final_train_loss": 4.0, "val_loss": 4.0,
                "step_time_s": 1.0, "per_rank": [{"params_held": 1}]}

    monkeypatch.setattr("subnetdp.train.run.run_training", fake_run_training)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert main(["demo", "--steps", "2", "--no-progress"]) == 0
    assert seen == ["1", "1"]
    assert os.environ["OMP_NUM_THREADS"] == "2"  # the caller's own setting is left as it was
