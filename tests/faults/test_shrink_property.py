"""Issue 44's property, with the real commands (the planning functions' side, over many more
cases, is tests/plan/test_shrink.py): for random small runs, what ``subnetdp plan --min-nproc``
refuses, ``subnetdp train`` refuses in the launching process with the same line, before any
worker or file; what it accepts, a real run with one rank SIGKILLed goes on with one worker
fewer, rescued without rollback exactly when ``plan`` called the lost rank recoverable."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from subnetdp.checkpoint.files import read_manifest, step_dir
from subnetdp.cli import main
from subnetdp.distributed import faults
from tests.faults.harness import clear_message, long_faults, run_cli

TINY = ["--recipe", "llama-tiny", "--batch-size", "2", "--seq-len", "32", "--eval-batches", "1",
        "--memory-step", "-1", "--no-progress", "--warmup", "2", "--model-arg", "dim=32",
        "--model-arg", "ffn_hidden=64", "--steps", "4", "--ckpt-every", "2"]


def _cases(n: int, seed: int) -> list[dict[str, object]]:
    """Random b-sdp runs whose own plan works: options as ``plan`` and ``train`` spell them."""
    rng = random.Random(seed)
    out: list[dict[str, object]] = []
    while len(out) < n:
        nproc = rng.randint(3, 4)
        out.append({"layers": rng.randint(2, 4), "nproc": nproc,
                    "min_nproc": rng.randint(1, nproc - 1),
                    "coverage": rng.choice([0.5, 0.6, 0.75, 1.0]),
                    "scheme": rng.choice(["spread", "random"]),
                    "min_holders": rng.randint(1, 2), "seed": rng.randint(0, 3)})
    return out


def _opts(c: dict[str, object]) -> list[str]:
    return [f"--{k.replace('_', '-')}={c[k]}" for k in
            ("nproc", "min_nproc", "coverage", "scheme", "min_holders", "seed")]


def _plan(c: dict[str, object], capsys: pytest.CaptureFixture[str]) -> dict | None:
    """``plan``'s JSON report of the case (None: the run's own plan fails)."""
    capsys.readouterr()
    try:
        code = main(["plan", "--units", str(c["layers"]), *_opts(c), "--json"])
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr().out
    return json.loads(out) if code == 0 else None


def test_what_plan_refuses_train_refuses_at_start(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    refused = 0
    for i, c in enumerate(_cases(40, seed=4401)):
        report = _plan(c, capsys)
        if report is None or "refused" not in report["shrink"]:
            continue
        out = tmp_path / f"run{i}"
        code, err = run_cli(["train", *TINY, "--model-arg", f"n_layers={c['layers']}",
                             *_opts(c), "--out", str(out)], capsys)
        assert code == 2 and clear_message(err) == \
            f"subnetdp train: {report['shrink']['refused']}", (c, err)
        assert not out.exists()
        refused += 1
        if refused == 4:
            break
    assert refused == 4


@long_faults
@pytest.mark.dist
@pytest.mark.timeout(900)
def test_what_plan_accepts_goes_on_after_a_loss(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(4402)
    launched = rescued = 0
    for i, c in enumerate(_cases(40, seed=4402)):
        report = _plan(c, capsys)
        if report is None or "refused" in report["shrink"]:
            continue
        rank = rng.randrange(int(c["nproc"]))  # type: ignore[call-overload]
        recoverable = rank in report["rescuable_ranks"]
        phase = "commit" if recoverable else "forward"  # commit: rescuable runs only
        monkeypatch.setenv(faults.ENV, f"{rank}:3:{phase}:kill")
        out = tmp_path / f"run{i}"
        code, err = run_cli(["train", *TINY, "--model-arg", f"n_layers={c['layers']}",
                             *_opts(c), "--out", str(out)], capsys)
        assert code == 0, (c, err)
        assert (f"rank(s) [{rank}] of {c['nproc']} lost; rescued step 3 " in err) == recoverable, \
            (c, rank, err)
        if not recoverable:
            assert "going on with" in err and "(resharded; the steps after it are replayed)" \
                in err, (c, err)
        final = read_manifest(step_dir(out / "checkpoints", 4))
        assert final["world"] == int(c["nproc"]) - 1, (c, err)  # type: ignore[call-overload]
        launched += 1
        rescued += recoverable
        if launched == 4:
            break
    assert launched == 4 and rescued >= 1, (launched, rescued)
