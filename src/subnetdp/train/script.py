"""What a training script of your own calls around ``SubnetDataParallel`` (docs/own-model.md):
the process group and this rank's device, and saving and resuming the model with its optimizer.

``save``/``load`` write and read the same sharded checkpoints as ``subnetdp train`` (the
``Checkpointer`` of ``checkpoint.checkpointer``, files as in ``checkpoint.files``): each rank
writes the pieces it owns, its optimizer state cut the same way, and its RNG states, so a
resumed script continues exactly ([Note: exact resume] in ``checkpoint.checkpointer``).
``subnetdp export DIR`` reads them too.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from subnetdp.checkpoint.checkpointer import Checkpointer
from subnetdp.checkpoint.files import resolve_checkpoint
from subnetdp.distributed import process_group
from subnetdp.runtime.called_by_all import called_by_all
from subnetdp.runtime.wrapper import SubnetDataParallel
from subnetdp.train.config import TrainConfig

__all__ = ["OWN_MODEL", "init_distributed", "load", "save"]

OWN_MODEL = "(own model)"  # the manifest's recipe: no recipe rebuilds a script's model


def init_distributed(*, backend: str | None = None,
                     timeout: float | None = None) -> torch.device:
    """Create the default process group and return this rank's device.

    Under ``torchrun`` (or any launcher that sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``) the
    rank joins the launch's group; run as a plain ``python script.py`` it makes a group of one
    process, so the same script runs both ways. ``backend=None``: NCCL with this process pinned
    to ``cuda:LOCAL_RANK`` when CUDA is available (else every rank would use ``cuda:0``), gloo
    on the CPU otherwise. ``timeout``: seconds a collective waits for a peer (None: torch's
    default). Idempotent: a group that exists is kept."""
    process_group.init_distributed(backend, timeout)
    if "nccl" not in str(dist.get_backend()):
        return torch.device("cpu")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(device)
    return device


def save(path: str | os.PathLike[str], model: SubnetDataParallel,
         optimizer: torch.optim.Optimizer, *, step: int, scheduler: Any = None,
         keep: int | None = None) -> Path:
    """Save the model, ``optimizer`` (and ``scheduler``, an LR scheduler) after ``step`` steps
    into ``path/checkpoints/step_<step>/`` and return that folder. Collective: call it on every
    rank (each writes its own share). ``keep``: keep only the newest that many checkpoints in
    ``path`` (None: all). ``path`` must be one folder that every rank sees."""
    with called_by_all("subnetdp.save()"):
        return _checkpointer(path, model, optimizer, scheduler, step=step, keep=keep).save(step)


def load(path: str | os.PathLike[str], model: SubnetDataParallel,
         optimizer: torch.optim.Optimizer, *, scheduler: Any = None) -> int:
    """Load a checkpoint written by ``save`` into the model, ``optimizer`` (and ``scheduler``)
    and each rank's RNG; return its step, so the loop goes on from step + 1. ``path``: the
    folder given to ``save`` (its newest checkpoint) or one ``step_<N>`` folder. Collective.

    The model and optimizer must be built as for the run that saved (same world size, plan and
    model; the optimizer over ``model.parameters()`` in the same order); a checkpoint that does
    not fit is refused with ``CheckpointError``, nothing loaded."""
    with called_by_all("subnetdp.load()"):
        ckpt = resolve_checkpoint(path)
        return _checkpointer(path, model, optimizer, scheduler, step=0, keep=None).restore(ckpt)


class _NoSchedule:
    """Stands in for a script without an LR scheduler (nothing to save)."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        del state


def _checkpointer(path: str | os.PathLike[str], model: SubnetDataParallel,
                  optimizer: torch.optim.Optimizer, scheduler: Any, *, step: int,
                  keep: int | None) -> Checkpointer:
    if not isinstance(model, SubnetDataParallel):
        raise TypeError(f"subnetdp.save/load take the SubnetDataParallel model that the script "
                        f"trains, got {type(model).__name__}")
    if keep is not None and keep < 1:
        raise ValueError(f"keep must be >= 1 (or None: keep every checkpoint), got {keep}")
    world = dist.get_world_size()
    # What the manifest records of the run (and what a resume checks): a script has no recipe
    # or CLI options, only its strategy, composition and world.
    cfg = TrainConfig(recipe=OWN_MODEL, strategy=model.strategy.name, nproc=world, steps=step,
                      ckpt_keep=keep or 0, fsdp=model.fsdp, zero=model.zero)
    info = {"recipe": OWN_MODEL, "model_overrides": {}, "model_state": _model_state(model)}
    return Checkpointer(Path(path), model, optimizer, scheduler or _NoSchedule(),
                        plan=model.plan, cfg=cfg, rank=dist.get_rank(), world=world, info=info)


def _model_state(model: SubnetDataParallel) -> list[list[Any]]:
    """The full model's state entries ``[key, shape, dtype]`` in its own order (as
    ``checkpoint.checkpointer.run_info`` records a recipe's): a slice entry's pieces add up along
    their dimension."""
    shapes: dict[str, list[int]] = {}
    dtypes: dict[str, str] = {}
    for p in model.pieces:
        if p.key not in shapes:
            shapes[p.key], dtypes[p.key] = list(p.shape), str(p.dtype)
            if p.dim is not None:
                shapes[p.key][p.dim] = 0
        if p.dim is not None:
            shapes[p.key][p.dim] += p.stop - p.start
    return [[k, shapes[k], dtypes[k]] for k in model.full_state_keys]
