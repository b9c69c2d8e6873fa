"""Sharded checkpoints of a training run: save and exact restore.

Each rank writes what it owns (``SubnetDataParallel.shard_state``: units it owns, shared
entries on rank 0), the same pieces of its optimizer state, and its RNG states; rank 0 adds the
manifest (step, world, plan, config, checksums). The data position is the step itself: batches
are a pure function of ``(seed, rank, step)`` (``subnetdp.data.batches``), so nothing else is
needed to continue with the same data. A run whose holders differ between syncs (local steps,
``runtime.local_steps``) also writes every rank's own copies, ``held/model/<piece>`` and
``held/optim/<state>/<piece>``, which an exact resume gives back to that rank. Under torch DDP
everyone holds everything and rank 0 writes it all. File layout and atomicity: ``ckpt_io``
([Note: atomic checkpoints]); where a run starts and what a resumed run may change: ``resume``.

[Note: exact resume]
A resumed run continues bit-for-bit: parameters, buffers and optimizer tensors are restored
exactly (float32 in, float32 out), ``step`` counters and the LR schedule's position too, and
each rank gets its RNG states back. The loop then asks for batch ``step`` of each rank, the one
the uninterrupted run would have drawn. Steps between the last checkpoint and a crash are
*replayed* (recomputed, with the same result): their metrics lines are dropped and written again.
A checkpoint of another world size or plan is loaded with ``reshard`` ([Note: resharded resume]
in ``reshard``): the same values, not the same continuation.

[Note: failed checkpoint writes]
A write that fails on any rank (full disk, read-only or vanished folder) fails on every rank
alike: rank 0 deletes the staging folder, so nothing half-written stays behind, and everyone
raises ``CheckpointWriteError`` naming the newest intact checkpoint. Rank 0 also leaves a token
in the staging folder that every rank must read back before writing: a rank that does not see
it is on another machine with its own ``--out`` (node-local disk), which is named as such
instead of failing later in safetensors.
"""

from __future__ import annotations

import json
import os
import random
import secrets
import shutil
import socket
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NoReturn, Protocol

import numpy as np
import torch
import torch.distributed as dist
from safetensors import SafetensorError

from subnetdp.checkpoint.files import (
    FORMAT,
    VERSION,
    CheckpointError,
    ShardReader,
    checkpoints_root,
    list_checkpoints,
    prune,
    publish,
    read_manifest,
    shard_name,
    split_piece,
    staging_dir,
    step_dir,
    verify_files,
    write_manifest,
    write_shard,
)
from subnetdp.checkpoint.rescue import write_contribution
from subnetdp.checkpoint.reshard import HeldCheckpoint, PieceReader, reseed
from subnetdp.filemode import FolderId, check_same_folder, folder_id, write_atomic
from subnetdp.plan import Plan
from subnetdp.runtime.rank import RankModel
from subnetdp.runtime.zero import zero_of

__all__ = ["CheckpointError", "CheckpointUnusableError", "CheckpointWriteError", "Checkpointer",
           "RunStoppedError", "check_compatible", "run_info"]

_TOKEN = ".shared-folder-token"  # [Note: failed checkpoint writes]


class RunStoppedError(RuntimeError):
    """Raised on every rank at once (the ranks agreed on it): the run stops, and torch elastic
    is not asked to restart it, since a restart would meet the same cause."""


class CheckpointWriteError(RunStoppedError):
    """A checkpoint could not be written; its staging folder is gone and the message names the
    newest intact checkpoint."""


class CheckpointUnusableError(RunStoppedError):
    """Every rank found the checkpoint to resume unusable (damaged, or not visible to all)."""


class RunOptions(Protocol):
    """What a checkpoint reads of the run's configuration (``train.config.TrainConfig`` is
    one): the checkpoint floor sits below training and knows no training config class."""

    steps: int
    seed: int
    strategy: str
    ckpt_every: int
    ckpt_keep: int
    reshard: bool

    def saves_at(self, step: int) -> bool: ...

    def to_dict(self) -> dict[str, Any]: ...


class Checkpointer:
    """Saves and restores one rank's share of a run. ``save`` and ``restore`` are collective."""

    def __init__(self, run_dir: Path, model: RankModel, opt: torch.optim.Optimizer, sched: Any,
                 *, plan: Plan, cfg: RunOptions, rank: int, world: int,
                 info: dict[str, Any], holders_differ: bool = False) -> None:
        """``holders_differ``: a unit's holders may hold different values and inner optimizer
        state at a checkpoint (local steps): each rank also saves its own copies (module doc)."""
        self.holders_differ = holders_differ
        self.root = checkpoints_root(run_dir)
        self.model, self.opt, self.sched = model, opt, sched
        self.plan, self.cfg, self.rank, self.world = plan, cfg, rank, world
        self.shards = model  # the rank model knows its pieces (RankModel.shard_state)
        # under ZeRO the optimizer trains shards: checkpoints see it per parameter (plain)
        self.zero = zero_of(opt)
        self.opt_params = _opt_params(
            self.zero.param_groups if self.zero else [g["params"] for g in opt.param_groups],
            model)
        self.local = model.plain_params()  # templates of optimizer state, plain layout
        self.info = info  # recipe, model_overrides, model_state: what export/eval need
        # [Note: no links inside a run folder]: the folder this run writes, checked before
        # every checkpoint is staged, published or pruned (None: taken at the first save)
        self.folder: FolderId | None = folder_id(run_dir) if run_dir.is_dir() else None
        # the checkpoint this run's state continues (recorded in each manifest: prune follows
        # this lineage, not names)
        self.parent: str | None = None

    def due(self, done: int) -> bool:
        """Save after ``done`` steps? (``TrainConfig.saves_at``)"""
        return self.cfg.saves_at(done)

    def save(self, done: int) -> Path:
        """Write the checkpoint of step ``done`` (steps completed); returns its folder.
        A failure on any rank raises ``CheckpointWriteError`` on all
        ([Note: failed checkpoint writes])."""
        tensors, like, scalar = self._owned()
        if self.holders_differ:  # local steps refuse ZeRO: the plain optimizer's state
            tensors |= self._own_copies(self.opt.state)
        rng, rng_meta = _capture_rng()
        staging, final = staging_dir(self.root, done), step_dir(self.root, done)
        token = self._on_rank0(lambda: self._open_staging(staging), final)
        error, entry = "", None
        try:
            if token != _read_token(staging):
                error = (f"rank {self.rank} on {socket.gethostname()} does not see the folder "
                         f"{staging} that rank 0 created: the run folder must be one folder "
                         "that every rank shares (a node-local --out is not); put --out on a "
                         "shared filesystem")
            else:
                entry = write_shard(staging / shard_name(self.rank), {**tensors, **rng},
                                    {"format": FORMAT, "rank": str(self.rank), **rng_meta})
        except (OSError, SafetensorError) as e:
            error = f"rank {self.rank} could not write its file: {e}"
        entries: list[Any] = [None] * self.world
        dist.all_gather_object(entries, error or (shard_name(self.rank), entry))
        failed = next((e for e in entries if isinstance(e, str)), None)
        if failed is not None:
            self._fail(final, failed)

        def finish() -> str:
            (staging / _TOKEN).unlink()
            write_manifest(staging, self._manifest(done, dict(entries), like, scalar))
            self._check_folder()
            publish(staging, final)
            prune(self.root, self.cfg.ckpt_keep, newest=final)
            return ""

        self._on_rank0(finish, final)
        self.parent = final.name
        return final

    def _owned(self) -> tuple[dict[str, torch.Tensor], list[str], list[str]]:
        """The pieces this rank's checkpoint file holds (model and optimizer state, no RNG)
        and the optimizer's state names; collective (buffers, a ZeRO optimizer's state)."""
        self.model.sync_buffers()  # BatchNorm statistics: holders agree before saving
        tensors = {f"model/{k}": v for k, v in self.shards.shard_state().items()}
        state = self.zero.plain_state() if self.zero else self.opt.state  # collective
        optim, like, scalar = _optimizer_pieces(state, self.opt_params, self.local, self.shards)
        return {**tensors, **optim}, like, scalar

    def owned_state(self, done: int) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """What ``save(done)`` would write of this rank, in memory (on the CPU) with its
        manifest; every rank's together make a ``HeldCheckpoint``. Collective."""
        tensors, like, scalar = self._owned()
        return ({k: v.detach().to("cpu", copy=True) for k, v in tensors.items()},
                self._manifest(done, {}, like, scalar))

    def _own_copies(self, state: Mapping[Any, Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        """Every piece this rank holds and its optimizer state, as this rank has them."""
        held = _Held(self.shards)
        optim, _, _ = _optimizer_pieces(state, self.opt_params, self.local, held)
        return {**{f"held/model/{k}": v for k, v in held.shard_state().items()},
                **{f"held/{k}": v for k, v in optim.items() if k.startswith("optim/")}}

    def _load_own_copies(self, ckpt: Path, manifest: dict[str, Any]) -> None:
        """An exact resume of a run whose holders differ: this rank's own copies."""
        own = [shard_name(self.rank)]
        weights = ShardReader(ckpt, own, "held/model/")
        if not weights:  # a rescued checkpoint: the survivors' copies are the values there are
            return
        self.shards.load_shard_state(weights)
        for k in manifest["optimizer"]["like_states"]:
            into = {key: torch.empty_like(self.local[key]) for _, key, _ in self.opt_params}
            self.shards.load_shard_state(ShardReader(ckpt, own, f"held/optim/{k}/"), into=into)
            for p, key, where in self.opt_params:
                self.opt.state[p][k] = _region(into[key], where, p).clone()

    def _check_folder(self) -> None:
        """Raise ``OSError`` if the run folder is no longer the one this run started in."""
        run = self.root.parent
        if self.folder is None:
            run.mkdir(parents=True, exist_ok=True)
            self.folder = folder_id(run)
        check_same_folder(run, self.folder)

    def _open_staging(self, staging: Path) -> str:
        """A fresh staging folder with a new token in it (rank 0); returns the token."""
        self._check_folder()
        shutil.rmtree(staging, ignore_errors=True)  # leftovers of a crashed attempt
        staging.mkdir(parents=True)
        token = secrets.token_hex(16)
        write_atomic(staging / _TOKEN, token)
        return token

    def save_held(self, folder: Path, done: int) -> Path:
        """Everything this rank holds at step ``done`` (every held piece, not only its own, and
        their optimizer state) into ``folder``, with no collective: a survivor's contribution
        to a rescue ([Note: rescue] in train/rescue.py). Returns the contribution's record."""
        if self.zero is not None:
            raise CheckpointError("a ZeRO optimizer's state is sharded: nothing to rescue")
        held = _Held(self.shards)
        tensors = {f"model/{k}": v for k, v in held.shard_state().items()}
        optim, like, scalar = _optimizer_pieces(self.opt.state, self.opt_params, self.local, held)
        owned = sorted(self.shards.shard_state())  # the pieces its checkpoint file would hold
        return write_contribution(folder, rank=self.rank, world=self.world, step=done,
                                  tensors={**tensors, **optim}, owned=owned,
                                  manifest=self._manifest(done, {}, like, scalar))

    def _on_rank0(self, action: Callable[[], str], final: Path) -> str:
        """``action()`` on rank 0, its result broadcast; an ``OSError`` there fails all."""
        box: list[Any] = [None]
        if self.rank == 0:
            try:
                box[0] = ("", action())
            except OSError as e:
                box[0] = (f"rank 0 could not write it: {e}", "")
        dist.broadcast_object_list(box, src=0)
        error, value = box[0]
        if error:
            self._fail(final, error)
        return str(value)

    def _fail(self, final: Path, reason: str) -> NoReturn:
        if self.rank == 0 and self.folder is not None and _same(self.root.parent, self.folder):
            shutil.rmtree(staging_dir(self.root, int(final.name[5:])), ignore_errors=True)
        found = list_checkpoints(self.root)
        kept = (f"the newest intact checkpoint is {found[-1]}" if found else
                "no earlier checkpoint exists")
        raise CheckpointWriteError(
            f"writing checkpoint {final} failed ({reason}); its staging folder was removed and "
            f"{kept}; free space or fix the folder, then resume with --resume "
            f"{self.root.parent}")

    def _manifest(self, done: int, files: dict[str, Any], like: list[str],
                  scalar: list[str]) -> dict[str, Any]:
        groups = [{k: g[k] for k in ("lr", "initial_lr") if k in g} for g in self.opt.param_groups]
        return {
            "format": FORMAT, "version": VERSION, "step": done, "world": self.world,
            "strategy": self.cfg.strategy, "time": time.time(),
            "parent": self.parent,
            "plan": self.plan.to_dict(), **self.info, "config": self.cfg.to_dict(),
            "optimizer": {"class": type(self.opt).__name__, "like_states": like,
                          "scalar_states": scalar, "param_groups": groups,
                          "scheduler": _jsonable(self.sched.state_dict())},
            "files": files,
        }

    def restore(self, ckpt: Path) -> int:
        """Load checkpoint ``ckpt`` into this rank's model, optimizer, schedule and RNG; return
        the number of steps it had completed (the next step to run). Under ``--reshard`` the
        checkpoint may come from another world size or plan ([Note: resharded resume]); an
        elastic restart into a different world size reshards by itself."""
        manifest = _read_together(ckpt, self.rank, self.world, set(self.cfg.to_dict()))
        reshard = self.cfg.reshard or _restarted_into_another_world(manifest, self.world)
        check_compatible(manifest, ckpt, world=self.world, strategy=self.cfg.strategy,
                         plan=self.plan, model_state=self.info["model_state"], reshard=reshard)
        _verify_together(ckpt, manifest, self.rank, self.world)
        files = sorted(manifest["files"])
        try:
            step = self._load(manifest, PieceReader(ckpt, manifest, "model/"),
                              lambda prefix: PieceReader(ckpt, manifest, prefix),
                              lambda prefix: ShardReader(ckpt, files, prefix))
        except KeyError as e:
            raise CheckpointError(f"{ckpt}: {e.args[0]}") from e
        # a checkpoint of this run folder is the parent of the next (one from elsewhere is not)
        self.parent = ckpt.name if ckpt.parent.resolve() == self.root.resolve() else None
        same_plan = (manifest["world"] == self.world
                     and _normalised(self.plan.to_dict()) == _normalised(manifest["plan"]))
        if same_plan and self.holders_differ:  # each rank its own copies (another plan:
            self._load_own_copies(ckpt, manifest)  # the owners', as for any state)
        if not same_plan:  # the old ranks' RNG streams mean nothing to the new ranks
            reseed(self.cfg.seed, step, self.rank)
        else:
            own = ShardReader(ckpt, [shard_name(self.rank)], "rng/")
            if "torch" in own:
                _restore_rng(own, own.metadata(shard_name(self.rank)))
            else:  # a rescued checkpoint: the lost rank's streams are gone ([Note: rescue])
                reseed(self.cfg.seed, step, self.rank)
        return step


    def restore_held(self, held: HeldCheckpoint) -> int:
        """Load a checkpoint held in memory (a growing run's: [Note: growing a run] in
        train/grow.py) as ``restore`` loads the same checkpoint from files under
        ``--reshard``: the same values, the ranks reseeded; return its step."""
        step = self._load(held.manifest, PieceReader.in_memory(held, "model/"),
                          lambda prefix: PieceReader.in_memory(held, prefix), held.scalars)
        self.parent = held.manifest["parent"]
        reseed(self.cfg.seed, step, self.rank)
        return step

    def _load(self, manifest: dict[str, Any], model: Mapping[str, torch.Tensor],
              like: Readers, scalar: Readers) -> int:
        """Model, optimizer state and schedule from ``model``'s pieces and the optimizer's
        readers (by prefix); returns the step."""
        self.shards.load_shard_state(model)
        plain: dict[Any, dict[str, Any]] = {} if self.zero else self.opt.state
        _load_optimizer(plain, self.opt_params, self.local, self.shards, manifest["optimizer"],
                        like, scalar)
        if self.zero:
            self.zero.load_plain_state(plain)
        opt_info = manifest["optimizer"]
        self.sched.load_state_dict(opt_info["scheduler"])
        for group, saved in zip(self.opt.param_groups, opt_info["param_groups"], strict=True):
            group.update(saved)
        return int(manifest["step"])


# a checkpoint's tensors under a prefix (optimizer state: ``optim/<state>/``, and
# ``optim_scalar/<state>/``), from files or memory
Readers = Callable[[str], Mapping[str, torch.Tensor]]


class _Held:
    """A rank model's ``shard_state`` of every piece it holds, owned or not."""

    def __init__(self, model: RankModel) -> None:
        self.model = model
        self.to_plain = model.to_plain

    def shard_state(self, tensors: Mapping[str, torch.Tensor] | None = None
                    ) -> dict[str, torch.Tensor]:
        return self.model.shard_state(tensors, owned_only=False)


def _restarted_into_another_world(manifest: dict[str, Any], world: int) -> bool:
    """torch elastic restarted this group (``--nnodes MIN:MAX``) with another world size."""
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    return restarted and manifest["world"] != world


def _same(run: Path, folder: FolderId) -> bool:
    try:
        check_same_folder(run, folder)
    except OSError:
        return False
    return True


def _read_token(staging: Path) -> str | None:
    try:
        return (staging / _TOKEN).read_text()
    except OSError:
        return None


# -- optimizer state --------------------------------------------------------------------------
# An optimizer parameter is a local parameter or, under nb-sdp, a *slice parameter*: the held
# slice of a partly held weight (runtime/masking.py); the rank model says which
# (``RankModel.param_places``). State shaped like the parameter is placed into a tensor shaped
# like the local parameter and sharded exactly like it, so the owners of the pieces write it
# and a loading rank receives exactly the pieces it holds.
OptParam = tuple[torch.Tensor, str, tuple[int, int, int] | None]  # (param, local key, slice)


def _opt_params(groups: list[list[torch.Tensor]], model: RankModel) -> list[OptParam]:
    places = {id(p): (key, where) for p, key, where in model.param_places()}
    return [(p, *places[id(p)]) for group in groups for p in group]


def _region(
    t: torch.Tensor, where: tuple[int, int, int] | None, like: torch.Tensor
) -> torch.Tensor:
    view = t if where is None else t.narrow(where[0], where[1], where[2] - where[1])
    if view.shape != like.shape:
        raise RuntimeError(f"optimizer state of shape {tuple(like.shape)} does not fit its "
                           f"place {where} in a parameter of shape {tuple(t.shape)}")
    return view


def _optimizer_pieces(
    state: Mapping[Any, Mapping[str, Any]], params: list[OptParam],
    local: Mapping[str, torch.Tensor], shards: Any,
) -> tuple[dict[str, torch.Tensor], list[str], list[str]]:
    """Optimizer state (per parameter: ``opt.state``, or a ZeRO optimizer's plain view) as
    checkpoint tensors: state shaped like its parameter (``exp_avg``, ``momentum_buffer``)
    sharded like the parameter; scalars (``step``, identical on all holders) stored by whoever
    owns a piece of the parameter."""
    like: dict[str, dict[str, torch.Tensor]] = {}
    scalar: dict[str, dict[str, torch.Tensor]] = {}
    for p, key, where in params:
        for k, v in state.get(p, {}).items():
            if v is None:
                continue
            if torch.is_tensor(v) and v.ndim > 0 and v.shape == p.shape:
                v = shards.to_plain(v)  # an FSDP shard gathered whole (parameter order)
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


def _load_optimizer(state: Any, params: list[OptParam],
                    local: Mapping[str, torch.Tensor], shards: Any, info: dict[str, Any],
                    like: Readers, scalar: Readers) -> None:
    """Recreate the optimizer's per-parameter state (a fresh optimizer has none yet) in
    ``state`` (``opt.state``, a defaultdict; or a dict a ZeRO optimizer then loads) from
    the manifest's optimizer ``info`` and the readers."""
    for k in info["like_states"]:
        into = {key: torch.empty_like(local[key]) for _, key, _ in params}
        shards.load_shard_state(like(f"optim/{k}/"), into=into)
        for p, key, where in params:
            state.setdefault(p, {})[k] = shards.from_plain(
                p, _region(into[key], where, p).clone())
    for k in info["scalar_states"]:
        reader = scalar(f"optim_scalar/{k}/")
        missing = sorted({key for _, key, _ in params if key not in reader})
        if missing:
            raise KeyError(f"the checkpoint lacks optimizer {k!r} of {missing[:3]}")
        for p, key, _ in params:
            state.setdefault(p, {})[k] = reader[key].clone()


# -- RNG --------------------------------------------------------------------------------------
def seed_generators(seed: int) -> None:
    """Seed every generator a checkpoint keeps (torch, CUDA, numpy, Python), so that two runs
    with one seed hold the same random states and user code drawing from numpy or ``random``
    repeats too, not only after a resume."""
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


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
                     plan: Plan | None, model_state: list[Any] | None,
                     reshard: bool = False) -> None:
    """Refuse a checkpoint written for another world size, strategy, plan or model (with
    ``reshard``, another world size or plan is fine)."""
    if manifest["world"] != world and not reshard:
        raise CheckpointError(
            f"the checkpoint {ckpt} was written by {manifest['world']} workers but this run has "
            f"{world}; its plan assigns units to exactly {manifest['world']} workers, so resume "
            f"with --nproc {manifest['world']}, or add --reshard to re-plan it for {world}")
    if manifest["strategy"] != strategy:
        raise CheckpointError(f"the checkpoint {ckpt} is from a {manifest['strategy']!r} run, "
                              f"not {strategy!r}; resume with --strategy {manifest['strategy']}")
    if (plan is not None and not reshard
            and _normalised(plan.to_dict()) != _normalised(manifest["plan"])):
        raise CheckpointError(
            f"the checkpoint {ckpt} was written under a different plan than this run's; resume "
            "with the run's own plan (same --coverage/--scheme/--seed/--plan-file), or add "
            "--reshard to load it into this run's plan")
    if model_state is not None and _normalised(model_state) != manifest["model_state"]:
        raise CheckpointError(
            f"the checkpoint {ckpt} holds a different model (other entries or shapes) than this "
            "run builds; resume with the same --recipe and --model-arg options")


def _normalised(obj: Any) -> Any:
    return json.loads(json.dumps(obj))


def _read_together(ckpt: Path, rank: int, world: int, config_keys: set[str]
                   ) -> dict[str, Any]:
    """The manifest, read by every rank; ranks that cannot read it, or read another one, while
    rank 0 can, do not share the run folder (node-local ``--out``): say so on every rank."""
    manifest: dict[str, Any] | None = None
    error = ""
    try:
        manifest = read_manifest(ckpt, config_keys=config_keys)
    except CheckpointError as e:
        error = str(e)
    views: list[Any] = [None] * world
    dist.all_gather_object(views, (error, manifest["checksum"] if manifest else None))
    if views[0][0]:
        raise CheckpointUnusableError(views[0][0])
    other = next((r for r, (e, digest) in enumerate(views) if e or digest != views[0][1]), None)
    if other is not None:
        raise CheckpointUnusableError(
            f"rank {other} does not see the checkpoint {ckpt} that rank 0 sees "
            f"({views[other][0] or 'another manifest'}): the run folder must be one folder "
            "that every rank shares (a node-local --out is not); put --out on a shared "
            "filesystem")
    assert manifest is not None
    return manifest


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
        raise CheckpointUnusableError(first)


def run_info(recipe: Any, overrides: dict[str, Any], dtype: torch.dtype) -> dict[str, Any]:
    """What export and eval need to rebuild the plain model: the recipe, its overrides and the
    full model's state entries (key, shape, dtype) in the model's own order. ``dtype``: the
    master copy's, which the saved floating-point tensors have (``parallelize`` casts so)."""
    with torch.device("meta"):
        state = recipe.build_model(**overrides).to(dtype).state_dict()
    return {"recipe": recipe.name, "model_overrides": dict(overrides),
            "model_state": [[k, list(v.shape), str(v.dtype)] for k, v in state.items()]}
