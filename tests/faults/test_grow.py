"""Grow back ([Note: growing a run]): 4 workers, ``--min-nproc 3 --max-nproc 4``; rank 2 is
SIGKILLed in the commit of step 3. The 3 survivors go on from the rescued step, the launcher
restarts the lost worker, and it rejoins at a step boundary: the run grows 3 -> 4 with its state
from the holders. No step is lost or replayed, and the continued run equals, bit for bit, a run
resharded onto 4 workers from the checkpoint of the step where it grew (``--reshard``)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from subnetdp.checkpoint.files import read_manifest, step_dir
from subnetdp.cli import main
from subnetdp.distributed import faults
from subnetdp.metrics.sinks import read_jsonl
from tests.faults.harness import clear_message, long_faults, run_cli
from tests.faults.test_rescue_oracle import TINY, _tensors

pytestmark = [pytest.mark.dist, pytest.mark.timeout(600)]

STEPS = 8


def _losses(run: Path, rank: int, after: int) -> list[tuple[int, float]]:
    return [(m["step"], m["loss"]) for m in read_jsonl(run / "metrics" / f"rank{rank}.jsonl")
            if m["step"] > after]


def _grows_back(tmp_path: Path, strategy: str, capsys: pytest.CaptureFixture[str],
                monkeypatch: pytest.MonkeyPatch) -> None:
    run = tmp_path / "run"
    monkeypatch.setenv(faults.ENV, "2:3:commit:kill")
    capsys.readouterr()
    assert main(["train", *TINY, "--strategy", strategy, "--steps", str(STEPS), "--nproc", "4",
                 "--min-nproc", "3", "--max-nproc", "4", "--ckpt-every", "1", "--ckpt-keep",
                 "20", "--log-every", "1", "--out", str(run)]) == 0
    err = capsys.readouterr().err
    assert "rank(s) [2] of 4 lost; rescued step 3 " in err, err
    worlds = {s: read_manifest(step_dir(run / "checkpoints", s))["world"]
              for s in range(1, STEPS + 1)}
    grew = max(s for s, w in worlds.items() if w == 3)  # the 3 survivors' last step
    assert grew < STEPS and worlds == {s: 4 if s <= 3 or s > grew else 3
                                       for s in range(1, STEPS + 1)}, worlds
    # nothing lost or replayed: rank 0 logged every step after the rescued one once (the
    # rescued step's own line is rescue's known gap: docs/checkpointing.md, Limits)
    assert [m["step"] for m in read_jsonl(run / "metrics" / "rank0.jsonl")] == [
        1, 2, *range(4, STEPS + 1)]
    _equals_the_resharded_run(run, tmp_path / "resharded", grew, monkeypatch)


def _equals_the_resharded_run(run: Path, again: Path, grew: int,
                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The grown run's steps after ``grew`` are those of ``--resume step_<grew> --reshard``
    onto 4 workers, loss for loss, and its final checkpoint equals that run's bit for bit."""
    assert [s for s, _ in _losses(run, 3, grew)] == list(range(grew + 1, STEPS + 1))
    shutil.copytree(run, again)
    monkeypatch.setenv(faults.ENV, "")  # disarmed (a fork server keeps an unset variable)
    assert main(["train", "--resume", str(step_dir(again / "checkpoints", grew)), "--reshard",
                 "--nproc", "4", "--no-progress"]) == 0
    for rank in range(4):  # the grown run goes on as the resharded one, loss for loss
        assert _losses(run, rank, grew) == _losses(again, rank, grew), rank
    a = _tensors(step_dir(run / "checkpoints", STEPS))
    b = _tensors(step_dir(again / "checkpoints", STEPS))
    assert a.keys() == b.keys()
    for k in a:  # bit for bit
        assert torch.equal(a[k].view(-1).view(torch.uint8), b[k].view(-1).view(torch.uint8)), k


def test_a_killed_worker_rejoins_and_the_run_grows_back(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    _grows_back(tmp_path, "b-sdp", capsys, monkeypatch)


@long_faults
@pytest.mark.parametrize("strategy", ["n-sdp", "bb-sdp", "nb-sdp"])
def test_every_strategy_grows_back(tmp_path: Path, strategy: str,
                                   capsys: pytest.CaptureFixture[str],
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    _grows_back(tmp_path, strategy, capsys, monkeypatch)


@long_faults
@pytest.mark.parametrize("extra", [["--zero", "2"], ["--fsdp"]])
def test_a_sharded_group_grows(tmp_path: Path, extra: list[str],
                               capsys: pytest.CaptureFixture[str],
                               monkeypatch: pytest.MonkeyPatch) -> None:
    """No loss: 3 workers and a joiner from the start (--max-nproc adds one); holder groups
    whose state is sharded hand it over as gathered by their checkpoint."""
    run = tmp_path / "run"
    assert main(["train", *TINY, *extra, "--strategy", "b-sdp", "--steps", str(STEPS),
                 "--nproc", "3", "--max-nproc", "4", "--ckpt-every", "1", "--ckpt-keep", "20",
                 "--log-every", "1", "--out", str(run)]) == 0
    worlds = [read_manifest(step_dir(run / "checkpoints", s))["world"]
              for s in range(1, STEPS + 1)]
    grew = worlds.count(3)
    assert 0 < grew < STEPS and worlds == [3] * grew + [4] * (STEPS - grew), worlds
    _equals_the_resharded_run(run, tmp_path / "resharded", grew, monkeypatch)


def test_a_joiner_waits_for_its_admission_or_the_end(monkeypatch: pytest.MonkeyPatch) -> None:
    """The joiner's side: admitted with the new world; or told that the run ended (the last
    step never grows), or finding the store gone, it ends untrained (None)."""
    import json
    import threading

    import torch.distributed as dist

    from subnetdp.train import grow

    monkeypatch.setattr(grow, "POLL_S", 0.01)
    keys = grow._Keys()
    store = dist.HashStore()
    later = threading.Timer(0.1, lambda: store.set(keys.admit, json.dumps({"world": 4,
                                                                           "step": 5})))
    later.start()
    assert grow._admission(store, keys) == {"world": 4, "step": 5}  # waited for it
    store.set(keys.admit, json.dumps({"done": True}))
    assert grow._admission(store, keys) is None

    class Gone:
        def check(self, _: list[str]) -> bool:
            raise RuntimeError("Connection reset by peer")

    assert grow._admission(Gone(), keys) is None  # type: ignore[arg-type]


@pytest.mark.parametrize(("argv", "env", "message"), [
    (["--nproc", "2", "--max-nproc", "1"], {},
     "--max-nproc must be >= --nproc (2), got 1"),
    (["--nproc", "2", "--max-nproc", "2"], {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"},
     "--max-nproc grows a local run; under torchrun a node joins by torchrun's --nnodes "
     "MIN:MAX (docs/checkpointing.md): drop it"),
    (["--nproc", "3", "--max-nproc", "4", "--scheme", "balanced", "--capacities",
      "1,0.5,0.5"], {}, "--max-nproc 4 grows the run beyond --nproc 3, but --capacities gives "
                        "one value per worker of --nproc; drop one of them"),
])
def test_max_nproc_refusals(argv: list[str], env: dict[str, str], message: str, tmp_path: Path,
                            capsys: pytest.CaptureFixture[str],
                            monkeypatch: pytest.MonkeyPatch) -> None:
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    at = TINY.index("--coverage")  # per-rank capacities replace it
    base = TINY[:at] + TINY[at + 2:] if "--capacities" in argv else TINY
    code, err = run_cli(["train", *base, *argv, "--out", str(tmp_path / "run")], capsys)
    assert code == 2 and clear_message(err) is not None and message in err, err
    assert not (tmp_path / "run").exists()
