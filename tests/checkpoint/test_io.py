"""Checkpoint files without worker processes: atomic publish, pruning, checksums, damaged
files, assembling sliced pieces, compatibility checks, resume configuration, and an exact
save/restore round trip (with dropout, so the RNG state matters) in a one-process group."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from subnetdp.checkpoint.checkpointer import Checkpointer, check_compatible
from subnetdp.checkpoint.files import (
    FORMAT,
    MANIFEST,
    VERSION,
    CheckpointError,
    ShardReader,
    assemble_full_state,
    list_checkpoints,
    prune,
    publish,
    read_manifest,
    resolve_checkpoint,
    split_piece,
    write_manifest,
    write_shard,
)
from subnetdp.train.config import TrainConfig
from subnetdp.train.resume import resume_config, truncate_metrics

# The entries every manifest has (Checkpointer._manifest), with neutral values.
_MINIMAL: dict[str, object] = {
    "format": FORMAT, "version": VERSION, "parent": None, "strategy": "b-sdp", "time": 0.0,
    "plan": {},
    "recipe": "toy", "model_overrides": {}, "model_state": [], "config": {},
    "optimizer": {"class": "AdamW", "like_states": [], "scalar_states": [], "param_groups": [],
                  "scheduler": {}},
}


def _checkpoint(root: Path, step: int, tensors: dict[str, dict[str, torch.Tensor]],
                **extra: object) -> Path:
    """A checkpoint folder written the way Checkpointer.save writes one (continuing the
    checkpoint one step before, if there is one)."""
    staging = root / f".step_{step:08d}.partial"
    staging.mkdir(parents=True)
    files = {name: write_shard(staging / name, t, {"format": FORMAT})
             for name, t in tensors.items()}
    before = root / f"step_{step - 1:08d}"
    write_manifest(staging, {**_MINIMAL, "world": max(len(files), 1), "step": step,
                             "files": files,
                             "parent": before.name if before.is_dir() else None, **extra})
    final = root / f"step_{step:08d}"
    publish(staging, final)
    return final


def test_publish_prune_and_resolve(tmp_path: Path) -> None:
    root = tmp_path / "run" / "checkpoints"
    for step in (1, 2, 3):
        _checkpoint(root, step, {"rank00000.safetensors": {"model/w": torch.full((2,), step)}})
    (root / "step_00000004").mkdir()  # a crash before its manifest: not a checkpoint
    assert resolve_checkpoint(tmp_path / "run").name == "step_00000003"
    with pytest.raises(CheckpointError, match="never completed"):
        resolve_checkpoint(root / "step_00000004")
    # The same step again (a run resumed from an older checkpoint) replaces it whole.
    _checkpoint(root, 3, {"rank00000.safetensors": {"model/w": torch.full((2,), 30)}})
    assert ShardReader(root / "step_00000003", ["rank00000.safetensors"], "model/")["w"][0] == 30
    (root / ".step_00000005.partial").mkdir()  # a crash while writing
    assert prune(root, keep=2) == [root / "step_00000001"]
    assert [p.name for p in list_checkpoints(root)] == ["step_00000002", "step_00000003"]
    assert sorted(p.name for p in root.iterdir()) == ["step_00000002", "step_00000003"]
    assert not list(root.glob(".*"))  # no staging or moved-aside folders left
    with pytest.raises(CheckpointError, match="holds no complete checkpoint"):
        resolve_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match="does not exist"):
        resolve_checkpoint(tmp_path / "nope")


def test_damaged_files_are_detected(tmp_path: Path) -> None:
    from subnetdp.checkpoint.files import verify_files

    ckpt = _checkpoint(tmp_path, 1, {"rank00000.safetensors": {"model/w": torch.randn(64)}})
    manifest = read_manifest(ckpt)
    verify_files(ckpt, manifest)
    shard = ckpt / "rank00000.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[:-8])
    with pytest.raises(CheckpointError, match="is truncated or damaged"):
        verify_files(ckpt, manifest)
    # Without the manifest's sizes, the safetensors header still gives it away.
    with pytest.raises(CheckpointError, match="cannot be read"):
        ShardReader(ckpt, ["rank00000.safetensors"], "model/")
    shard.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    with pytest.raises(CheckpointError, match="sha256"):
        verify_files(ckpt, manifest)
    shard.unlink()
    with pytest.raises(CheckpointError, match="is missing"):
        verify_files(ckpt, manifest)
    (ckpt / MANIFEST).write_text(json.dumps({"format": FORMAT, "version": 99}))
    with pytest.raises(CheckpointError, match="version 99"):
        read_manifest(ckpt)
    (ckpt / MANIFEST).write_text("[]")
    with pytest.raises(CheckpointError, match="not a subnetdp checkpoint"):
        read_manifest(ckpt)


def test_assemble_sliced_pieces(tmp_path: Path) -> None:
    w = torch.arange(24.0).view(4, 6)
    shards = {"rank00000.safetensors": {"model/w@1:0:2": w[:, :2].contiguous(), "model/b": w[0]},
              "rank00001.safetensors": {"model/w@1:2:6": w[:, 2:].contiguous()}}
    state = [["w", [4, 6], "torch.float32"], ["b", [6], "torch.float32"]]
    ckpt = _checkpoint(tmp_path, 1, shards, model_state=state)
    full = assemble_full_state(ckpt, read_manifest(ckpt))
    assert list(full) == ["w", "b"] and torch.equal(full["w"], w)
    assert split_piece("a.b@0:3:5") == ("a.b", (0, 3, 5)) and split_piece("x") == ("x", None)
    del shards["rank00001.safetensors"]
    ckpt = _checkpoint(tmp_path, 2, shards, model_state=state)
    with pytest.raises(CheckpointError, match="covers positions 2:6 of dim 1"):
        assemble_full_state(ckpt, read_manifest(ckpt))


def test_compatibility_messages(tmp_path: Path) -> None:
    from subnetdp.plan import make_plan
    from subnetdp.plan.plan import Unit

    units = [Unit(f"u{i}", 10) for i in range(4)]
    plan = make_plan(world=2, units=units, coverage=0.5)
    manifest = {"world": 2, "strategy": "b-sdp", "plan": plan.to_dict(),
                "model_state": [["w", [2], "torch.float32"]]}
    ok = {"world": 2, "strategy": "b-sdp", "plan": plan,
          "model_state": [("w", (2,), "torch.float32")]}
    check_compatible(manifest, tmp_path, **ok)  # type: ignore[arg-type]
    cases = [({"world": 4}, "written by 2 workers but this run has 4; .* --nproc 2"),
             ({"strategy": "n-sdp"}, "from a 'b-sdp' run, not 'n-sdp'"),
             ({"plan": make_plan(world=2, units=units, coverage=1.0)}, "different plan"),
             ({"model_state": [("w", (3,), "torch.float32")]}, "different model")]
    for change, message in cases:
        with pytest.raises(CheckpointError, match=message):
            check_compatible(manifest, tmp_path, **{**ok, **change})  # type: ignore[arg-type]


def test_resume_config_keeps_the_runs_own(tmp_path: Path) -> None:
    saved = TrainConfig(steps=10, nproc=2, lr=1e-3, out="old/place").to_dict()
    shards: dict[str, dict[str, torch.Tensor]] = {f"rank0000{r}.safetensors": {} for r in (0, 1)}
    ckpt = _checkpoint(tmp_path / "run" / "checkpoints", 4, shards, config=saved)
    cfg = resume_config(str(tmp_path / "run"), {"steps": 20, "lr": 1e-3}, {"steps", "lr"})
    assert cfg.steps == 20 and cfg.lr == 1e-3 and cfg.nproc == 2
    assert cfg.out == str(tmp_path / "run") and cfg.resume == str(ckpt)
    with pytest.raises(CheckpointError, match=r"--lr 0\.1 differs from the resumed run's 0\.001"):
        resume_config(str(tmp_path / "run"), {"lr": 0.1}, {"lr"})
    with pytest.raises(CheckpointError, match="resume with --nproc 2"):
        resume_config(str(tmp_path / "run"), {"nproc": 3}, {"nproc"})


def test_truncate_metrics(tmp_path: Path) -> None:
    path = tmp_path / "rank0.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": s / 10}) + "\n" for s in range(1, 6))
                    + '{"step": 6, "lo')  # a torn last line from a killed run
    kept = truncate_metrics(path, 3)  # resuming after 3 steps: steps 1..3 stay
    assert [r["step"] for r in kept] == [1, 2, 3]
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [1, 2, 3]


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.drop = nn.Linear(8, 16), nn.Linear(16, 1), nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.drop(torch.tanh(self.fc1(x))))


def test_exact_round_trip_in_one_process(tmp_path: Path) -> None:
    """DDP in a one-process group: save after 3 steps, keep training; a fresh model, optimizer
    and schedule restored from the checkpoint continue with bit-identical losses (dropout draws
    from the restored RNG)."""
    from subnetdp.distributed.process_group import init_distributed, shutdown_distributed
    from subnetdp.plan import make_plan
    from subnetdp.plan.plan import Unit
    from subnetdp.runtime.rank import TorchDDPRank
    from subnetdp.strategy import get_strategy

    init_distributed("gloo", timeout=60)  # a hung collective fails instead of waiting 30 min
    try:
        cfg = TrainConfig(steps=6, ckpt_every=3, strategy="ddp")
        plan = make_plan(world=1, units=[Unit("u", 1)], coverage=1.0)
        state = [[k, list(v.shape), str(v.dtype)] for k, v in _Net().state_dict().items()]
        info = {"recipe": "toy", "model_overrides": {}, "model_state": state}

        def build(seed: int) -> tuple[nn.Module, torch.optim.Optimizer, object, Checkpointer]:
            torch.manual_seed(seed)
            rank = TorchDDPRank(_Net(), strategy=get_strategy("ddp"),
                                device=torch.device("cpu"), bucket_cap_mb=25.0)
            opt = torch.optim.AdamW(rank.parameters(), lr=1e-2)
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
            ckpt = Checkpointer(tmp_path, rank, opt, sched, plan=plan, cfg=cfg, rank=0,
                                world=1, info=info)
            return rank.model, opt, sched, ckpt

        def step(model: nn.Module, opt: torch.optim.Optimizer, sched: object, i: int) -> float:
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(i))
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            sched.step()  # type: ignore[attr-defined]
            opt.zero_grad()
            return loss.item()

        model, opt, sched, ckpt = build(0)
        for i in range(3):
            step(model, opt, sched, i)
        saved = ckpt.save(3)
        after = [step(model, opt, sched, i) for i in range(3, 6)]
        model2, opt2, sched2, ckpt2 = build(1)  # different init: everything must come back
        assert ckpt2.restore(saved) == 3
        assert [step(model2, opt2, sched2, i) for i in range(3, 6)] == after
        for a, b in zip(model.parameters(), model2.parameters(), strict=True):
            assert torch.equal(a, b)
    finally:
        shutdown_distributed()
