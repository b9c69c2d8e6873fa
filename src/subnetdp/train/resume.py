"""Resume policy: where a run starts, what a resumed run may change, which metrics lines are
replayed, and stopping a diverged run so that its newest checkpoint stays a good one.

The mechanism (writing and restoring one rank's share exactly) is ``checkpoint``; the file
layout, atomic publish and checksums are ``ckpt_io``. [Note: exact resume] in ``checkpoint``
explains why a resumed run replays the steps after its checkpoint.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from subnetdp.metrics.sinks import read_jsonl
from subnetdp.train.checkpoint import check_compatible
from subnetdp.train.ckpt_io import (
    CheckpointError,
    checkpoints_root,
    list_checkpoints,
    read_manifest,
    resolve_checkpoint,
    verify_files,
)
from subnetdp.train.config import TrainConfig

__all__ = [
    "RESUME_OVERRIDABLE",
    "NonFiniteLossError",
    "check_fresh_run_dir",
    "drop_replayed_metrics",
    "preflight_resume",
    "restart_count",
    "resume_config",
    "resume_source",
    "stop_if_not_finite",
    "truncate_metrics",
]

# Options a resumed run may change: they do not touch the model, the data or the optimiser's
# maths (``steps`` extends the run; the cosine schedule is then computed for the new length).
RESUME_OVERRIDABLE = frozenset({"steps", "progress", "ckpt_every", "ckpt_keep", "max_restarts",
                                "eval_batches", "memory_step", "log_every", "resume",
                                "collective_timeout"})


class NonFiniteLossError(RuntimeError):
    """The loss became NaN or infinite: the run stopped and kept its last good checkpoint."""


# -- where a run starts ------------------------------------------------------------------------
def restart_count() -> int:
    """How many times torch elastic has restarted this worker group (0 on the first attempt)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def resume_source(resume: str | None, run_dir: Path) -> Path | None:
    """The checkpoint a worker starts from, or None for a fresh start.

    A group restarted by torch elastic (``--max-restarts``) continues from the newest
    checkpoint of its own run: that is the automatic fault recovery."""
    found = list_checkpoints(checkpoints_root(run_dir))
    if restart_count() > 0 and found:
        return found[-1]
    if resume:
        return resolve_checkpoint(resume)
    if restart_count() == 0:
        check_fresh_run_dir(run_dir)
    return None


def check_fresh_run_dir(run_dir: Path) -> None:
    """A new run must not start in a folder holding another run's checkpoints."""
    found = list_checkpoints(checkpoints_root(run_dir))
    if found:
        raise CheckpointError(
            f"{run_dir} already holds checkpoints (latest {found[-1].name}) of an earlier run; "
            f"continue it with --resume {run_dir}, or start a new run with another --out "
            "(nothing was overwritten)")


def resume_config(resume: str, given: dict[str, Any], explicit: set[str]) -> TrainConfig:
    """The configuration of a resumed run: the checkpoint's own, plus the options the user set
    explicitly that a resume may change. Any other explicit option that differs is refused."""
    ckpt = resolve_checkpoint(resume)
    manifest = read_manifest(ckpt)
    saved = dict(manifest["config"])
    run_dir = ckpt.parent.parent
    for name in sorted(explicit):
        if name in RESUME_OVERRIDABLE:
            saved[name] = given[name]
        elif name == "out":
            if Path(given["out"]).resolve() != run_dir.resolve():
                raise CheckpointError(f"--out {given['out']} differs from the resumed run's "
                                      f"folder {run_dir}; a resumed run continues in its own "
                                      "folder (drop --out)")
        elif name in given and given[name] != saved.get(name):
            flag = "--" + name.replace("_", "-")
            if name == "nproc":
                raise CheckpointError(
                    f"--nproc {given[name]}: the checkpoint {ckpt} was written by "
                    f"{manifest['world']} workers and its plan is for {manifest['world']}; "
                    f"resume with --nproc {manifest['world']} (or drop --nproc)")
            raise CheckpointError(
                f"{flag} {given[name]!r} differs from the resumed run's {saved.get(name)!r}; "
                f"a resumed run keeps its configuration (drop {flag}, or start a new run with "
                "another --out)")
    if saved["steps"] <= manifest["step"]:
        raise CheckpointError(
            f"the checkpoint {ckpt} is at step {manifest['step']} and the run has "
            f"--steps {saved['steps']}: nothing left to train; pass --steps > "
            f"{manifest['step']} to train further")
    saved["out"], saved["resume"] = str(run_dir), str(ckpt)
    return TrainConfig.from_dict(saved)


def preflight_resume(cfg: TrainConfig) -> None:
    """Before any worker starts: the checkpoint is complete, intact and fits ``cfg.nproc``."""
    if not cfg.resume:
        return
    ckpt = resolve_checkpoint(cfg.resume)
    manifest = read_manifest(ckpt)
    check_compatible(manifest, ckpt, world=cfg.nproc, strategy=cfg.strategy, plan=None,
                     model_state=None)
    verify_files(ckpt, manifest)


def truncate_metrics(path: Path, start: int) -> list[dict[str, Any]]:
    """Keep the metrics lines of steps before ``start`` (the steps about to be replayed are
    written again) and return them."""
    if not path.exists():
        return []
    kept = [r for r in read_jsonl(path) if int(r.get("step", -1)) < start]
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for r in kept:
            f.write(json.dumps(r) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return kept


def drop_replayed_metrics(path: Path, start: int, *, resumed: bool) -> list[float]:
    """On a resumed or restarted run, drop the metrics lines of the steps about to be replayed
    and return the losses logged before ``start``; a fresh run keeps its file as it is."""
    if not (resumed or restart_count() > 0):
        return []
    return [float(r["loss"]) for r in truncate_metrics(path, start) if r.get("loss") is not None]


# -- stopping a diverged run ------------------------------------------------------------------
def stop_if_not_finite(loss: float, step: int, run_dir: Path, device: torch.device) -> None:
    """Collective: every rank learns whether any rank's loss is NaN/inf and stops at the same
    step, before the step's checkpoint, so the newest checkpoint stays the last good one."""
    mine = torch.tensor([loss], dtype=torch.float64, device=device)
    losses = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(losses, mine)
    bad = {r: float(t.item()) for r, t in enumerate(losses) if not torch.isfinite(t).all()}
    if not bad:
        return
    found = list_checkpoints(checkpoints_root(run_dir))
    kept = (f"the last good checkpoint is kept: {found[-1]}" if found else
            "no checkpoint had been written (use --ckpt-every N to keep progress)")
    raise NonFiniteLossError(
        f"the loss is not finite at step {step} (loss by rank: {bad}); training stopped and "
        f"{kept}. Lower --lr or set --grad-clip and start a new run")
