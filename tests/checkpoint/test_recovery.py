"""Fault recovery: a worker killed mid-run (SIGKILL, a real process death) is restarted by torch
elastic with the whole group, which resumes from the newest checkpoint and ends with exactly the
parameters and losses of an uninterrupted run (the steps after that checkpoint are replayed)."""

from __future__ import annotations

import itertools
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from subnetdp.checkpoint.files import assemble_full_state, list_checkpoints, read_manifest
from subnetdp.distributed.launch import launch
from subnetdp.metrics.sinks import read_jsonl
from subnetdp.train.config import TrainConfig
from subnetdp.train.tasks import make_task

pytestmark = [pytest.mark.dist, pytest.mark.timeout(240)]

WORLD, STEPS, EVERY, KILL_RANK, KILL_STEP = 4, 8, 3, 2, 5


def _config(out: Path) -> TrainConfig:
    return TrainConfig(
        recipe="llama-tiny", strategy="b-sdp", coverage=0.5, nproc=WORLD, steps=STEPS,
        out=str(out), batch_size=2, seq_len=32, warmup=2, eval_batches=1, memory_step=-1,
        progress=False, ckpt_every=EVERY, max_restarts=1,
        model_args={"n_layers": 4, "dim": 64, "ffn_hidden": 128},
    ).resolved()


def _worker(cfg_dict: dict[str, Any], kill_rank: int, kill_step: int) -> dict[str, Any]:
    """The normal worker, except that on the first attempt rank ``kill_rank`` SIGKILLs itself
    when it is about to run step ``kill_step`` (no cleanup, no Python exception)."""
    import subnetdp.train.trainer as trainer

    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    if first_attempt and int(os.environ["RANK"]) == kill_rank:
        real, calls = trainer.train_step, itertools.count()

        def dying(*args: Any, **kwargs: Any) -> float:
            if next(calls) == kill_step:
                os.kill(os.getpid(), signal.SIGKILL)
            return real(*args, **kwargs)

        trainer.train_step = dying  # type: ignore[assignment]
    return trainer.train_worker(cfg_dict)


def _run(out: Path, kill_step: int) -> float:
    cfg = _config(out)
    make_task(cfg)  # token cache built once, in this process
    t0 = time.perf_counter()
    launch(_worker, (cfg.to_dict(), KILL_RANK, kill_step), nproc=WORLD,
           run_id=f"recovery-{out.name}", max_restarts=cfg.max_restarts)
    return time.perf_counter() - t0


def test_killed_worker_is_recovered_exactly(tmp_path: Path) -> None:
    t_ref = _run(tmp_path / "reference", kill_step=-1)  # never killed
    t_kill = _run(tmp_path / "killed", kill_step=KILL_STEP)
    print(f"uninterrupted {t_ref:.1f}s, killed + recovered {t_kill:.1f}s")

    ref_ckpts = list_checkpoints(tmp_path / "reference" / "checkpoints")
    new_ckpts = list_checkpoints(tmp_path / "killed" / "checkpoints")
    assert [p.name for p in new_ckpts] == [p.name for p in ref_ckpts]
    final_ref, final_new = ref_ckpts[-1], new_ckpts[-1]
    assert read_manifest(final_new)["step"] == STEPS
    ref = assemble_full_state(final_ref, read_manifest(final_ref))
    new = assemble_full_state(final_new, read_manifest(final_new))
    assert ref.keys() == new.keys()
    for k in ref:
        assert torch.equal(ref[k], new[k]), k  # bit-identical, not just close

    for rank in range(WORLD):
        a = read_jsonl(tmp_path / "reference" / "metrics" / f"rank{rank}.jsonl")
        b = read_jsonl(tmp_path / "killed" / "metrics" / f"rank{rank}.jsonl")
        # One line per step (the replayed steps' first lines were dropped), same losses.
        assert [r["step"] for r in b] == list(range(1, STEPS + 1))
        assert [r["loss"] for r in a] == [r["loss"] for r in b]
