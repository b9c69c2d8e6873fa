"""The rescue oracle ([Note: rescue]): 4 workers, ``--min-holders 2``, one rank SIGKILLed
(``SUBNETDP_FAULT``) at one phase of step 4. The checkpoint the launcher composes from the
survivors equals, tensor for tensor and file for file, the one an uninterrupted run writes at the
same step; and the run that goes on from it on 3 workers equals, loss by loss, a run resharded
from that reference checkpoint onto 3 workers. One case runs in ``make test``; every strategy
and phase under the ``long`` marker (``make test-faults``)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from subnetdp.checkpoint.files import read_manifest, step_dir
from subnetdp.cli import main
from subnetdp.distributed import faults
from subnetdp.metrics.sinks import read_jsonl
from tests.faults.harness import long_faults

pytestmark = [pytest.mark.dist, pytest.mark.timeout(900)]

TINY = ["--recipe", "llama-tiny", "--batch-size", "2", "--seq-len", "32", "--eval-batches", "1",
        "--memory-step", "-1", "--no-progress", "--warmup", "2", "--model-arg", "n_layers=2",
        "--model-arg", "dim=32", "--model-arg", "ffn_hidden=64", "--coverage", "0.75",
        "--min-holders", "2", "--steps", "6"]
KILL_RANK, KILL_STEP = 2, 4
# the phases before the commit lose step 4 (its gradients are incomplete), the others nothing
# ("commit": the survivors are in the commit without the killed rank, and roll step 4 forward)
CUT = {"forward": 3, "backward": 3, "reduce": 3, "commit": 4, "optimizer": 4, "checkpoint": 4}


def _tensors(ckpt: Path) -> dict[tuple[str, str], torch.Tensor]:
    """Every tensor of every rank file but the RNG streams (a rescue carries none)."""
    out = {}
    for f in sorted(ckpt.glob("rank*.safetensors")):
        h = safe_open(str(f), framework="pt")
        for k in h.keys():  # noqa: SIM118
            if not k.startswith("rng/"):
                out[(f.name, k)] = h.get_tensor(k)
    return out


def _oracle(tmp_path: Path, strategy: str, phase: str, capsys: pytest.CaptureFixture[str],
            monkeypatch: pytest.MonkeyPatch) -> None:
    args = [*TINY, "--strategy", strategy]
    ref, run, again = tmp_path / "reference", tmp_path / "rescued", tmp_path / "resharded"
    assert main(["train", *args, "--nproc", "4", "--ckpt-every", "1", "--ckpt-keep", "9",
                 "--out", str(ref)]) == 0
    monkeypatch.setenv(faults.ENV, f"{KILL_RANK}:{KILL_STEP}:{phase}:kill")
    capsys.readouterr()
    assert main(["train", *args, "--nproc", "4", "--min-nproc", "3", "--ckpt-every", "2",
                 "--out", str(run)]) == 0
    err = capsys.readouterr().err
    cut = CUT[phase]
    assert f"rank(s) [{KILL_RANK}] of 4 lost; rescued step {cut} " in err, err

    rescued, reference = step_dir(run / "checkpoints", cut), step_dir(ref / "checkpoints", cut)
    a, b = _tensors(rescued), _tensors(reference)
    assert a.keys() == b.keys()
    for k in a:  # bit for bit, in the same rank files
        assert torch.equal(a[k].view(-1).view(torch.uint8), b[k].view(-1).view(torch.uint8)), k
    ma, mb = read_manifest(rescued), read_manifest(reference)
    for key in ("step", "world", "plan", "model_state", "optimizer"):
        assert ma[key] == mb[key], key

    shutil.copytree(ref, again)
    monkeypatch.delenv(faults.ENV)
    assert main(["train", "--resume", str(step_dir(again / "checkpoints", cut)), "--reshard",
                 "--nproc", "3", "--no-progress"]) == 0
    for rank in range(3):
        went_on = [(m["step"], m["loss"]) for m in read_jsonl(run / "metrics" /
                                                                 f"rank{rank}.jsonl")]
        oracle = [(m["step"], m["loss"]) for m in read_jsonl(again / "metrics" /
                                                                f"rank{rank}.jsonl")]
        assert [x for x in went_on if x[0] > cut] == [x for x in oracle if x[0] > cut]
        assert [s for s, _ in went_on if s > cut] == list(range(cut + 1, 7))


def test_rescue_equals_the_uninterrupted_checkpoint(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    _oracle(tmp_path, "b-sdp", "commit", capsys, monkeypatch)


@long_faults
@pytest.mark.parametrize("phase", list(CUT))
@pytest.mark.parametrize("strategy", ["b-sdp", "n-sdp", "bb-sdp", "nb-sdp"])
def test_rescue_oracle_matrix(tmp_path: Path, strategy: str, phase: str,
                              capsys: pytest.CaptureFixture[str],
                              monkeypatch: pytest.MonkeyPatch) -> None:
    _oracle(tmp_path, strategy, phase, capsys, monkeypatch)


@long_faults
@pytest.mark.parametrize(("extra", "reason"), [
    # 3 units (layers), one per worker: the killed rank 2 holds unit 1 alone
    (["--coverage", "0.3", "--min-holders", "1", "--model-arg", "n_layers=3"],
     "had no surviving holder"),
    (["--zero", "2"], "--zero 2 shards each holder group's optimizer state"),
    (["--fsdp"], "--fsdp shards each holder group's parameters"),
])
def test_fallback_to_the_newest_checkpoint(tmp_path: Path, extra: list[str], reason: str,
                                           capsys: pytest.CaptureFixture[str],
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    run = tmp_path / "run"
    monkeypatch.setenv(faults.ENV, f"{KILL_RANK}:{KILL_STEP}:optimizer:kill")
    capsys.readouterr()
    assert main(["train", *TINY, *extra, "--strategy", "b-sdp", "--nproc", "4", "--min-nproc",
                 "3", "--ckpt-every", "2", "--out", str(run)]) == 0
    lines = capsys.readouterr().err.splitlines()
    said = [ln for ln in lines if "no rescue:" in ln]
    assert len(said) == 1 and reason in said[0] and "falling back to the newest" in said[0], lines
    assert any("going on with 3 from" in ln and "step_00000002" in ln for ln in lines)
    final = read_manifest(step_dir(run / "checkpoints", 6))
    assert final["world"] == 3


def test_coverage_half_goes_on_after_the_rescue(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 44 (1a): at coverage 0.5, 4 workers hold every unit twice and 3 cannot; the 3
    survivors (--min-nproc 3: a further loss ends the run anyway) re-plan with one holder and
    go on, where every worker of the shrunk group failed with a PlanError (exit 1)."""
    run = tmp_path / "run"
    monkeypatch.setenv(faults.ENV, f"{KILL_RANK}:{KILL_STEP}:commit:kill")
    capsys.readouterr()
    assert main(["train", *TINY, "--coverage", "0.5", "--strategy", "b-sdp", "--nproc", "4",
                 "--min-nproc", "3", "--ckpt-every", "2", "--out", str(run)]) == 0
    err = capsys.readouterr().err
    assert f"rank(s) [{KILL_RANK}] of 4 lost; rescued step {KILL_STEP} " in err, err
    assert "re-planned with --min-holders 1 (3 workers at --coverage 0.5 cannot hold 2 " \
           "copies of every unit, and at --min-nproc 3 no loss is rescued)" in err, err
    final = read_manifest(step_dir(run / "checkpoints", 6))
    assert final["world"] == 3 and final["config"]["min_holders"] == 1


class _LauncherGone(BaseException):
    """The launching process stops where it would compose the survivors' copies."""


@long_faults
def test_resume_after_the_launcher_died_during_a_rescue(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 44 (1c): the survivors saved their copies, the launcher stopped before composing
    them (here: at that call); ``--resume RUN`` composes them and goes on from the rescued step,
    not from the older checkpoint."""
    run = tmp_path / "run"
    monkeypatch.setenv(faults.ENV, f"{KILL_RANK}:{KILL_STEP}:commit:kill")

    def gone(*_: object) -> None:
        raise _LauncherGone

    monkeypatch.setattr("subnetdp.train.elastic.rescued_config", gone)
    with pytest.raises(_LauncherGone):
        main(["train", *TINY, "--strategy", "b-sdp", "--nproc", "4", "--min-nproc", "3",
              "--ckpt-every", "3", "--out", str(run)])
    assert [p.name for p in (run / "checkpoints").glob("step_*")] == ["step_00000003"]
    monkeypatch.undo()
    # disarmed, not unset: a fork server's workers keep a variable unset since its start
    monkeypatch.setenv(faults.ENV, "")
    capsys.readouterr()
    assert main(["train", "--resume", str(run), "--no-progress"]) == 0
    err = capsys.readouterr().err
    rescued = step_dir(run / "checkpoints", KILL_STEP)
    assert f"notice: composed {rescued} from the survivors' copies" in err, err
    assert read_manifest(step_dir(run / "checkpoints", 6))["parent"] == rescued.name
