"""Checkpoints of SDP + FSDP2 runs: an interrupted and resumed run reproduces the uninterrupted
one exactly (b-sdp + AC, nb-sdp + AC: blocks, and grouped parts with frozen non-held ones), and
a checkpoint loads bit for bit under another world size and coverage (bb-sdp). The
format is the plain one (full-model pieces, each from its owner), so export is unchanged."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from subnetdp.checkpoint.files import assemble_full_state, list_checkpoints, read_manifest
from subnetdp.cli import main
from tests.dist.runs import rank_losses
from tests.workers import patch_workers

pytestmark = [pytest.mark.dist, pytest.mark.timeout(600)]

WORLD = 4
TINY = ["--recipe", "llama-tiny", "--batch-size", "2", "--seq-len", "16", "--eval-batches", "1",
        "--memory-step", "-1", "--no-progress", "--warmup", "2", "--nproc", str(WORLD),
        "--coverage", "0.5", "--model-arg", "n_layers=4", "--model-arg", "dim=32",
        "--model-arg", "ffn_hidden=64", "--fsdp"]
# Each FSDP step of 4 workers costs about 1.5 s of CPU: two steps before the checkpoint resumed
# from and two after it are the fewest that still resume mid-run (after the warm-up).
STEPS, EVERY = 4, 2


def _final(run: Path) -> dict[str, torch.Tensor]:
    ckpt = list_checkpoints(run / "checkpoints")[-1]
    return assemble_full_state(ckpt, read_manifest(ckpt))


@pytest.mark.parametrize(("strategy", "extra"), [("b-sdp", ["--ac"]), ("nb-sdp", ["--ac"])])
def test_fsdp_resume_is_exact(strategy: str, extra: list[str], tmp_path: Path) -> None:
    run = tmp_path / strategy
    assert main(["train", *TINY, *extra, "--strategy", strategy, "--steps", str(STEPS),
                 "--ckpt-every", str(EVERY), "--out", str(run)]) == 0
    losses, final = rank_losses(run, WORLD), _final(run)
    assert [len(x) for x in losses] == [STEPS] * WORLD
    assert main(["train", "--resume", str(run / "checkpoints" / f"step_{EVERY:08d}")]) == 0
    assert rank_losses(run, WORLD) == losses
    again = _final(run)
    assert again.keys() == final.keys()
    assert all(torch.equal(again[k], final[k]) for k in final)


@pytest.mark.parametrize("strategy", ["bb-sdp", "n-sdp"])
def test_fsdp_checkpoint_resumes_under_another_world_and_coverage(
    strategy: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An FSDP checkpoint of 4 workers at C = 0.5 resumed (--reshard) by 3 at C = 0.67: the
    loaded shards, written back and assembled, equal the saved parameters and optimizer
    state bit for bit; training goes on."""
    from tests.checkpoint.test_reshard import _assembled, restore_and_write_back

    out = tmp_path / "run"
    # 2 steps, one checkpoint at the end; then one more step under the new plan
    assert main(["train", *TINY, "--strategy", strategy, "--steps", "2", "--ckpt-every", "2",
                 "--out", str(out)]) == 0
    saved_ckpt = Path(shutil.copytree(out / "checkpoints" / "step_00000002", tmp_path / "saved"))
    patch_workers(monkeypatch, restore_and_write_back)
    assert main(["train", "--resume", str(out), "--reshard", "--nproc", "3", "--coverage",
                 "0.67", "--steps", "3", "--ckpt-every", "3"]) == 0
    loaded_ckpt = out / "checkpoints" / "step_00000002"
    assert read_manifest(loaded_ckpt)["world"] == 3
    saved, loaded = _assembled(saved_ckpt), _assembled(loaded_ckpt)
    assert saved.keys() == loaded.keys() and any(k.startswith("optim/exp_avg/") for k in saved)
    for k in saved:
        assert torch.equal(saved[k], loaded[k]), k
    assert list_checkpoints(out / "checkpoints")[-1].name == "step_00000003"
