"""Rescue, the launcher's side: compose a checkpoint from what the survivors of a lost worker
saved ([Note: rescue] in train/rescue.py). No ``torch.distributed`` here: the launching process
reads plain files after the group is gone.

Layout: ``<run>/rescue/attempt_<A>/step_<S>.rank<R>.safetensors`` (every piece rank ``R`` held
at step ``S``, and their optimizer state) and ``step_<S>.rank<R>.json`` (written last: the
contribution's manifest, the pieces the rank's checkpoint file would own and a sha256 of every
tensor). ``A`` is torch elastic's restart count, so a restarted group never mixes with the
previous one; the launcher empties the folder before each group starts.

The composed checkpoint is an ordinary one of the lost group's world and plan, published as
``checkpoints/step_<S>`` (never over an existing one: that is the same step's, already
complete): each piece goes into its owner's file, as the uninterrupted run writes it; the
pieces of a lost rank go into its file. It carries no RNG streams.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from subnetdp.checkpoint.files import (
    FORMAT,
    checkpoints_root,
    publish,
    shard_name,
    split_piece,
    staging_dir,
    step_dir,
    write_json_durable,
    write_manifest,
    write_shard,
)
from subnetdp.filemode import LinkedFileError, check_no_links

__all__ = ["RescueUnavailableError", "clear_rescue", "compose_rescue", "rescue_attempt_dir",
           "rescue_root", "rescue_step", "write_contribution"]

_RECORD = re.compile(r"^step_(\d{8})\.rank(\d{5})\.json$")


class RescueUnavailableError(Exception):
    """No checkpoint can be composed; the message says why, in one line."""


def rescue_root(run_dir: str | os.PathLike[str]) -> Path:
    return Path(run_dir) / "rescue"


def rescue_attempt_dir(run_dir: str | os.PathLike[str]) -> Path:
    """This worker group's folder (torch elastic restarts a group with a new count)."""
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    return rescue_root(run_dir) / f"attempt_{restart}"


def clear_rescue(run_dir: str | os.PathLike[str]) -> None:
    """Remove an earlier group's contributions, before a group starts; a link at ``rescue``
    is refused ([Note: no links inside a run folder]), never followed nor removed."""
    check_no_links(Path(run_dir), ("rescue",))
    shutil.rmtree(rescue_root(run_dir), ignore_errors=True)


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def write_contribution(folder: Path, *, rank: int, world: int, step: int,
                       tensors: dict[str, torch.Tensor], owned: list[str],
                       manifest: dict[str, Any]) -> Path:
    """One survivor's state at ``step``: its tensors, then (last, durably) its record; never
    through a link planted in the rescue folder ([Note: no links inside a run folder])."""
    check_no_links(folder.parent.parent, (folder.parent.name,))
    folder.mkdir(parents=True, exist_ok=True)
    name = f"step_{step:08d}.rank{rank:05d}"
    write_shard(folder / f"{name}.safetensors", tensors, {"format": FORMAT, "rank": str(rank)})
    record = folder / f"{name}.json"
    write_json_durable(record, {
        "step": step, "rank": rank, "world": world, "owned": owned,
        "digests": {k: _digest(v) for k, v in tensors.items()}, "manifest": manifest})
    return record


def compose_rescue(run_dir: str | os.PathLike[str],
                   silent: Sequence[int] = ()) -> tuple[Path, int, list[int]]:
    """Compose the checkpoint of the newest step every survivor saved; return its folder, its
    step and the survivors' ranks. ``silent``: ranks their peers named as silent (a slow rank
    that came back after they gave up: lost, whatever it saved). ``RescueUnavailableError``
    says why not."""
    folder, step, at, sources, lost = _gather(run_dir, silent)
    manifest = at[min(at)]["manifest"]
    files = _assign(at, sources, lost, at[min(at)]["world"])
    ckpt = step_dir(checkpoints_root(run_dir), step)
    if not ckpt.exists():
        _write(folder, step, files, sources, at, manifest, ckpt)
    return ckpt, step, sorted(at)


def rescue_step(run_dir: str | os.PathLike[str]) -> int:
    """The step ``compose_rescue`` would compose, checked as it checks it, writing nothing."""
    return _gather(run_dir)[1]


def _gather(run_dir: str | os.PathLike[str], silent: Sequence[int] = ()) -> tuple[
        Path, int, dict[int, dict[str, Any]], dict[str, tuple[int, str]], list[int]]:
    """The newest attempt's folder, the newest common step, the survivors' records at it,
    each tensor's source and the lost ranks; ``RescueUnavailableError`` when they make no
    checkpoint (a link under ``rescue``: its contents are never read, [Note: no links inside a
    run folder])."""
    try:
        check_no_links(Path(run_dir), ("rescue",))
    except LinkedFileError as e:
        raise RescueUnavailableError(str(e).split("; ")[0]) from None
    attempts = sorted(rescue_root(run_dir).glob("attempt_*"),
                      key=lambda p: int(p.name.split("_")[1]))
    records: dict[int, dict[int, dict[str, Any]]] = {}  # rank -> step -> record
    folder = attempts[-1] if attempts else None
    for path in sorted(folder.iterdir()) if folder else []:
        m = _RECORD.match(path.name)
        if m and int(m[2]) not in silent:
            records.setdefault(int(m[2]), {})[int(m[1])] = json.loads(path.read_text())
    if folder is None or not records:
        raise RescueUnavailableError("no survivor saved its state")
    world = next(iter(next(iter(records.values())).values()))["world"]
    lost = sorted(set(range(world)) - set(records))
    if not lost:
        raise RescueUnavailableError("every rank saved its state: no worker was lost")
    common = set.intersection(*(set(by_step) for by_step in records.values()))
    if not common:
        seen = {r: sorted(by_step) for r, by_step in sorted(records.items())}
        raise RescueUnavailableError(f"the survivors saved no common step ({seen})")
    step = max(common)
    at = {r: by_step[step] for r, by_step in sorted(records.items())}
    sources = _sources(at, step)
    _check_coverage(sources, at[min(at)]["manifest"], lost)
    return folder, step, at, sources, lost


def _sources(at: dict[int, dict[str, Any]], step: int) -> dict[str, tuple[int, str]]:
    """Each tensor's first survivor and digest; copies from other holders must match it."""
    sources: dict[str, tuple[int, str]] = {}
    for rank, record in at.items():
        for name, digest in record["digests"].items():
            first = sources.setdefault(name, (rank, digest))
            if first[1] != digest:
                raise RescueUnavailableError(
                    f"ranks {first[0]} and {rank} hold different copies of {name} at step "
                    f"{step} (checksums differ)")
    return sources


def _check_coverage(sources: dict[str, Any], manifest: dict[str, Any], lost: list[int]) -> None:
    """Every entry of the model, and of each optimizer state present, is covered whole."""
    shapes = {k: shape for k, shape, _ in manifest["model_state"]}
    for prefix in ["model/"] + [f"optim/{k}/" for k in manifest["optimizer"]["like_states"]]:
        covered: dict[str, int] = {}
        for name in sources:
            if name.startswith(prefix):
                key, where = split_piece(name[len(prefix):])
                covered[key] = covered.get(key, 0) + _numel(shapes[key], where)
        keys = shapes if prefix == "model/" else covered
        for key in keys:
            if covered.get(key, 0) != _numel(shapes[key], None):
                raise RescueUnavailableError(
                    f"{prefix}{key} had no surviving holder (lost rank(s) {lost} held it "
                    "alone): a single-holder plan (use --min-holders 2)")


def _numel(shape: list[int], where: tuple[int, int, int] | None) -> int:
    n = 1
    for i, size in enumerate(shape):
        n *= (where[2] - where[1]) if where is not None and i == where[0] else size
    return n


def _assign(at: dict[int, dict[str, Any]], sources: dict[str, Any], lost: list[int],
            world: int) -> dict[int, list[str]]:
    """Tensor names per rank file: a piece (model and optimizer state) in its owner's file,
    the pieces no survivor owns in the first lost rank's; a scalar optimizer state with every
    piece of its parameter, as ``Checkpointer.save`` stores them."""
    owner = {piece: r for r, record in at.items() for piece in record["owned"]}
    files: dict[int, list[str]] = {r: [] for r in range(world)}
    keys_of: dict[int, set[str]] = {r: set() for r in range(world)}
    for name in sources:
        if name.startswith("optim_scalar/"):
            continue
        piece = name.split("/", 1)[1] if name.startswith("model/") else name.split("/", 2)[2]
        r = owner.get(piece, lost[0])
        files[r].append(name)
        if name.startswith("optim/"):
            keys_of[r].add(split_piece(piece)[0])
    for name in sources:
        if name.startswith("optim_scalar/"):
            key = name.split("/", 2)[2]
            for r in range(world):
                if key in keys_of[r]:
                    files[r].append(name)
    return files


def _write(folder: Path, step: int, files: dict[int, list[str]],
           sources: dict[str, tuple[int, str]], at: dict[int, dict[str, Any]],
           manifest: dict[str, Any], ckpt: Path) -> None:
    root = ckpt.parent
    staging = staging_dir(root, step)
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    handles = {r: safe_open(str(folder / f"step_{step:08d}.rank{r:05d}.safetensors"),
                            framework="pt") for r in at}
    entries = {}
    for rank, names in files.items():
        tensors = {n: handles[sources[n][0]].get_tensor(n) for n in names}
        entries[shard_name(rank)] = write_shard(staging / shard_name(rank), tensors,
                                                {"format": FORMAT, "rank": str(rank)})
    opt = manifest["optimizer"]
    like = sorted({k for record in at.values()
                   for k in record["manifest"]["optimizer"]["like_states"]})
    scalar = sorted({k for record in at.values()
                     for k in record["manifest"]["optimizer"]["scalar_states"]})
    write_manifest(staging, {**manifest, "time": time.time(), "files": entries,
                             "optimizer": {**opt, "like_states": like, "scalar_states": scalar}})
    publish(staging, ckpt)

