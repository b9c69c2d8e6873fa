"""Local steps (``--sync-every``) end to end through the CLI: a resume from a checkpoint taken
mid-window, where a unit's holders hold different copies and inner optimizer states, continues
bit for bit; the run's counted bytes are the plan's, once per window, in the wire dtype; the
outer state is sharded like the optimizer's, so --reshard loads it into another plan."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from subnetdp.checkpoint.files import list_checkpoints, read_manifest
from subnetdp.checkpoint.reshard import PieceReader
from subnetdp.cli import main
from subnetdp.metrics.sinks import read_jsonl
from subnetdp.plan import Plan, worker_bytes
from subnetdp.runtime.local_steps import ANCHOR
from tests.dist.runs import final_state, rank_losses

pytestmark = [pytest.mark.dist, pytest.mark.timeout(180)]

WORLD, EVERY = 2, 4
RUN = ["--recipe", "llama-tiny", "--batch-size", "2", "--seq-len", "32", "--eval-batches", "1",
       "--memory-step", "-1", "--no-progress", "--warmup", "2", "--nproc", str(WORLD),
       "--model-arg", "n_layers=4", "--model-arg", "dim=64", "--model-arg", "ffn_hidden=128",
       "--strategy", "b-sdp", "--coverage", "0.5", "--steps", "8", "--ckpt-every", "3",
       "--sync-every", str(EVERY), "--sync-fragments", "2", "--outer-dtype", "bf16"]


def test_resume_mid_window_continues_bit_for_bit(tmp_path: Path) -> None:
    run = tmp_path / "run"
    assert main(["train", *RUN, "--out", str(run)]) == 0
    plan = Plan.from_json((run / "plan.json").read_text())
    for rank in range(WORLD):  # fragment 0 syncs at steps 2 and 6, fragment 1 at 4; the last
        # step syncs both; bf16: 2 bytes an element
        sent = [r["comm/bytes_per_step"]
                for r in read_jsonl(run / "metrics" / f"rank{rank}.jsonl")]
        first, second = sent[1], sent[3]
        assert sent == [0, first, 0, second, 0, first, 0, first + second]
        assert first + second == worker_bytes(plan, rank, param_bytes=2).allreduce_payload
    losses, final = rank_losses(run, WORLD), final_state(run)
    # step 3: fragment 0 synced at step 2, fragment 1 is due at step 4
    again = Path(shutil.copytree(run, tmp_path / "again"))
    config = json.loads((again / "config.json").read_text())
    (again / "config.json").write_text(json.dumps({**config, "out": str(again)}))
    assert main(["train", "--resume", str(again / "checkpoints" / "step_00000003")]) == 0
    assert rank_losses(again, WORLD) == losses  # every rank's own copies came back, not its peers'
    resumed = final_state(again)
    assert resumed.keys() == final.keys()
    assert all(torch.equal(resumed[k], final[k]) for k in final)
    # the outer state is sharded like the optimizer's: --reshard reads it for any plan (here,
    # after the last step's sync, the weights at the last sync are the weights)
    ckpt = list_checkpoints(run / "checkpoints")[-1]
    anchors = PieceReader(ckpt, read_manifest(ckpt), f"optim/{ANCHOR}/")
    params = [k for k in final if k in anchors]
    assert params and all(torch.equal(anchors[k], final[k]) for k in params)
    assert main(["train", "--resume", str(run / "checkpoints" / "step_00000003"), "--reshard",
                 "--nproc", "1", "--coverage", "1"]) == 0
