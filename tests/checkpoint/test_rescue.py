"""Rescue, in process: the launcher composes a checkpoint from the survivors' contributions only
when every piece has a surviving holder, all are at one step and copies agree ([Note: rescue]);
otherwise it says why in one line. The launched oracle is tests/faults/test_rescue_oracle.py."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

from subnetdp.checkpoint.files import read_manifest, step_dir
from subnetdp.checkpoint.rescue import (
    RescueUnavailableError,
    compose_rescue,
    rescue_attempt_dir,
    write_contribution,
)
from subnetdp.train.config import TrainConfig
from subnetdp.train.elastic import rescued_config
from subnetdp.train.rescue import rescue_blocker

WORLD = 3
# a unit "a" held by ranks 0, 1; a weight "b" in two slices, held by {1, 2} and {0, 2}; a
# shared entry "s" held by all. The owner of a piece is its lowest holder.
HOLDERS = {"a": [0, 1], "b@0:0:1": [1, 2], "b@0:1:2": [0, 2], "s": [0, 1, 2]}


def _manifest(step: int) -> dict[str, Any]:
    return {"format": "subnetdp-checkpoint", "version": 2, "step": step, "world": WORLD,
            "strategy": "b-sdp", "time": 0.0, "plan": {}, "recipe": "toy",
            "model_overrides": {}, "config": {},
            "model_state": [["a", [4], "torch.float32"], ["b", [2, 4], "torch.float32"],
                            ["s", [3], "torch.float32"]],
            "optimizer": {"class": "AdamW", "like_states": ["exp_avg"],
                          "scalar_states": ["step"], "param_groups": [{"lr": 0.1}],
                          "scheduler": {}},
            "files": {}}


def _value(piece: str, step: int) -> torch.Tensor:
    shape = {"a": [4], "s": [3]}.get(piece, [1, 4])
    return torch.full(shape, float(step)) + len(piece)


def _contribute(run: Path, rank: int, step: int, holders: dict[str, list[int]] = HOLDERS,
                tamper: str | None = None) -> None:
    held = [p for p, ranks in holders.items() if rank in ranks]
    tensors: dict[str, torch.Tensor] = {}
    for p in held:
        tensors[f"model/{p}"] = _value(p, step) + (1 if p == tamper else 0)
        if p != "s":  # the shared entry is a buffer here: no optimizer state
            tensors[f"optim/exp_avg/{p}"] = _value(p, step) * 2
            tensors[f"optim_scalar/step/{p.split('@')[0]}"] = torch.tensor(float(step))
    owned = [p for p in held if min(holders[p]) == rank]
    write_contribution(rescue_attempt_dir(run), rank=rank, world=WORLD, step=step,
                       tensors=tensors, owned=owned, manifest=_manifest(step))


def _file(ckpt: Path, rank: int) -> dict[str, torch.Tensor]:
    h = safe_open(str(ckpt / f"rank{rank:05d}.safetensors"), framework="pt")
    return {k: h.get_tensor(k) for k in h.keys()}  # noqa: SIM118


def test_composes_each_piece_into_its_owners_file(tmp_path: Path) -> None:
    for rank in (1, 2):  # rank 0 lost; rank 1 also rolled forward to step 5, rank 2 did not
        _contribute(tmp_path, rank, 4)
    _contribute(tmp_path, 1, 5)
    ckpt, step, survivors = compose_rescue(tmp_path)
    assert (ckpt, step, survivors) == (step_dir(tmp_path / "checkpoints", 4), 4, [1, 2])
    manifest = read_manifest(ckpt)
    assert manifest["step"] == 4 and manifest["world"] == WORLD
    files = [_file(ckpt, r) for r in range(WORLD)]
    # the lost owner's pieces (a, b@0:1:2, s) in its own file; rank 1 owns b@0:0:1; rank 2 none
    assert sorted(files[0]) == ["model/a", "model/b@0:1:2", "model/s", "optim/exp_avg/a",
                                "optim/exp_avg/b@0:1:2", "optim_scalar/step/a",
                                "optim_scalar/step/b"]
    assert sorted(files[1]) == ["model/b@0:0:1", "optim/exp_avg/b@0:0:1",
                                "optim_scalar/step/b"]
    assert files[2] == {}
    assert torch.equal(files[0]["model/b@0:1:2"], _value("b@0:1:2", 4))


def test_takes_the_newest_common_step(tmp_path: Path) -> None:
    for rank in (1, 2):
        _contribute(tmp_path, rank, 4)
        _contribute(tmp_path, rank, 5)  # both ready: both rolled forward
    assert compose_rescue(tmp_path)[1] == 5


@pytest.mark.parametrize(("case", "message"), [
    ("none", "no survivor saved its state"),
    ("all", "every rank saved its state: no worker was lost"),
    ("steps", "the survivors saved no common step ({1: [5], 2: [4]})"),
    ("tampered", "ranks 1 and 2 hold different copies of model/s at step 4 (checksums differ)"),
    ("single", "model/b had no surviving holder (lost rank(s) [0] held it alone)"),
])
def test_refuses_with_one_line(tmp_path: Path, case: str, message: str) -> None:
    if case == "all":
        for rank in range(WORLD):
            _contribute(tmp_path, rank, 4)
    elif case == "steps":
        _contribute(tmp_path, 1, 5)
        _contribute(tmp_path, 2, 4)
    elif case == "tampered":
        _contribute(tmp_path, 1, 4)
        _contribute(tmp_path, 2, 4, tamper="s")
    elif case == "single":  # b@0:1:2 held by rank 0 alone
        holders = {**HOLDERS, "b@0:1:2": [0]}
        _contribute(tmp_path, 1, 4, holders)
        _contribute(tmp_path, 2, 4, holders)
    with pytest.raises(RescueUnavailableError) as e:
        compose_rescue(tmp_path)
    assert message in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "checkpoints").exists()  # nothing written


def test_an_existing_checkpoint_is_not_overwritten(tmp_path: Path) -> None:
    for rank in (1, 2):
        _contribute(tmp_path, rank, 4)
    ckpt = step_dir(tmp_path / "checkpoints", 4)
    ckpt.mkdir(parents=True)
    (ckpt / "manifest.json").write_text("the run's own")
    assert compose_rescue(tmp_path)[0] == ckpt
    assert (ckpt / "manifest.json").read_text() == "the run's own"


def _cfg(tmp_path: Path, **kw: Any) -> TrainConfig:
    return TrainConfig(recipe="llama-tiny", strategy="b-sdp", nproc=4, min_nproc=3,
                       ckpt_every=5, out=str(tmp_path), **kw)


@pytest.mark.parametrize(("kw", "reason"), [
    ({"zero": 2}, "--zero 2 shards each holder group's optimizer state"),
    ({"fsdp": True}, "--fsdp shards each holder group's parameters"),
])
def test_sharded_holder_groups_fall_back_with_a_reason(tmp_path: Path, kw: dict[str, Any],
                                                       reason: str) -> None:
    cfg = _cfg(tmp_path, **kw)
    assert reason in str(rescue_blocker(cfg))
    assert rescued_config(cfg) == (None, rescue_blocker(cfg))
    # --no-rescue, or no --min-nproc: rescue is not in play, and nothing is said
    assert rescued_config(dataclasses.replace(cfg, rescue=False)) == (None, "")
    assert rescued_config(dataclasses.replace(cfg, min_nproc=None)) == (None, "")


def test_rescued_config_goes_on_with_the_survivors(tmp_path: Path) -> None:
    for rank in (1, 2):
        _contribute(tmp_path, rank, 4)
    cfg = dataclasses.replace(_cfg(tmp_path), nproc=WORLD, min_nproc=2)
    smaller, line = rescued_config(cfg)
    assert smaller is not None and smaller.nproc == 2 and smaller.reshard
    assert smaller.resume == str(step_dir(tmp_path / "checkpoints", 4))
    assert "rank(s) [0] of 3 lost; rescued step 4" in line and "no step replayed" in line
    assert rescued_config(dataclasses.replace(cfg, min_nproc=3)) == (
        None, "2 survivors are fewer than --min-nproc 3")


def test_a_rank_named_silent_is_lost_whatever_it_saved(tmp_path: Path) -> None:
    """A slow rank that came back after its peers gave up saved its state too; their timeout
    named it, so it is the lost one (every rank saving would otherwise mean no rescue)."""
    from subnetdp.distributed.launch import WorkerFailedError

    for rank in range(WORLD):
        _contribute(tmp_path, rank, 4)
    named = ("Traceback ...\nsubnetdp.distributed.timeouts.CollectiveTimeoutError: rank(s) [0] "
             "stopped answering: rank 1 waited 5 s in a collective")
    e = WorkerFailedError("...", {1: (1, named), 0: (1, "RuntimeError: Connection closed")})
    assert e.silent == [0]
    cfg = dataclasses.replace(_cfg(tmp_path), nproc=WORLD, min_nproc=2)
    smaller, line = rescued_config(cfg, e.silent)
    assert smaller is not None and smaller.nproc == 2, line
    assert "rank(s) [0] of 3 lost; rescued step 4" in line


def test_held_pieces_leave_out_refreshed_copies() -> None:
    """``shard(owned_only=False)``, a survivor's contribution: the pieces of units it trains
    and the shared ones, never its copy of a unit it does not hold (backward masking keeps
    one, refreshed from the owner, that lags by a step; nb-sdp's differed between ranks)."""
    from subnetdp.plan.plan import Plan, Unit
    from subnetdp.runtime.assemble import shard
    from subnetdp.subnet.pieces import LocalPiece, Piece

    plan = Plan(world=2, units=(Unit("u0", 2), Unit("u1", 2)), shared_size=1,
                matrix=((True, False), (True, True)))
    pieces = [Piece("w", u, 0, 2 * u, 2 * u + 2, (2,), torch.float32, True) for u in (0, 1)]
    local = {"w": [LocalPiece(p, p.start) for p in pieces],
             "s": [LocalPiece(Piece("s", None, None, 0, 1, (1,), torch.float32, True), 0)]}
    tensors = {"w": torch.arange(4.0), "s": torch.ones(1)}
    assert sorted(shard(tensors, local, plan, rank=0, owned_only=False)) == ["s", "w@0:0:2"]
    assert sorted(shard(tensors, local, plan, rank=1, owned_only=False)) == [
        "s", "w@0:0:2", "w@0:2:4"]
    assert sorted(shard(tensors, local, plan, rank=1, owned_only=True)) == ["w@0:2:4"]


# -- a rescue left behind by a launcher stopped during it (issue 44, 1c) -----------------------
def test_resume_composes_a_rescue_left_behind(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """``--resume RUN`` composes the survivors' copies its launcher never composed when they
    are newer than the newest checkpoint, says so, and resumes from them."""
    from subnetdp.train.resume import _resume_checkpoint

    for rank in (1, 2):
        _contribute(tmp_path, rank, 4)
    ckpt = _resume_checkpoint(str(tmp_path))  # no checkpoint at all before
    assert ckpt == step_dir(tmp_path / "checkpoints", 4)
    assert f"notice: composed {ckpt} from the survivors' copies" in capsys.readouterr().err
    for rank in (1, 2):  # a later group's rescue, newer than step 4
        _contribute(tmp_path, rank, 5)
    assert _resume_checkpoint(str(ckpt)) == ckpt  # the named checkpoint stays the one resumed
    assert step_dir(tmp_path / "checkpoints", 5).is_dir()  # ... the newer one is composed too
    assert _resume_checkpoint(str(tmp_path)) == step_dir(tmp_path / "checkpoints", 5)
    assert capsys.readouterr().err.count("notice: composed") == 1  # step 5 exists: said once


def test_resume_names_copies_that_make_no_checkpoint(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    from subnetdp.checkpoint.files import CheckpointError
    from subnetdp.train.resume import _resume_checkpoint

    holders = {**HOLDERS, "b@0:1:2": [0]}  # rank 0, lost, held a piece alone
    for rank in (1, 2):
        _contribute(tmp_path, rank, 4, holders)
    with pytest.raises(CheckpointError) as e:
        _resume_checkpoint(str(tmp_path))
    message = str(e.value)
    assert message.startswith(f"{tmp_path} holds no complete checkpoint, and the survivors' "
                              f"copies in {tmp_path / 'rescue'} make none (model/b had no "
                              "surviving holder")
    assert "--ckpt-every" not in message and "nothing was deleted" in message
    assert (tmp_path / "rescue" / "attempt_0").is_dir()


def test_overwrite_says_it_deletes_a_composable_rescue(tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    from subnetdp.checkpoint.rundir import check_fresh

    for rank in (1, 2):
        _contribute(tmp_path, rank, 4)
    check_fresh(tmp_path, resume=False, overwrite=True)
    assert (f"notice: --overwrite deletes the survivors' copies in {tmp_path / 'rescue'}, which "
            f"make a checkpoint of step 4 (`--resume {tmp_path}` would continue from it)"
            ) in capsys.readouterr().err


@pytest.mark.parametrize(("lost", "nodes"), [(2, 1), (0, 2)])
def test_the_survivors_keep_the_nodes_that_have_a_rank(tmp_path: Path, lost: int,
                                                       nodes: int) -> None:
    """3 ranks on 2 nodes ([0, 1], [2]): losing rank 2 loses node 1, the next group runs on
    one node; losing rank 0 leaves rank 1 on node 0, still two nodes ([Note: emulated nodes])."""
    for rank in set(range(WORLD)) - {lost}:
        _contribute(tmp_path, rank, 4)
    cfg = dataclasses.replace(_cfg(tmp_path), nproc=WORLD, min_nproc=2, nnodes=2)
    smaller, _ = rescued_config(cfg)
    assert smaller is not None and (smaller.nproc, smaller.nnodes) == (2, nodes)


def test_a_grown_group_is_rescued_at_its_own_world(tmp_path: Path) -> None:
    """Launched with 2 workers and --max-nproc 3, the group grew to 3 ([Note: growing a
    run]); its loss is counted in the grown world, whose records say 3."""
    for rank in (1, 2):
        _contribute(tmp_path, rank, 4)
    cfg = dataclasses.replace(_cfg(tmp_path), nproc=2, min_nproc=2, max_nproc=3)
    smaller, line = rescued_config(cfg)
    assert smaller is not None and smaller.nproc == 2
    assert line.startswith("rank(s) [0] of 3 lost; rescued step 4"), line
