"""What a finished training run left behind, read the same way by every test that compares
runs: each rank's losses and the full model of its last checkpoint."""

from __future__ import annotations

from pathlib import Path

import torch

from subnetdp.checkpoint.files import assemble_full_state, list_checkpoints, read_manifest
from subnetdp.metrics.sinks import rank_jsonl_path, read_jsonl


def rank_losses(run: Path, world: int) -> list[list[float]]:
    """Each rank's loss per logged step (its metrics JSONL)."""
    return [[r["loss"] for r in read_jsonl(rank_jsonl_path(run, r))] for r in range(world)]


def final_state(run: Path) -> dict[str, torch.Tensor]:
    """The full model assembled from the run's last checkpoint."""
    ckpt = list_checkpoints(run / "checkpoints")[-1]
    return assemble_full_state(ckpt, read_manifest(ckpt))
