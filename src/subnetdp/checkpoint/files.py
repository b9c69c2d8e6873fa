"""The files of a checkpoint: layout, atomic writes, checksums, manifest, listing, pruning.

No ``torch.distributed`` here: everything works on a plain folder, so ``subnetdp export`` and
``subnetdp eval`` read checkpoints without starting any process.

Layout of one checkpoint (``<run>/checkpoints/step_00000040/``)::

    rank00000.safetensors   what rank 0 owns: model pieces, optimizer state, its RNG states
    rank00001.safetensors   ...
    manifest.json           written last: step, world, plan, config, sha256 of every file

Tensor names inside a rank file: ``model/<piece>``, ``optim/<state>/<piece>`` (state tensors
shaped like their parameter, e.g. ``exp_avg``), ``optim_scalar/<state>/<key>`` (e.g. ``step``)
and ``rng/<generator>``; a run whose holders differ between syncs (local steps) adds this
rank's own copies, ``held/model/<piece>`` and ``held/optim/<state>/<piece>``. A *piece* is a
full-model state key, or ``key@dim:start:stop`` for a slice of it (see
``SubnetDataParallel.shard_state``).

[Note: atomic checkpoints]
Ranks write into a staging folder ``.step_<N>.partial``; each file is fsynced; rank 0 then
writes the manifest (with every file's size and sha256), fsyncs the folder and renames it to
``step_<N>``. A checkpoint without a manifest does not exist for readers, so a crash at any
moment leaves the previous checkpoints intact and never exposes half a checkpoint.

[Note: self-verifying manifests]
A manifest carries the sha256 of its own canonical JSON (``checksum``), so one flipped bit in it
(``"step": 20`` -> ``10``) is refused instead of resuming at the wrong data position. Every read
also checks its schema (types, known config keys), that its step is the folder's step, that its
files are exactly ``rank00000.safetensors`` ... for its world, and that each resolves to a plain
file inside the folder: a manifest naming ``../x`` or ``/etc/x``, or a shard that is a symlink out
of the folder, is refused before any tensor is read (``export``, ``eval``, ``--resume``).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
from collections.abc import Collection, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from subnetdp.checkpoint.coverage import MANIFEST_DTYPES, PieceInfo, coverage_problem
from subnetdp.filemode import share, write_atomic

FORMAT = "subnetdp-checkpoint"
# 2: the manifest's own checksum ([Note: self-verifying manifests]); 3: its ``parent``
# ([Note: checkpoint lineage]). Version 2 manifests are read too (they have no parent).
VERSION = 3
READABLE_VERSIONS = (2, 3)
MANIFEST = "manifest.json"
_STEP_DIR = re.compile(r"^step_(\d{8})$")
_SHARD = re.compile(r"^rank(\d{5})\.safetensors$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_STAGING = re.compile(r"^\.step_(\d{8})\.partial$")
_SLICE = re.compile(r"^(?P<key>.+)@(?P<dim>\d+):(?P<start>\d+):(?P<stop>\d+)$")


class CheckpointError(ValueError):
    """A checkpoint is missing, damaged or does not fit this run; the message says what to do."""


# -- layout -----------------------------------------------------------------------------------
def checkpoints_root(run_dir: str | os.PathLike[str]) -> Path:
    return Path(run_dir) / "checkpoints"


def step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:08d}"


def staging_dir(root: Path, step: int) -> Path:
    return root / f".step_{step:08d}.partial"


def shard_name(rank: int) -> str:
    return f"rank{rank:05d}.safetensors"


def list_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints (those with a manifest) under ``root``, oldest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _STEP_DIR.match(p.name) and (p / MANIFEST).is_file()]
    return sorted(found, key=lambda p: p.name)


def newest_checkpoint(root: Path) -> Path | None:
    """The newest complete checkpoint under ``root``, printing a one-line notice for each newer
    step folder that is skipped because it has no manifest (a write that never finished)."""
    found = list_checkpoints(root)
    if not found:
        return None
    newest = found[-1]
    skipped = sorted(p.name for p in root.iterdir()
                     if (m := _STEP_DIR.match(p.name) or _STAGING.match(p.name))
                     and int(m[1]) > int(newest.name[5:]) and not (p / MANIFEST).is_file())
    for name in skipped:
        if root / name not in _NOTICED:  # once per process (forked workers inherit the set)
            _NOTICED.add(root / name)
            print(f"notice: skipping {root / name}: it has no {MANIFEST} (its write never "
                  f"finished); using {newest}", file=sys.stderr)
    return newest


_NOTICED: set[Path] = set()


def resolve_checkpoint(path: str | os.PathLike[str]) -> Path:
    """A checkpoint folder from a run folder (its latest checkpoint), a ``checkpoints`` folder
    or a ``step_<N>`` folder. Raises ``CheckpointError`` saying what was found instead."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"{p} does not exist; pass a run folder (runs/NAME) or one of "
                              "its checkpoints (runs/NAME/checkpoints/step_00000040)")
    if (p / MANIFEST).is_file():
        return p
    if _STEP_DIR.match(p.name):
        raise CheckpointError(f"{p} has no {MANIFEST}: the checkpoint was never completed "
                              "(the run stopped while writing it); use an earlier one")
    for root in (checkpoints_root(p), p):
        newest = newest_checkpoint(root) if root.is_dir() else None
        if newest is not None:
            return newest
    raise CheckpointError(f"{p} holds no complete checkpoint: a run saves its state at its end "
                          "(unless --no-final-ckpt) and every --ckpt-every N steps, and this "
                          "one ended before either; train again")


# -- writing ----------------------------------------------------------------------------------
def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def fsync_dir(path: Path) -> None:
    """Make a rename or new entry in ``path`` durable (the folder's own metadata)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_shard(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> dict[
    str, Any
]:
    """Write one rank's file, fsync it and return its manifest entry (size, sha256)."""
    save_file(tensors, str(path), metadata=metadata)
    share(path)  # safetensors writes 0600 whatever the umask
    with open(path, "rb+") as f:
        os.fsync(f.fileno())
    return {"bytes": path.stat().st_size, "sha256": sha256_file(path)}


def write_json_durable(path: Path, obj: Any) -> None:
    """``obj`` as JSON at ``path`` through a temporary name, fsync and rename."""
    write_atomic(path, json.dumps(obj, indent=1) + "\n", durable=True)


def manifest_checksum(manifest: dict[str, Any]) -> str:
    """sha256 of the manifest's canonical JSON, its own ``checksum`` entry left out."""
    body = {k: v for k, v in manifest.items() if k != "checksum"}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=True)
    return hashlib.sha256(text.encode()).hexdigest()


def write_manifest(ckpt: Path, manifest: dict[str, Any]) -> None:
    """The manifest, sealed with its checksum, written durably into ``ckpt``."""
    body = _normalise_json({k: v for k, v in manifest.items() if k != "checksum"})
    write_json_durable(ckpt / MANIFEST, {**body, "checksum": manifest_checksum(body)})


def _normalise_json(obj: Any) -> Any:
    """``obj`` as it reads back from JSON (tuples -> lists), so the checksum is of what is read."""
    return json.loads(json.dumps(obj))


def publish(staging: Path, final: Path) -> None:
    """Rename a finished staging folder to its final name (see [Note: atomic checkpoints]).

    A folder already at ``final`` (the same step written by an earlier attempt, e.g. a run
    resumed from an older checkpoint) is first moved aside, so at every moment one complete
    checkpoint of that step exists, and only then deleted."""
    fsync_dir(staging)
    old = final.with_name(f".{final.name}.old")
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(staging, final)
    fsync_dir(final.parent)
    shutil.rmtree(old, ignore_errors=True)


# [Note: checkpoint lineage]
# Each manifest names its ``parent``: the checkpoint whose state the run continued (the one
# resumed from, or the one written before it; None for a run's first). A run resumed from an
# older checkpoint writes checkpoints whose names interleave with those of the trajectory it
# abandoned (``rundir.set_aside_newer`` moves those aside first), so "the newest K names" is
# not "this run's newest K": pruning keeps the newest ``keep`` checkpoints of the lineage of
# the one just published, and deletes the others.
def lineage(ckpt: Path) -> list[Path]:
    """``ckpt`` and the checkpoints of its root that it continues, newest first. A manifest
    without a parent entry (version 2, or one that cannot be read) continues the next older
    checkpoint by name; the chain stops at a parent that is gone (pruned, set aside)."""
    chain: list[Path] = []
    current: Path | None = ckpt
    while current is not None and current not in chain:
        chain.append(current)
        try:
            manifest: dict[str, Any] = read_manifest(current)
        except CheckpointError:
            manifest = {}
        if "parent" in manifest:
            parent = manifest["parent"]
            current = ckpt.parent / parent if parent and _STEP_DIR.match(parent) else None
            if current is not None and not (current / MANIFEST).is_file():
                current = None
        else:
            older = [p for p in list_checkpoints(ckpt.parent) if p.name < current.name]
            current = older[-1] if older else None
    return chain


def prune(root: Path, keep: int, *, newest: Path | None = None) -> list[Path]:
    """Keep the newest ``keep`` checkpoints of the lineage of ``newest`` (default: the newest
    by name) and delete the other complete checkpoints ([Note: checkpoint lineage]) and what
    crashed attempts left (staging folders, folders without a manifest); return the
    checkpoints deleted. Call it only while no checkpoint is being written (rank 0, right after
    ``publish``)."""
    found = list_checkpoints(root)
    kept = set(lineage(newest or found[-1])[:keep]) if keep > 0 and found else set(found)
    doomed = [p for p in found if p not in kept]
    for p in doomed:
        # Removing the manifest first makes a half-deleted folder read as incomplete.
        (p / MANIFEST).unlink(missing_ok=True)
        shutil.rmtree(p, ignore_errors=True)
    for p in root.iterdir():
        stale = p.name.startswith(".step_") or (_STEP_DIR.match(p.name) and not
                                                 (p / MANIFEST).is_file())
        if stale and p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
    return doomed


# -- reading ----------------------------------------------------------------------------------
def read_manifest(ckpt: Path, *, config_keys: Collection[str] | None = None) -> dict[str, Any]:
    """The manifest of checkpoint folder ``ckpt``, verified ([Note: self-verifying manifests]).
    ``config_keys``: the training configuration's fields (``train.config.config_keys()``);
    a manifest whose config has others is refused (None: the config is not checked)."""
    path = ckpt / MANIFEST
    if path.is_symlink():  # [Note: no links inside a run folder] (filemode.py)
        raise CheckpointError(f"{path} is a symbolic link; a checkpoint's files are never read "
                              "through links: remove it (nothing was read)")
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing; {ckpt} is not a complete checkpoint") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is damaged (not valid JSON: {e}); use an earlier "
                              "checkpoint") from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a subnetdp checkpoint manifest")
    if manifest.get("version") not in READABLE_VERSIONS:
        raise CheckpointError(f"{path} has format version {manifest.get('version')}; this "
                              f"subnetdp reads version {VERSION}")
    if manifest.get("checksum") != manifest_checksum(manifest):
        raise CheckpointError(f"{path} does not match its own checksum: it was damaged or "
                              "edited; use an earlier checkpoint (nothing was read)")
    _check_schema(manifest, path, config_keys)
    folder = _STEP_DIR.match(ckpt.name)
    if folder is not None and int(folder[1]) != manifest["step"]:
        raise CheckpointError(f"{path} says step {manifest['step']} but lies in {ckpt.name}: "
                              "the checkpoint was moved or edited; use an earlier checkpoint")
    check_file_names(ckpt, manifest)
    return manifest


# Manifest entries and their JSON types (bool is not an int here).
_SCHEMA: dict[str, type | tuple[type, ...]] = {
    "format": str, "version": int, "checksum": str, "step": int, "world": int, "strategy": str,
    "time": (int, float), "plan": dict, "recipe": str, "model_overrides": dict,
    "model_state": list, "config": dict, "optimizer": dict, "files": dict,
}
# Entries a manifest may lack (written before they existed): the run's data ([Note: data
# identity] in data/tokens.py); the Hugging Face folder a run started from (train --init-from).
_OPTIONAL: dict[str, type] = {"data": dict, "init_from": dict}
_OPTIMIZER_SCHEMA: dict[str, type] = {"class": str, "like_states": list, "scalar_states": list,
                                      "param_groups": list, "scheduler": dict}


def _check_schema(manifest: dict[str, Any], path: Path, config_keys: Collection[str] | None
                  ) -> None:
    def bad(what: str) -> CheckpointError:
        return CheckpointError(f"{path} is not a valid manifest ({what}); use an earlier "
                               "checkpoint")

    def typed(d: dict[str, Any], schema: dict[str, Any], where: str) -> None:
        for key, kind in schema.items():
            if key not in d:
                raise bad(f"no {where}{key!r}")
            if isinstance(d[key], bool) or not isinstance(d[key], kind):
                raise bad(f"{where}{key!r} is a {type(d[key]).__name__}")

    typed(manifest, _SCHEMA, "")
    typed(manifest, {k: v for k, v in _OPTIONAL.items() if k in manifest}, "")
    if manifest["version"] >= 3:
        typed(manifest, {"parent": (str, type(None))}, "")
    extra = sorted(set(manifest) - set(_SCHEMA) - set(_OPTIONAL) - {"parent"})
    if extra:
        raise bad(f"unknown entries {extra}")
    if manifest["step"] < 0 or manifest["world"] < 1:
        raise bad(f"step {manifest['step']}, world {manifest['world']}")
    typed(manifest["optimizer"], _OPTIMIZER_SCHEMA, "optimizer ")
    unknown = sorted(set(manifest["config"]) - set(config_keys)) if config_keys is not None else []
    if unknown:
        raise bad(f"unknown config keys {unknown[:5]}")
    for entry in manifest["model_state"]:
        if not (isinstance(entry, list) and len(entry) == 3 and isinstance(entry[0], str)
                and isinstance(entry[1], list) and entry[2] in MANIFEST_DTYPES
                and all(type(n) is int and n >= 0 for n in entry[1])):
            raise bad(f"model_state entry {json.dumps(entry)[:80]} is not [key, shape, dtype]")
    for name, entry in manifest["files"].items():
        if not (isinstance(entry, dict) and isinstance(entry.get("bytes"), int)
                and isinstance(entry.get("sha256"), str) and _SHA256.match(entry["sha256"])):
            raise bad(f"file entry {name!r} is not {{bytes, sha256}}")


def check_file_names(ckpt: Path, manifest: dict[str, Any]) -> None:
    """The manifest's files are exactly the rank files of its world, and each resolves to a
    path inside ``ckpt`` (no ``..``, absolute names or symlinks out of the folder)."""
    names = set(manifest["files"])
    want = {shard_name(r) for r in range(manifest["world"])}
    if names != want:
        odd = sorted(names - want) or [f"none of {sorted(want - names)[:3]}"]
        raise CheckpointError(
            f"{ckpt / MANIFEST} lists files {odd[:3]}: a checkpoint of {manifest['world']} "
            f"workers holds exactly rank00000.safetensors .. {shard_name(manifest['world'] - 1)}"
            "; refused (nothing was read)")
    inside = ckpt.resolve()
    for name in sorted(names):
        target = (ckpt / name).resolve()
        if target.parent != inside:
            raise CheckpointError(f"checkpoint file {ckpt / name} resolves to {target}, outside "
                                  f"the checkpoint folder; refused (nothing was read)")


def verify_files(ckpt: Path, manifest: dict[str, Any], names: list[str] | None = None) -> None:
    """Check that each listed file exists with the manifest's size and sha256."""
    files: dict[str, dict[str, Any]] = manifest["files"]
    for name in files if names is None else names:
        path, want = ckpt / name, files[name]
        if not path.is_file():
            raise CheckpointError(f"checkpoint file {path} is missing; the checkpoint is "
                                  "incomplete, use an earlier one")
        size = path.stat().st_size
        if size != want["bytes"]:
            raise CheckpointError(
                f"checkpoint file {path} is {size} bytes but the manifest says "
                f"{want['bytes']}: it is truncated or damaged; use an earlier checkpoint")
        if sha256_file(path) != want["sha256"]:
            raise CheckpointError(
                f"checkpoint file {path} does not match its sha256 checksum in the manifest: "
                "it is corrupt; use an earlier checkpoint")


class ShardReader(Mapping[str, torch.Tensor]):
    """The union of the tensors under ``prefix`` in a checkpoint's rank files, read lazily.

    Only the tensors a caller asks for are read (safetensors maps the file), so a worker loads
    just the pieces it holds."""

    def __init__(self, ckpt: Path, names: list[str], prefix: str) -> None:
        self._ckpt = ckpt
        self._files: dict[str, Any] = {}
        self._where: dict[str, tuple[str, str]] = {}
        # a key in several files (a scalar optimizer state every owner of a slice stores): each
        # copy must hold the same values, never the last file's silently
        self._copies: dict[str, list[tuple[str, str]]] = {}
        for name in names:
            if not _SHARD.match(name):  # read_manifest refuses these first; never open one
                raise CheckpointError(f"{name!r} is not a checkpoint rank file name; refused")
            path = ckpt / name
            try:
                handle = safe_open(str(path), framework="pt")
            except Exception as e:  # safetensors raises its own error types for bad headers
                raise CheckpointError(f"checkpoint file {path} cannot be read ({e}): it is "
                                      "truncated or corrupt; use an earlier checkpoint") from e
            self._files[name] = handle
            for full in handle.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                if full.startswith(prefix):
                    key = full[len(prefix):]
                    if key in self._where:
                        self._copies.setdefault(key, [self._where[key]]).append((name, full))
                    self._where[key] = (name, full)

    def __getitem__(self, key: str) -> torch.Tensor:
        name, full = self._where[key]
        tensor = self._files[name].get_tensor(full)
        for other, other_full in self._copies.get(key, []):
            copy = self._files[other].get_tensor(other_full)
            if copy.dtype != tensor.dtype or not torch.equal(copy, tensor):
                raise CheckpointError(
                    f"{self._ckpt}: {full!r} is in {other} and {name} with different values; "
                    "the checkpoint is damaged or was edited, use an earlier one (nothing was "
                    "loaded)")
        return tensor

    def info(self, key: str) -> PieceInfo:
        """The piece's shape and dtype from its file's header (no data read)."""
        name, full = self._where[key]
        where = split_piece(key)[1]
        view = self._files[name].get_slice(full)
        return PieceInfo(key, name, where, tuple(view.get_shape()), view.get_dtype())

    def __contains__(self, key: object) -> bool:  # without reading the tensor
        return key in self._where

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)

    def metadata(self, name: str) -> dict[str, str]:
        return dict(self._files[name].metadata() or {})


def split_piece(piece: str) -> tuple[str, tuple[int, int, int] | None]:
    """``"w@0:4:8"`` -> ``("w", (0, 4, 8))``; a whole entry -> ``(key, None)``."""
    m = _SLICE.match(piece)
    if m is None:
        return piece, None
    return m["key"], (int(m["dim"]), int(m["start"]), int(m["stop"]))


def check_pieces(ckpt: Path, manifest: dict[str, Any], pieces: ShardReader, *,
                 with_dtype: bool) -> dict[str, list[str]]:
    """The pieces of ``pieces`` by entry, each entry's checked to rebuild its manifest shape
    (and dtype, ``with_dtype``) exactly ([Note: piece coverage]); else ``CheckpointError``, one
    line naming the checkpoint, the entry and the piece. Reads headers only, allocates nothing."""
    by_key: dict[str, list[str]] = {}
    for piece in pieces:
        by_key.setdefault(split_piece(piece)[0], []).append(piece)
    entries = {k: (shape, dtype) for k, shape, dtype in manifest["model_state"]}
    budget = sum(int(f["bytes"]) for f in manifest["files"].values())
    for key, found in by_key.items():
        if key not in entries:
            raise CheckpointError(f"{ckpt}: the piece {found[0]!r} names no entry of the "
                                  "manifest's model_state; the checkpoint is damaged or was "
                                  "edited, use an earlier one (nothing was assembled)")
        shape, dtype = entries[key]
        problem = coverage_problem(key, shape, MANIFEST_DTYPES[dtype] if with_dtype else None,
                                   [pieces.info(p) for p in found], budget)
        if problem is not None:
            raise CheckpointError(f"{ckpt}: {problem}; the checkpoint is damaged or was edited, "
                                  "use an earlier one (nothing was assembled)")
    return by_key


def model_shapes(manifest: dict[str, Any]) -> dict[str, list[int]]:
    return {k: list(shape) for k, shape, _ in manifest["model_state"]}


def assemble_full_state(ckpt: Path, manifest: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The full model's state dict (keys in the model's own order) from all ranks' pieces,
    each entry's pieces checked before it is allocated ([Note: piece coverage])."""
    pieces = ShardReader(ckpt, list(manifest["files"]), "model/")
    by_key = check_pieces(ckpt, manifest, pieces, with_dtype=True)
    out: dict[str, torch.Tensor] = {}
    for key, shape, dtype in manifest["model_state"]:
        if key not in by_key:
            raise CheckpointError(f"the checkpoint {ckpt} has no piece of {key!r}; it is "
                                  "incomplete")
        full = torch.empty(shape, dtype=MANIFEST_DTYPES[dtype])
        for piece in by_key[key]:
            where = split_piece(piece)[1]
            view = full if where is None else full.narrow(where[0], where[1], where[2] - where[1])
            view.copy_(pieces[piece])
        out[key] = full
    return out
