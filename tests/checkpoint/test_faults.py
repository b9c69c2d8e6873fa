"""Faults around checkpoints and run folders, each tried as a user meets it: every case asserts
the one-line message the user sees and that no file of an earlier checkpoint changed (sha256
of every file before and after). Long cases (several restarts) are marked ``long`` and run with
``SUBNETDP_LONG_TESTS=1`` (tests/conftest.py)."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import json
import multiprocessing
import os
import shutil
import signal
import subprocess
import threading
import time
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch

from subnetdp.checkpoint.files import (
    MANIFEST,
    assemble_full_state,
    list_checkpoints,
    manifest_checksum,
    read_manifest,
)
from subnetdp.checkpoint.rundir import LOCK, hold_run_folder
from subnetdp.cli import main
from subnetdp.metrics.sinks import read_jsonl
from tests.workers import patch_workers

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]

STEPS, EVERY, WORLD = 6, 3, 2
TINY = ["--recipe", "llama-tiny", "--batch-size", "2", "--seq-len", "32", "--eval-batches", "2",
        "--memory-step", "-1", "--no-progress", "--warmup", "2", "--nproc", str(WORLD),
        "--coverage", "0.5", "--model-arg", "n_layers=4", "--model-arg", "dim=64",
        "--model-arg", "ffn_hidden=128", "--strategy", "b-sdp"]
_RUN: list[Path] = []


@pytest.fixture
def run(tmp_path_factory: pytest.TempPathFactory, tmp_path: Path) -> Path:
    """A private copy of a finished 6-step b-sdp run with checkpoints at steps 3 and 6."""
    if not _RUN:
        out = tmp_path_factory.mktemp("faults") / "b-sdp"
        assert main(["train", *TINY, "--steps", str(STEPS), "--ckpt-every", str(EVERY),
                     "--out", str(out)]) == 0
        _RUN.append(out)
    return Path(shutil.copytree(_RUN[0], tmp_path / "run"))


def _snapshot(root: Path) -> dict[str, str]:
    """Every file of a run folder but its logs (each launch adds its workers' output there)."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*"))
            if p.is_file() and p.relative_to(root).parts[0] != "logs"}


def _err(args: list[str], capsys: pytest.CaptureFixture[str], code: int = 2) -> str:
    capsys.readouterr()
    assert main(args) == code
    err = capsys.readouterr().err
    print(f"$ subnetdp {args[0]} ... -> {err.strip()}")
    return err


def _one_line(err: str) -> str:
    lines = [x for x in err.splitlines() if x.strip() and not x.startswith("notice:")]
    assert len(lines) == 1, err
    return lines[0]


def _reseal(ckpt: Path, change: dict[str, Any]) -> None:
    """Edit a manifest *and* recompute its checksum, as a forger (or a buggy tool) would."""
    manifest = json.loads((ckpt / MANIFEST).read_text())
    manifest.update(change)
    manifest["checksum"] = manifest_checksum(manifest)
    (ckpt / MANIFEST).write_text(json.dumps(manifest))


# -- a poisoned "last good" checkpoint ---------------------------------------------------------
def test_absurd_lr_names_a_finite_checkpoint_and_resuming_it_is_not_nan_at_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "nan"
    err = _one_line(_err(["train", *TINY, "--steps", "6", "--ckpt-every", "1", "--lr", "1e30",
                          "--grad-clip", "0", "--out", str(out)], capsys, code=1))
    assert "training stopped and the last good checkpoint is kept" in err
    named = Path(err.split("checkpoint is kept: ")[1].split(". ")[0])
    assert named == list_checkpoints(out / "checkpoints")[-1]
    state = assemble_full_state(named, read_manifest(named))
    assert all(bool(torch.isfinite(v).all()) for v in state.values())  # really good
    before = _snapshot(named)
    start = read_manifest(named)["step"]
    again = _err(["train", "--resume", str(named), "--steps", "8"], capsys, code=1)
    first = read_jsonl(out / "metrics" / "rank0.jsonl")[start]
    assert first["step"] == start + 1 and first["loss"] is not None  # finite: not NaN at once
    assert "last good checkpoint is kept" in again
    assert _snapshot(named) == before


# -- run-folder ownership ----------------------------------------------------------------------
def test_a_second_writer_is_refused_naming_the_holder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "busy"
    with hold_run_folder(out):  # this process holds it, as a live run would
        err = _one_line(_err(["train", *TINY, "--steps", "2", "--out", str(out)], capsys))
    assert f"{out} is in use by another run: pid {os.getpid()} on host" in err
    assert sorted(p.name for p in out.iterdir()) == []  # nothing written, lock released


def _wait_for(marker: Path, started: Path) -> None:
    """In a worker: say so at ``started``, then wait (at most 200 s) until ``marker`` exists."""
    started.touch()
    deadline = time.monotonic() + 200
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.05)


def _second_run(argv: list[str], report: Path) -> None:
    """In a process of its own: ``subnetdp ARGV``; its exit code and stderr to ``report``."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(argv)
    report.write_text(json.dumps({"code": code, "err": err.getvalue()}))


def test_two_concurrent_runs_into_one_out(tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A real second process, started while the first run trains, is refused in its launching
    process; the first run's files are all its own. The first run is this process's, the second
    a child of this process's fork server (warm: it imports nothing), and the first run's
    workers wait until the second has ended, so the second meets it mid-run on any load."""
    out, marker, report = tmp_path / "shared", tmp_path / "second-ended", tmp_path / "second"
    started = tmp_path / "first-started"
    second = multiprocessing.get_context("forkserver").Process(
        target=_second_run, args=(["train", *TINY, "--steps", "4", "--seed", "1", "--out",
                                   str(out)], report))

    def start_second() -> None:
        try:
            # the first run's workers are up: its launch started the fork server (the second
            # must not start it first, without the launch's preload)
            deadline = time.monotonic() + 120
            while not started.exists():
                if time.monotonic() > deadline:
                    return  # the first run never started: asserted below
                time.sleep(0.05)
            second.start()
            second.join(200)
        finally:
            marker.touch()

    patch_workers(monkeypatch, partial(_wait_for, marker, started))
    thread = threading.Thread(target=start_second)
    thread.start()
    try:
        code = main(["train", *TINY, "--steps", "12", "--ckpt-every", "6", "--out", str(out)])
    finally:
        thread.join()
    assert code == 0 and second.exitcode == 0 and second.pid != os.getpid()
    refused = json.loads(report.read_text())
    assert refused["code"] == 2, refused["err"][-3000:]
    err = _one_line(refused["err"])
    assert f"pid {os.getpid()} on host" in err and "use another --out" in err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 12 and summary["config"]["seed"] == 0
    for r in range(WORLD):  # no interleaved lines of the refused run
        assert [m["step"] for m in read_jsonl(out / "metrics" / f"rank{r}.jsonl")] == list(
            range(1, 13))
    assert not (out / LOCK).exists()


def test_a_stale_lock_of_a_dead_process_is_taken_over(tmp_path: Path) -> None:
    out = tmp_path / "stale"
    out.mkdir()
    dead = subprocess.Popen(["true"])
    dead.wait()
    (out / LOCK).write_text(json.dumps({"pid": dead.pid, "host": "x", "since": 0}))
    assert main(["train", *TINY, "--steps", "2", "--out", str(out)]) == 0
    assert (out / "summary.json").exists() and not (out / LOCK).exists()


def test_an_out_with_an_earlier_run_is_refused_unless_overwrite(
    run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    shutil.rmtree(run / "checkpoints")  # an earlier run without checkpoints
    before = _snapshot(run)
    err = _one_line(_err(["train", *TINY, "--steps", "2", "--out", str(run)], capsys))
    assert "already holds an earlier run's files" in err and "--overwrite" in err
    assert _snapshot(run) == before
    assert main(["train", *TINY, "--steps", "2", "--out", str(run), "--overwrite"]) == 0
    for r in range(WORLD):  # replaced, not appended to
        assert [m["step"] for m in read_jsonl(run / "metrics" / f"rank{r}.jsonl")] == [1, 2]
    assert json.loads((run / "summary.json").read_text())["steps"] == 2


# -- manifests that verify themselves ---------------------------------------------------------
def test_one_flipped_bit_in_the_manifest_step_is_refused(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    last = run / "checkpoints" / "step_00000006"
    text = (last / MANIFEST).read_text()
    assert '"step": 6,' in text
    (last / MANIFEST).write_text(text.replace('"step": 6,', '"step": 3,'))
    before = _snapshot(run)
    for args in (["train", "--resume", str(run), "--steps", "9"],
                 ["export", str(run), "--out", str(tmp_path / "m.safetensors")],
                 ["eval", str(run)]):
        assert "does not match its own checksum" in _one_line(_err(args, capsys))
    assert _snapshot(run) == before
    _reseal(last, {"step": 3})  # consistent with itself, but not with its folder
    before = _snapshot(run)
    err = _one_line(_err(["train", "--resume", str(run), "--steps", "9"], capsys))
    assert "says step 3 but lies in step_00000006" in err
    assert _snapshot(run) == before and not (tmp_path / "m.safetensors").exists()


def test_manifest_schema_is_checked(run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    last = run / "checkpoints" / "step_00000006"
    _reseal(last, {"config": {**read_manifest(last)["config"], "evil": 1}})
    assert "unknown config keys ['evil']" in _one_line(_err(["eval", str(run)], capsys))
    _reseal(last, {"config": read_manifest(run / "checkpoints" / "step_00000003")["config"],
                   "world": "2"})
    assert "'world' is a str" in _one_line(_err(["eval", str(run)], capsys))


@pytest.mark.parametrize("name", ["../../outside.safetensors", "/tmp/outside.safetensors",
                                  "rank00000.safetensors/../../x", "model.bin"])
def test_path_traversal_in_the_manifest_is_refused(
    name: str, run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    last = run / "checkpoints" / "step_00000006"
    files = read_manifest(last)["files"]
    files[name] = files.pop("rank00001.safetensors")
    _reseal(last, {"files": files})
    before = _snapshot(run)
    for args in (["export", str(run), "--out", str(tmp_path / "m.safetensors")],
                 ["train", "--resume", str(run), "--steps", "9"]):
        err = _one_line(_err(args, capsys))
        assert "lists files" in err and "refused (nothing was read)" in err
    assert _snapshot(run) == before and not (tmp_path / "m.safetensors").exists()


def test_a_shard_symlinked_out_of_the_folder_is_refused(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    last = run / "checkpoints" / "step_00000006"
    outside = tmp_path / "outside.safetensors"
    shutil.move(last / "rank00001.safetensors", outside)  # same bytes: checksums still match
    (last / "rank00001.safetensors").symlink_to(outside)
    before = _snapshot(run)
    for args in (["export", str(run), "--out", str(tmp_path / "m.safetensors")],
                 ["train", "--resume", str(run), "--steps", "9"]):
        assert "outside the checkpoint folder; refused" in _one_line(_err(args, capsys))
    assert _snapshot(run) == before


def test_a_newer_step_without_a_manifest_is_skipped_with_a_notice(
    run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (run / "checkpoints" / "step_00000006" / MANIFEST).unlink()
    capsys.readouterr()
    assert main(["eval", str(run), "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["step"] == EVERY
    assert "notice: skipping" in captured.err and "step_00000006" in captured.err


# -- damaged shards ---------------------------------------------------------------------------
def _truncate(p: Path) -> None:
    p.write_bytes(p.read_bytes()[:100])


def _corrupt(p: Path) -> None:
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0x01
    p.write_bytes(bytes(data))


def _swap(p: Path) -> None:
    other = p.with_name("rank00000.safetensors")
    tmp = p.with_name("tmp")
    p.rename(tmp)
    other.rename(p)
    tmp.rename(other)


@pytest.mark.parametrize(("damage", "message"), [
    (_truncate, "truncated or damaged"), (_corrupt, "does not match its sha256 checksum"),
    (Path.unlink, "is missing"), (_swap, "bytes but the manifest says|sha256 checksum"),
])
def test_damaged_shards(damage: Any, message: str, run: Path, tmp_path: Path,
                        capsys: pytest.CaptureFixture[str]) -> None:
    import re

    damage(run / "checkpoints" / "step_00000006" / "rank00001.safetensors")
    before = _snapshot(run)
    for args in (["train", "--resume", str(run), "--steps", "9"],
                 ["export", str(run), "--out", str(tmp_path / "m.safetensors")]):
        err = _one_line(_err(args, capsys))
        assert re.search(message, err) and "use an earlier" in err
    assert _snapshot(run) == before


# -- full disk and write errors ---------------------------------------------------------------
def _assert_failed_write(err: str, run: Path, before: dict[str, str]) -> None:
    assert "writing checkpoint" in err and "failed" in err
    assert "its staging folder was removed and the newest intact checkpoint is " \
           f"{run / 'checkpoints' / 'step_00000006'}" in err
    assert not list((run / "checkpoints").glob(".*"))  # no staging folder left
    after = _snapshot(run)
    assert {k: v for k, v in after.items() if k.startswith("checkpoints")} == {
        k: v for k, v in before.items() if k.startswith("checkpoints")}


def _full_disk_on_rank_1() -> None:
    """In a worker: rank 1's checkpoint writer fails with ENOSPC."""
    import subnetdp.checkpoint.checkpointer as checkpoint

    real = checkpoint.write_shard

    def full(path: Path, *args: Any) -> Any:
        if os.environ["RANK"] == "1":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return real(path, *args)

    checkpoint.write_shard = full  # type: ignore[assignment]


def test_a_write_error_removes_the_staging_folder(
    run: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """ENOSPC raised in rank 1's writer."""
    patch_workers(monkeypatch, _full_disk_on_rank_1)
    before = _snapshot(run)
    err = _one_line(_err(["train", "--resume", str(run), "--steps", "9"], capfd, code=1))
    assert "rank 1 could not write its file: [Errno 28] No space left on device" in err
    _assert_failed_write(err, run, before)


def test_a_full_disk_tmpfs(run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A real full disk: the run folder on a tmpfs with room for less than one checkpoint."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    used = sum(p.stat().st_size for p in run.rglob("*") if p.is_file())
    size_kb = used // 1024 + 3 * 1024  # < one more checkpoint (about 8 MB)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_kb}k", "tmpfs", str(mnt)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (not root); the ENOSPC case above covers it")
    try:
        small = Path(shutil.copytree(run, mnt / "run"))
        before = _snapshot(small)
        err = _one_line(_err(["train", "--resume", str(small), "--steps", "9"], capsys,
                             code=1))
        assert "No space left on device" in err
        _assert_failed_write(err, small, before)
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def _node_local_checkpoints_on_rank_1(elsewhere: Path) -> None:
    """In a worker: rank 1 writes its checkpoints under ``elsewhere`` (a node-local --out)."""
    import subnetdp.checkpoint.checkpointer as checkpoint

    real = checkpoint.checkpoints_root
    if os.environ["RANK"] == "1":
        checkpoint.checkpoints_root = lambda run_dir: real(elsewhere)  # type: ignore[assignment]


def _node_local_manifests_on_rank_1(elsewhere: Path) -> None:
    """In a worker: rank 1 reads checkpoints under ``elsewhere`` (a node-local --out)."""
    import subnetdp.checkpoint.checkpointer as checkpoint

    real = checkpoint.read_manifest
    if os.environ["RANK"] == "1":
        checkpoint.read_manifest = lambda ckpt, **kw: real(elsewhere / ckpt.name, **kw)  # type: ignore[assignment]


def test_ranks_that_do_not_share_the_run_folder(
    run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
) -> None:
    """Node-local --out: rank 1 sees its own (empty) folder where rank 0 sees the run's."""
    patch_workers(monkeypatch, partial(_node_local_checkpoints_on_rank_1, tmp_path / "node1"))
    before = _snapshot(run)
    err = _one_line(_err(["train", "--resume", str(run), "--steps", "9"], capfd, code=1))
    assert "rank 1 on" in err and "does not see the folder" in err and "node-local" in err
    _assert_failed_write(err, run, before)


def test_resuming_on_ranks_that_do_not_share_the_run_folder(
    run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
) -> None:
    """Node-local --out on resume: rank 1 finds no checkpoint where rank 0 finds it."""
    patch_workers(monkeypatch, partial(_node_local_manifests_on_rank_1, tmp_path / "node1"))
    before = _snapshot(run)
    err = _one_line(_err(["train", "--resume", str(run), "--steps", "9"], capfd, code=1))
    assert "rank 1 does not see the checkpoint" in err and "node-local --out" in err
    assert _snapshot(run) == before


# -- kill -9 with restarts --------------------------------------------------------------------
def _killing_worker(cfg_dict: dict[str, Any], kills: dict[int, int]) -> dict[str, Any]:
    """The normal worker; on attempt ``a`` in ``kills`` rank 1 SIGKILLs itself while writing
    the checkpoint of step ``kills[a]`` (its file half written, no manifest yet), after noting
    the sha256 of every published checkpoint file in ``<out>/before-kill-<a>.json``."""
    import subnetdp.checkpoint.checkpointer as checkpoint
    import subnetdp.train.trainer as trainer

    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if attempt in kills and os.environ["RANK"] == "1":
        real, root = checkpoint.write_shard, Path(cfg_dict["out"]) / "checkpoints"

        def dying(path: Path, *args: Any) -> Any:
            if path.parent.name == f".step_{kills[attempt]:08d}.partial":
                published = {f"{c.name}/{k}": v for c in list_checkpoints(root)
                             for k, v in _snapshot(c).items()}
                (root.parent / f"before-kill-{attempt}.json").write_text(json.dumps(published))
                path.write_bytes(b"half a file")
                os.kill(os.getpid(), signal.SIGKILL)
            return real(path, *args)

        checkpoint.write_shard = dying  # type: ignore[assignment]
    return trainer.train_worker(cfg_dict)


@pytest.mark.long
def test_kill_9_while_writing_with_restarts(tmp_path: Path) -> None:
    """Two SIGKILLs, each inside a checkpoint write, two restarts: every checkpoint published
    before a kill stays byte-identical, no staging folder survives, and the run ends exactly
    as an uninterrupted one."""
    from subnetdp.distributed.launch import launch
    from subnetdp.train.config import TrainConfig
    from subnetdp.train.tasks import make_task

    def config(out: Path) -> TrainConfig:
        return TrainConfig(recipe="llama-tiny", strategy="b-sdp", coverage=0.5, nproc=WORLD,
                           steps=9, out=str(out), batch_size=2, seq_len=32, warmup=2,
                           eval_batches=1, memory_step=-1, progress=False, ckpt_every=3,
                           ckpt_keep=5, max_restarts=2,
                           model_args={"n_layers": 4, "dim": 64, "ffn_hidden": 128}).resolved()

    ref, new = config(tmp_path / "ref"), config(tmp_path / "new")
    make_task(ref)
    launch(_killing_worker, (ref.to_dict(), {}), nproc=WORLD, run_id="ref", max_restarts=2)
    launch(_killing_worker, (new.to_dict(), {0: 6, 1: 9}), nproc=WORLD, run_id="new",
           max_restarts=2)
    root = tmp_path / "new" / "checkpoints"
    assert [c.name for c in list_checkpoints(root)] == [
        "step_00000003", "step_00000006", "step_00000009"]
    assert not list(root.glob(".*"))
    after = {f"{c.name}/{k}": v for c in list_checkpoints(root) for k, v in _snapshot(c).items()}
    for attempt in (0, 1):
        before = json.loads((tmp_path / "new" / f"before-kill-{attempt}.json").read_text())
        assert before and all(after[k] == v for k, v in before.items())
    a = assemble_full_state(tmp_path / "ref" / "checkpoints" / "step_00000009",
                            read_manifest(tmp_path / "ref" / "checkpoints" / "step_00000009"))
    b = assemble_full_state(root / "step_00000009", read_manifest(root / "step_00000009"))
    assert all(torch.equal(a[k], b[k]) for k in a)
