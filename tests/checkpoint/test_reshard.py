"""Re-masking on resume (``--resume RUN --reshard``), every strategy: a checkpoint of 2 workers
at coverage 0.5 resumed by 3 workers at another coverage (n-sdp: another neuron grouping too).
Right after loading, each rank's state is written back as a checkpoint of the new plan;
assembled, its parameters and optimizer state equal the saved ones bit for bit. Training then
continues. Also the elastic shrink: a worker lost for good (SIGKILL on every attempt at world 3)
and the run goes on with 2 from the newest checkpoint ([Note: elastic shrink])."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
from pathlib import Path
from typing import Any

import pytest
import torch

from subnetdp.checkpoint.files import ShardReader, list_checkpoints, read_manifest, split_piece
from subnetdp.checkpoint.reshard import PieceReader
from subnetdp.cli import main
from subnetdp.metrics.sinks import LR, rank_jsonl_path, read_jsonl
from tests.workers import patch_workers

pytestmark = [pytest.mark.dist, pytest.mark.timeout(240)]

TINY = ["--recipe", "llama-tiny", "--batch-size", "2", "--seq-len", "32", "--eval-batches", "2",
        "--memory-step", "-1", "--no-progress", "--warmup", "2", "--model-arg", "n_layers=4",
        "--model-arg", "dim=64", "--model-arg", "ffn_hidden=128"]


def _assembled(ckpt: Path) -> dict[str, torch.Tensor]:
    """Every full tensor of a checkpoint, model and optimizer state alike (``prefix/key``)."""
    manifest = read_manifest(ckpt)
    out: dict[str, torch.Tensor] = {}
    prefixes = ["model/", *(f"optim/{k}/" for k in manifest["optimizer"]["like_states"])]
    for prefix in prefixes:
        reader = PieceReader(ckpt, manifest, prefix)
        for key in sorted({split_piece(p)[0] for p in reader}):
            out[prefix + key] = reader[key].clone()
    for k in manifest["optimizer"]["scalar_states"]:  # one value per entry, not its pieces
        scalars = ShardReader(ckpt, sorted(manifest["files"]), f"optim_scalar/{k}/")
        out.update({f"optim_scalar/{k}/{key}": scalars[key].clone() for key in scalars})
    return out


def restore_and_write_back() -> None:
    """In a worker: right after loading, save the loaded state as the new plan shards it
    (replacing the checkpoint it was loaded from)."""
    from subnetdp.checkpoint.checkpointer import Checkpointer

    real = Checkpointer.restore

    def restore(self: Checkpointer, ckpt: Path, **kw: Any) -> int:
        step = real(self, ckpt, **kw)
        self.save(step)
        return step

    Checkpointer.restore = restore  # type: ignore[method-assign]


_RUNS: dict[str, Path] = {}


def _trained(strategy: str, factory: pytest.TempPathFactory, to: Path) -> Path:
    """A copy at ``to`` of a finished 4-step run of 2 workers at coverage 0.5 with a checkpoint
    at step 4 (n-sdp: at step 2 too, for the same-plan resume), trained once per strategy for
    the whole module. Here a checkpoint costs more CPU than the 4 steps: only n-sdp's run
    writes two."""
    if strategy not in _RUNS:
        out = factory.mktemp("runs") / strategy
        every = "2" if strategy == "n-sdp" else "4"
        assert main(["train", *TINY, "--strategy", strategy, "--nproc", "2", "--coverage",
                     "0.5", "--steps", "4", "--ckpt-every", every, "--out", str(out)]) == 0
        _RUNS[strategy] = out
    return Path(shutil.copytree(_RUNS[strategy], to))


@pytest.mark.parametrize("strategy", ["ddp", "b-sdp", "bb-sdp", "n-sdp", "nb-sdp"])
def test_resume_under_another_world_and_coverage(
    strategy: str, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory,
    monkeypatch: pytest.MonkeyPatch
) -> None:
    out = _trained(strategy, tmp_path_factory, tmp_path / "run")
    saved_ckpt = Path(shutil.copytree(out / "checkpoints" / "step_00000004",
                                      tmp_path / "saved"))
    patch_workers(monkeypatch, restore_and_write_back)
    coverage = [] if strategy == "ddp" else ["--coverage", "0.67"]  # ddp has no plan
    assert main(["train", "--resume", str(out), "--reshard", "--nproc", "3", *coverage,
                 "--steps", "6", "--ckpt-every", "2"]) == 0
    loaded_ckpt = out / "checkpoints" / "step_00000004"
    assert read_manifest(saved_ckpt)["world"] == 2 and read_manifest(loaded_ckpt)["world"] == 3
    assert read_manifest(loaded_ckpt)["plan"] != read_manifest(saved_ckpt)["plan"]
    saved, loaded = _assembled(saved_ckpt), _assembled(loaded_ckpt)
    assert saved.keys() == loaded.keys()
    assert any(k.startswith("optim/exp_avg_sq/") for k in saved)
    for k in saved:
        assert torch.equal(saved[k], loaded[k]), k  # bit for bit, parameters and optimizer
    # Training went on under the new plan.
    assert [c.name for c in list_checkpoints(out / "checkpoints")][-1] == "step_00000006"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world"] == 3
    assert summary["config"]["coverage"] == (0.5 if strategy == "ddp" else 0.67)
    for r in range(3):
        steps = [m["step"] for m in read_jsonl(out / "metrics" / f"rank{r}.jsonl")]
        assert steps[-2:] == [5, 6]
        assert all(math.isfinite(m["loss"]) for m in read_jsonl(
            out / "metrics" / f"rank{r}.jsonl"))


def test_reshard_into_the_same_plan_is_an_exact_resume(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Resumed from step 2 of 4, every rank logs the uninterrupted run's loss and learning rate
    at every step, and the step-4 checkpoint it writes holds the same LR schedule state and,
    bit for bit, the same parameters and optimizer state. The schedule (warm-up 2, then cosine
    decay to step 4) changes the rate between steps 3 and 4, so a schedule not restored shows:
    the logged rates, the scheduler state and, through step 4's update, the weights differ."""
    out = _trained("n-sdp", tmp_path_factory, tmp_path / "run")

    def logged() -> list[list[tuple[int, float, float]]]:
        return [[(m["step"], m["loss"], m[LR]) for m in read_jsonl(rank_jsonl_path(out, r))]
                for r in range(2)]

    uninterrupted = logged()
    rates = [lr for _, _, lr in uninterrupted[0]]
    assert [s for s, _, _ in uninterrupted[0]] == [1, 2, 3, 4]
    assert rates[2] != rates[3] and rates[0] != rates[1]  # the schedule moves in both segments
    final = Path(shutil.copytree(out / "checkpoints" / "step_00000004", tmp_path / "final"))
    assert main(["train", "--resume", str(out / "checkpoints" / "step_00000002"),
                 "--reshard"]) == 0
    assert logged() == uninterrupted
    resumed = out / "checkpoints" / "step_00000004"
    assert read_manifest(resumed)["time"] > read_manifest(final)["time"]  # the resume's own
    want, got = read_manifest(final)["optimizer"], read_manifest(resumed)["optimizer"]
    assert got["scheduler"] == want["scheduler"] and got["param_groups"] == want["param_groups"]
    saved, loaded = _assembled(final), _assembled(resumed)
    assert saved.keys() == loaded.keys()
    for k in saved:
        assert torch.equal(saved[k], loaded[k]), k


def test_resume_under_another_world_needs_reshard(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory,
    capsys: pytest.CaptureFixture[str]
) -> None:
    out = _trained("b-sdp", tmp_path_factory, tmp_path / "run")  # b-sdp: the default
    capsys.readouterr()
    assert main(["train", "--resume", str(out), "--nproc", "3", "--steps", "6"]) == 2
    assert "or add --reshard to re-plan it" in capsys.readouterr().err
    assert main(["train", "--resume", str(out), "--coverage", "1.0", "--steps", "6"]) == 2
    assert "or add --reshard," in capsys.readouterr().err


def test_elastic_shrink_continues_on_the_survivors(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    from subnetdp.train.config import TrainConfig
    from subnetdp.train.elastic import launch_shrinking
    from subnetdp.train.tasks import make_task

    cfg = TrainConfig(recipe="llama-tiny", strategy="b-sdp", coverage=0.67, nproc=3, steps=8,
                      out=str(tmp_path / "run"), batch_size=2, seq_len=32, warmup=2,
                      eval_batches=1, memory_step=-1, progress=False, ckpt_every=3,
                      max_restarts=1, min_nproc=2, rescue=False,  # the checkpoint path
                      model_args={"n_layers": 4, "dim": 64, "ffn_hidden": 128}).resolved()
    make_task(cfg)
    # Attempt 1 dies at step 4, the restart (3 workers, from step 3) dies there again; with
    # the restarts used up, 2 workers continue from step 3.
    results = launch_shrinking(_lost_worker, cfg, run_id="shrink")
    err = capsys.readouterr().err
    assert "1 of 3 workers lost for good; going on with 2 from" in err
    assert "step_00000003" in err
    run = tmp_path / "run"
    assert sorted(results) == [0, 1]
    final = list_checkpoints(run / "checkpoints")[-1]
    assert final.name == "step_00000008" and read_manifest(final)["world"] == 2
    summary = json.loads((run / "summary.json").read_text())
    assert summary["world"] == 2
    for r in range(2):  # the survivors replayed steps 4..8 after the step-3 checkpoint
        assert [m["step"] for m in read_jsonl(run / "metrics" / f"rank{r}.jsonl")] == list(
            range(1, 9))
    # the lost rank's lines end at the checkpoint the survivors continued from
    assert [m["step"] for m in read_jsonl(run / "metrics" / "rank2.jsonl")] == [1, 2, 3]


def _lost_worker(cfg_dict: dict[str, Any]) -> dict[str, Any]:
    """Rank 2 of a 3-worker group dies (SIGKILL) after step 4, on every attempt: a worker
    lost for good."""
    import subnetdp.train.trainer as trainer

    if os.environ["WORLD_SIZE"] == "3" and os.environ["RANK"] == "2":
        real = trainer.Checkpointer.due

        def dying(self: Any, done: int) -> bool:
            if done == 5:
                os.kill(os.getpid(), signal.SIGKILL)
            return bool(real(self, done))

        trainer.Checkpointer.due = dying  # type: ignore[method-assign]
    return trainer.train_worker(cfg_dict)
