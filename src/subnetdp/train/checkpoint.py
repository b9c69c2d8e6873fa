"""Sharded checkpoints of a training run: save and exact restore.

Each rank writes what it owns (``SubnetDataParallel.shard_state``: units it owns, shared
entries on rank 0), the same pieces of its optimizer state, and its RNG states; rank 0 adds the
manifest (step, world, plan, config, checksums). The data position is the step itself: batches
are a pure function of ``(seed, rank, step)`` (``subnetdp.data.batches``), so nothing else is
needed to continue with the same data. Under torch DDP everyone holds everything and rank 0
writes it all. File layout and atomicity: ``ckpt_io`` ([Note: atomic checkpoints]);
where a run starts and what a resumed run may change: ``resume``.

[Note: exact resume]
A resumed run continues bit-for-bit: parameters, buffers and optimizer tensors are restored
exactly (float32 in, float32 out), ``step`` counters and the LR schedule's position too, and
each rank gets its RNG states back. The loop then asks for batch ``step`` of each rank, the one
the uninterrupted run would have drawn. Steps between the last checkpoint and a crash are
*replayed* (recomputed, with the same result): their metrics lines are dropped and written again.
"""

from __future__ import annotations

import json
import random
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from subnetdp.plan import Plan
from subnetdp.runtime.rank import RankModel
from subnetdp.train.ckpt_io import (
    FORMAT,
    MANIFEST,
    VERSION,
    CheckpointError,
    ShardReader,
    checkpoints_root,
    prune,
    publish,
    read_manifest,
    shard_name,
    split_piece,
    staging_dir,
    step_dir,
    verify_files,
    write_json_durable,
    write_shard,
)
from subnetdp.train.config import TrainConfig

__all__ = ["CheckpointError", "Checkpointer", "check_compatible", "run_info"]


class Checkpointer:
    """Saves and restores one rank's share of a run. ``save`` and ``restore`` are collective."""

    def __init__(self, run_dir: Path, model: RankModel, opt: torch.optim.Optimizer, sched: Any,
                 *, plan: Plan, cfg: TrainConfig, rank: int, world: int,
                 info: dict[str, Any]) -> None:
        self.root = checkpoints_root(run_dir)
        self.model, self.opt, self.sched = model, opt, sched
        self.plan, self.cfg, self.rank, self.world = plan, cfg, rank, world
        self.shards = model  # the rank model knows its pieces (RankModel.shard_state)
        self.opt_params = _opt_params(opt, model)
        self.local: dict[str, torch.Tensor] = dict(model.module.named_parameters())
        self.info = info  # recipe, model_overrides, model_state: what export/eval need

    def due(self, done: int) -> bool:
        """Save after ``done`` steps? Every ``ckpt_every`` steps and at the end of the run."""
        every = self.cfg.ckpt_every
        return every > 0 and (done % every == 0 or done == self.cfg.steps)

    def save(self, done: int) -> Path:
        """Write the checkpoint of step ``done`` (steps completed); returns its folder."""
        self.model.sync_buffers()  # BatchNorm statistics: holders agree before saving
        tensors = {f"model/{k}": v for k, v in self.shards.shard_state().items()}
        optim, like, scalar = _optimizer_pieces(self.opt, self.opt_params, self.local,
                                                self.shards)
        rng, rng_meta = _capture_rng()
        staging = staging_dir(self.root, done)
        if self.rank == 0:
            shutil.rmtree(staging, ignore_errors=True)  # leftovers of a crashed attempt
            staging.mkdir(parents=True)
        dist.barrier()
        entry = write_shard(staging / shard_name(self.rank), {**tensors, **optim, **rng},
                            {"format": FORMAT, "rank": str(self.rank), **rng_meta})
        entries: list[Any] | None = [None] * self.world if self.rank == 0 else None
        dist.gather_object((shard_name(self.rank), entry), entries, dst=0)
        final = step_dir(self.root, done)
        if self.rank == 0:
            assert entries is not None
            write_json_durable(staging / MANIFEST, self._manifest(done, dict(entries), like,
                                                                  scalar))
            publish(staging, final)
            prune(self.root, self.cfg.ckpt_keep)
        dist.barrier()
        return final

    def _manifest(self, done: int, files: dict[str, Any], like: list[str],
                  scalar: list[str]) -> dict[str, Any]:
        groups = [{k: g[k] for k in ("lr", "initial_lr") if k in g} for g in self.opt.param_groups]
        return {
            "format": FORMAT, "version": VERSION, "step": done, "world": self.world,
            "strategy": self.cfg.strategy, "time": time.time(),
            "plan": self.plan.to_dict(), **self.info, "config": self.cfg.to_dict(),
            "optimizer": {"class": type(self.opt).__name__, "like_states": like,
                          "scalar_states": scalar, "param_groups": groups,
                          "scheduler": _jsonable(self.sched.state_dict())},
            "files": files,
        }

    def restore(self, ckpt: Path) -> int:
        """Load checkpoint ``ckpt`` into this rank's model, optimizer, schedule and RNG; return
        the number of steps it had completed (the next step to run)."""
        manifest = read_manifest(ckpt)
        check_compatible(manifest, ckpt, world=self.world, strategy=self.cfg.strategy,
                         plan=self.plan, model_state=self.info["model_state"])
        _verify_together(ckpt, manifest, self.rank, self.world)
        files = sorted(manifest["files"])
        try:
            self.shards.load_shard_state(ShardReader(ckpt, files, "model/"))
            _load_optimizer(self.opt, self.opt_params, self.local, self.shards, ckpt, files,
                            manifest["optimizer"])
        except KeyError as e:
            raise CheckpointError(f"{ckpt}: {e.args[0]}") from e
        opt_info = manifest["optimizer"]
        self.sched.load_state_dict(opt_info["scheduler"])
        for group, saved in zip(self.opt.param_groups, opt_info["param_groups"], strict=True):
            group.update(saved)
        own = ShardReader(ckpt, [shard_name(self.rank)], "rng/")
        _restore_rng(own, own.metadata(shard_name(self.rank)))
        return int(manifest["step"])


# -- optimizer state --------------------------------------------------------------------------
# An optimizer parameter is a local parameter or, under nb-sdp, a *slice parameter*: the held
# slice of a partly held weight (runtime/masking.py); the rank model says which
# (``RankModel.param_places``). State shaped like the parameter is placed into a tensor shaped
# like the local parameter and sharded exactly like it, so the owners of the pieces write it
# and a loading rank receives exactly the pieces it holds.
OptParam = tuple[torch.Tensor, str, tuple[int, int, int] | None]  # (param, local key, slice)


def _opt_params(opt: torch.optim.Optimizer, model: RankModel) -> list[OptParam]:
    places = {id(p): (key, where) for p, key, where in model.param_places()}
    return [(p, *places[id(p)]) for group in opt.param_groups for p in group["params"]]


def _region(
    t: torch.Tensor, where: tuple[int, int, int] | None, like: torch.Tensor
) -> torch.Tensor:
    view = t if where is None else t.narrow(where[0], where[1], where[2] - where[1])
    if view.shape != like.shape:
        raise RuntimeError(f"optimizer state of shape {tuple(like.shape)} does not fit its "
                           f"place {where} in a parameter of shape {tuple(t.shape)}")
    return view


def _optimizer_pieces(
    opt: torch.optim.Optimizer, params: list[OptParam], local: dict[str, torch.Tensor],
    shards: Any,
) -> tuple[dict[str, torch.Tensor], list[str], list[str]]:
    """Optimizer state as checkpoint tensors: state shaped like its parameter (``exp_avg``,
    ``momentum_buffer``) sharded like the parameter; scalars (``step``, identical on all
    holders) stored by whoever owns a piece of the parameter."""
    like: dict[str, dict[str, torch.Tensor]] = {}
    scalar: dict[str, dict[str, torch.Tensor]] = {}
    for p, key, where in params:
        for k, v in opt.state.get(p, {}).items():
            if v is None:
                continue
            if torch.is_tensor(v) and v.ndim > 0 and v.shape == p.shape:
                if where is None:
                    like.setdefault(k, {})[key] = v
                else:
                    full = like.setdefault(k, {}).setdefault(key, torch.zeros_like(local[key]))
                    _region(full, where, v).copy_(v)
            else:
                scalar.setdefault(k, {})[key] = torch.as_tensor(v)
    out: dict[str, torch.Tensor] = {}
    owned: set[str] = set()
    for k, tensors in like.items():
        for piece, t in shards.shard_state(tensors).items():
            out[f"optim/{k}/{piece}"] = t
            owned.add(split_piece(piece)[0])
    for k, values in scalar.items():
        for key, v in values.items():
            if key in owned:
                out[f"optim_scalar/{k}/{key}"] = v.detach().to("cpu", copy=True)
    return out, sorted(like), sorted(scalar)


def _load_optimizer(opt: torch.optim.Optimizer, params: list[OptParam],
                    local: dict[str, torch.Tensor], shards: Any, ckpt: Path, files: list[str],
                    info: dict[str, Any]) -> None:
    """Recreate the optimizer's per-parameter state (a fresh optimizer has none yet)."""
    for k in info["like_states"]:
        into = {key: torch.empty_like(local[key]) for _, key, _ in params}
        shards.load_shard_state(ShardReader(ckpt, files, f"optim/{k}/"), into=into)
        for p, key, where in params:
            opt.state[p][k] = _region(into[key], where, p).clone()
    for k in info["scalar_states"]:
        reader = ShardReader(ckpt, files, f"optim_scalar/{k}/")
        missing = sorted({key for _, key, _ in params if key not in reader})
        if missing:
            raise KeyError(f"the checkpoint lacks optimizer {k!r} of {missing[:3]}")
        for p, key, _ in params:
            opt.state[p][k] = reader[key].clone()


# -- RNG --------------------------------------------------------------------------------------
def _capture_rng() -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    tensors = {"rng/torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        tensors["rng/cuda"] = torch.cuda.get_rng_state()
    kind, keys, pos, has_gauss, gauss = np.random.get_state()  # type: ignore[misc]
    tensors["rng/numpy"] = torch.from_numpy(np.asarray(keys, dtype=np.int64))
    meta = {"rng_numpy": json.dumps([kind, int(pos), int(has_gauss), float(gauss)]),
            "rng_python": json.dumps(random.getstate())}
    return tensors, meta


def _restore_rng(tensors: ShardReader, meta: dict[str, str]) -> None:
    """``tensors``: this rank's ``rng/`` entries (prefix stripped)."""
    torch.set_rng_state(tensors["torch"])
    if "cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensors["cuda"])
    kind, pos, has_gauss, gauss = json.loads(meta["rng_numpy"])
    keys = tensors["numpy"].numpy().astype(np.uint32)
    np.random.set_state((kind, keys, pos, has_gauss, gauss))
    version, state, gauss_next = json.loads(meta["rng_python"])
    random.setstate((version, tuple(state), gauss_next))


def _jsonable(obj: Any) -> Any:
    return json.loads(json.dumps(obj, default=lambda o: None))


# -- compatibility and verification -----------------------------------------------------------
def check_compatible(manifest: dict[str, Any], ckpt: Path, *, world: int, strategy: str,
                     plan: Plan | None, model_state: list[Any] | None) -> None:
    """Refuse a checkpoint written for another world size, strategy, plan or model."""
    if manifest["world"] != world:
        raise CheckpointError(
            f"the checkpoint {ckpt} was written by {manifest['world']} workers but this run has "
            f"{world}; its plan assigns units to exactly {manifest['world']} workers, so resume "
            f"with --nproc {manifest['world']} (re-planning for another world size is not "
            "supported)")
    if manifest["strategy"] != strategy:
        raise CheckpointError(f"the checkpoint {ckpt} is from a {manifest['strategy']!r} run, "
                              f"not {strategy!r}; resume with --strategy {manifest['strategy']}")
    if plan is not None and _normalised(plan.to_dict()) != _normalised(manifest["plan"]):
        raise CheckpointError(
            f"the checkpoint {ckpt} was written under a different plan than this run's; resume "
            "with the run's own plan (same --coverage/--scheme/--seed/--plan-file)")
    if model_state is not None and _normalised(model_state) != manifest["model_state"]:
        raise CheckpointError(
            f"the checkpoint {ckpt} holds a different model (other entries or shapes) than this "
            "run builds; resume with the same --recipe and --model-arg options")


def _normalised(obj: Any) -> Any:
    return json.loads(json.dumps(obj))


def _verify_together(ckpt: Path, manifest: dict[str, Any], rank: int, world: int) -> None:
    """Check every file's checksum, each rank a share of them, and fail on all ranks alike."""
    names = sorted(manifest["files"])
    error = ""
    try:
        verify_files(ckpt, manifest, names[rank::world])
    except CheckpointError as e:
        error = str(e)
    errors: list[Any] = [None] * world
    dist.all_gather_object(errors, error)
    first = next((e for e in errors if e), None)
    if first:
        raise CheckpointError(first)


def run_info(recipe: Any, overrides: dict[str, Any]) -> dict[str, Any]:
    """What export and eval need to rebuild the plain model: the recipe, its overrides and the
    full model's state entries (key, shape, dtype) in the model's own order."""
    with torch.device("meta"):
        state = recipe.build_model(**overrides).state_dict()
    return {"recipe": recipe.name, "model_overrides": dict(overrides),
            "model_state": [[k, list(v.shape), str(v.dtype)] for k, v in state.items()]}
