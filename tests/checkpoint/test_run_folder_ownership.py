"""Issue 27, root cause 1: a run folder is written or deleted only by the command that names it
([Note: outputs apart from sources] in checkpoint/rundir.py), and a resume from an older
checkpoint sets the newer ones aside ([Note: checkpoint lineage] in checkpoint/files.py).

The property: every command, with each of its path arguments pointed at an existing run folder
R (or into it), leaves R's sha256 tree as it was, unless the command's documented purpose is to
change R (``plot R`` adds ``R/curves.png``). Refusals are one line and happen before any worker
starts (``no_launch``)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from subnetdp.checkpoint.files import (
    FORMAT,
    VERSION,
    lineage,
    prune,
    publish,
    read_manifest,
    resolve_checkpoint,
    write_manifest,
    write_shard,
)
from subnetdp.checkpoint.rundir import SUPERSEDED
from tests.checkpoint.conftest import TINY_RUN
from tests.faults.harness import clear_message, fingerprint, run_cli

TRAIN = ["train", *TINY_RUN, "--steps", "2"]
PLAN = ["plan", "--recipe", "llama-tiny", "--nproc", "2", "--coverage", "0.5"]
# (id, argv with {R} the run, {P} the folder holding it, {T} a fresh path; what must happen:
# "ok", or a piece of the one-line refusal)
CASES = [
    ("train-out", [*TRAIN, "--out", "{R}"], "already holds checkpoints"),
    ("train-out-nested", [*TRAIN, "--out", "{R}/checkpoints"], "runs are not nested"),
    ("train-config-dir", ["train", "--config", "{R}"], "no such file"),
    ("train-config-replay", ["train", "--config", "{R}/config.json", "--steps", "2"],
     "already holds checkpoints"),
    ("train-config-replay-overwrite", ["train", "--config", "{R}/config.json", "--overwrite"],
     "add --out"),
    ("train-config-out", [*TRAIN, "--config", "{R}/config.json", "--out", "{R}"],
     "already holds checkpoints"),
    ("train-resume-done", ["train", "--resume", "{R}", "--steps", "4"], "nothing left to train"),
    ("train-data-dir", [*TRAIN, "--data-dir", "{R}", "--out", "{T}"], "is a run folder"),
    ("train-tokenizer", [*TRAIN, "--tokenizer", "{R}", "--out", "{T}"], "is a run folder"),
    ("train-plan-file", [*TRAIN, "--strategy", "b-sdp", "--nproc", "2", "--plan-file", "{R}",
                         "--out", "{T}"], "is a run folder"),
    ("train-data-files", [*TRAIN, "--dataset", "json", "--data-files", "{R}", "--out", "{T}"],
     "is a run folder"),
    ("train-out-holds-input", [*TRAIN, "--tokenizer", "{R}/tokenizer.json", "--out", "{P}",
                               "--overwrite"], "lies in the run folder"),
    ("export-hf-into-run", ["export", "{R}", "--format", "hf", "--out", "{R}", "--overwrite"],
     "is the source"),
    ("export-into-run", ["export", "{R}", "--out", "{R}/model.safetensors", "--overwrite"],
     "lies inside the source"),
    ("export-ckpt-into-run", ["export", "{R}/checkpoints/step_00000002", "--format", "hf",
                              "--out", "{R}", "--overwrite"], "holds the source"),
    ("export-hf-around-run", ["export", "{R}", "--format", "hf", "--out", "{P}", "--overwrite"],
     "holds the source"),
    ("export-reads-run", ["export", "{R}", "--out", "{T}.safetensors"], "ok"),
    ("eval-reads-run", ["eval", "{R}"], "ok"),
    ("eval-out-run", ["eval", "{R}", "--eval-tasks", "arc_easy", "--out", "{R}"], "is the source"),
    ("eval-out-in-run", ["eval", "{R}", "--eval-tasks", "arc_easy", "--out", "{R}/arc.json"],
     "lies inside the source"),
    ("plot-run", ["plot", "{R}"], "ok"),  # documented: adds R/curves.png
    ("plot-out-run", ["plot", "{R}", "--out", "{R}"], "is the run folder"),
    ("plot-out-run-file", ["plot", "{R}", "--out", "{R}/summary.json"], "inside the run folder"),
    ("plot-out-metrics", ["plot", "{R}", "--out", "{R}/metrics/x.png"],
     "inside the run folder"),
    ("plan-out-run", [*PLAN, "--out", "{R}"], "is the run folder"),
    ("plan-out-run-file", [*PLAN, "--out", "{R}/plan.json"], "inside the run folder"),
    ("plan-plan-file-run", [*PLAN[:-2], "--plan-file", "{R}"], "{R}"),
    ("plan-out-is-plan-file", [*PLAN[:-2], "--plan-file", "{R}/plan.json", "--out",
                               "{R}/plan.json"], "is the source"),
    ("demo-runs", ["demo", "--runs", "{R}", "--steps", "2"], "is the run folder"),
    ("compare-runs", ["compare", "--quick", "--runs", "{R}"], "is the run folder"),
    ("compare-out", ["compare", "--quick", "--out", "{R}"], "is the run folder"),
]


@pytest.mark.parametrize(("argv", "expect"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_command_leaves_a_run_it_was_not_given_as_it_was(
        argv: list[str], expect: str, copy_run: Path, tmp_path: Path, no_launch: None,
        capsys: pytest.CaptureFixture[str]) -> None:
    where = {"{R}": str(copy_run), "{P}": str(copy_run.parent), "{T}": str(tmp_path / "T")}
    args = [a for a in argv]
    for key, value in where.items():
        args = [a.replace(key, value) for a in args]
        expect = expect.replace(key, value)
    before = fingerprint(copy_run)
    code, err = run_cli(args, capsys)
    after = fingerprint(copy_run)
    if args[:2] == ["plot", str(copy_run)] and len(args) == 2:
        assert code == 0 and after.pop("curves.png")  # its documented output, beside the run
    assert after == before
    if expect == "ok":
        assert code == 0, err
        return
    message = clear_message(err)
    assert code != 0 and message is not None, err
    assert expect in message, message


# -- the samples of the issue ----------------------------------------------------------------
def test_a_shared_config_never_deletes_the_folder_it_names(
        copy_run: Path, tmp_path: Path, no_launch: None,
        capsys: pytest.CaptureFixture[str]) -> None:
    """``"out": "../../elsewhere", "overwrite": true`` in a shared JSON config, and
    ``overwrite = true`` in a TOML one."""
    work = tmp_path / "a" / "b"
    work.mkdir(parents=True)
    relative = Path("..") / ".." / "case" / "R"
    shared = tmp_path / "shared.json"
    shared.write_text(json.dumps({"recipe": "llama-tiny", "out": str(relative),
                                  "overwrite": True}))
    before = fingerprint(copy_run)
    monkey = pytest.MonkeyPatch()
    monkey.chdir(work)
    try:
        code, err = run_cli(["train", "--config", str(shared), "--steps", "2"], capsys)
    finally:
        monkey.undo()
    assert code == 2 and "already holds checkpoints" in str(clear_message(err)), err
    toml = tmp_path / "shared.toml"
    toml.write_text(f'recipe = "llama-tiny"\nout = "{copy_run}"\noverwrite = true\n')
    code, err = run_cli(["train", "--config", str(toml)], capsys)
    assert code == 2 and "overwrite acts on a run folder" in str(clear_message(err)), err
    assert fingerprint(copy_run) == before


def test_resuming_an_older_checkpoint_sets_the_newer_ones_aside(
        copy_run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--resume R/checkpoints/step_00000002 --steps 3 --ckpt-keep 1`` when step 4 exists:
    step 4 is moved aside, byte for byte, and pruning keeps the new step 3 (on main it kept
    the old step 4 by its name and deleted the run's own step 3)."""
    root = copy_run / "checkpoints"
    old = fingerprint(root / "step_00000004")
    code, err = run_cli(["train", "--resume", str(root / "step_00000002"), "--steps", "3",
                         "--ckpt-keep", "1", "--no-progress"], capsys)
    assert code == 0, err
    assert "newer checkpoints were moved to" in err
    assert sorted(p.name for p in root.iterdir()) == ["step_00000003", SUPERSEDED]
    (aside,) = (root / SUPERSEDED).iterdir()
    assert fingerprint(aside / "step_00000004") == old
    assert (aside / "metrics" / "rank0.jsonl").is_file()
    assert resolve_checkpoint(copy_run) == root / "step_00000003"  # a later --resume R
    assert read_manifest(root / "step_00000003")["parent"] == "step_00000002"


# -- lineage, in-process ------------------------------------------------------------------------
_MANIFEST: dict[str, object] = {
    "format": FORMAT, "version": VERSION, "strategy": "ddp", "time": 0.0, "plan": {},
    "recipe": "toy", "model_overrides": {}, "model_state": [], "config": {}, "world": 1,
    "optimizer": {"class": "AdamW", "like_states": [], "scalar_states": [], "param_groups": [],
                  "scheduler": {}},
}


def _ckpt(root: Path, step: int, parent: int | None, *, v2: bool = False) -> Path:
    staging = root / f".step_{step:08d}.partial"
    staging.mkdir(parents=True)
    files = {"rank00000.safetensors": write_shard(staging / "rank00000.safetensors",
                                                  {"model/w": torch.zeros(1)}, {})}
    body = {**_MANIFEST, "step": step, "files": files,
            "parent": None if parent is None else f"step_{parent:08d}"}
    if v2:  # a version 2 manifest: no parent entry
        body = {k: v for k, v in body.items() if k != "parent"} | {"version": 2}
    write_manifest(staging, body)
    publish(staging, root / f"step_{step:08d}")
    return root / f"step_{step:08d}"


def test_prune_follows_the_lineage_not_the_names(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    _ckpt(root, 2, None)
    _ckpt(root, 4, 2)  # the abandoned trajectory's (had it not been set aside)
    new3 = _ckpt(root, 3, 2)
    assert lineage(new3) == [new3, root / "step_00000002"]
    assert prune(root, 1, newest=new3) == [root / "step_00000002", root / "step_00000004"]
    assert [p.name for p in root.iterdir()] == ["step_00000003"]


def test_lineage_of_version_2_manifests_is_by_name(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    for step in (1, 2):
        _ckpt(root, step, None, v2=True)
    new = _ckpt(root, 5, 2)
    assert lineage(new) == [new, root / "step_00000002", root / "step_00000001"]
    assert prune(root, 2, newest=new) == [root / "step_00000001"]


def test_set_aside_never_deletes(copy_run: Path) -> None:
    from subnetdp.checkpoint.rundir import set_aside_newer

    root = copy_run / "checkpoints"
    assert set_aside_newer(root / "step_00000004") is None
    before = fingerprint(root)
    aside = set_aside_newer(root / "step_00000002")
    assert aside is not None and aside.parent == root / SUPERSEDED
    after = fingerprint(root)
    moved = {k.split("/", 2)[2]: v for k, v in after.items() if k.count("/") >= 2
             and k.startswith(SUPERSEDED)}
    newer = {k: v for k, v in before.items() if k.startswith("step_00000004")}
    assert newer and all(moved[k] == v for k, v in newer.items())
    assert "step_00000004" not in after and "step_00000002" in after
    shutil.rmtree(root / SUPERSEDED)
