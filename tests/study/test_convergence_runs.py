"""The convergence study end to end on its smoke configuration (3 steps per cell, small
models, 2 workers; the full-data ResNet regime is left out: it differs from the over-fitting
one only in its data): the cells train, the per-cell extras are stored (downstream evaluation
of the LLaMA runs, training accuracy of the image runs, the 64-image subset), a second call
trains and evaluates nothing, and convergence.md is written with its tables and plots."""

from __future__ import annotations

import dataclasses
import json
from functools import partial
from pathlib import Path

import pytest

from subnetdp.study.convergence import DOWNSTREAM_FILE, SMOKE, TRAIN_EVAL_FILE, after_cell
from subnetdp.study.runner import cell_dir, run_suite
from subnetdp.study.suite import select

pytestmark = pytest.mark.dist

@pytest.mark.slow  # ~1 min on a quiet machine: 6 short runs and 3 downstream evaluations
@pytest.mark.timeout(900)
def test_convergence_smoke(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                            capsys: pytest.CaptureFixture[str]) -> None:
    from subnetdp.data import DatasetMissingError
    from subnetdp.data.locate import fashion_mnist_dir

    try:
        fashion_mnist_dir()
    except DatasetMissingError as e:
        pytest.skip(str(e))
    suite = dataclasses.replace(select(SMOKE, tasks=["llama", "overfit"]),
                                methods=("ddp", "b-sdp"), nproc=2)
    runs, logs = tmp_path / "runs", []
    after = partial(after_cell, downstream_limit=4, log=logs.append)
    results = run_suite(suite, runs, log=logs.append, after=after)
    assert len(results) == 6 and all(r.summary is not None for r in results)
    for r in results:
        d = cell_dir(runs, r.cell, 2)
        if r.cell.task == "llama":
            down = json.loads((d / DOWNSTREAM_FILE).read_text())  # lm_eval: make setup
            assert set(down["tasks"]) == {"arc_easy", "boolq", "hellaswag", "openbookqa",
                                          "sciq"}
            assert down["step"] == r.cell.steps and down["tasks"]["boolq"]["chance"] == 0.5
        else:
            train = json.loads((d / TRAIN_EVAL_FILE).read_text())
            assert train["train_samples"] == 64 and 0 <= train["train_accuracy"] <= 1
    assert (runs / "data" / "fmnist-train64").is_dir()
    from subnetdp.evals.tasks import data_root

    # HellaSwag's preprocessing ran in memory, not into the package's folder
    assert not list(data_root().rglob("cache-*.arrow"))

    # The CLI on the same cells (its --quick suite swapped for this one): it resumes, trains
    # and evaluates nothing, and writes the results.
    from subnetdp.cli import main
    from subnetdp.study import convergence

    monkeypatch.setattr(convergence, "SMOKE", suite)
    assert main(["compare", "--suite", "convergence", "--quick", "--runs", str(runs),
                 "--out", str(tmp_path / "out")]) == 0
    printed = capsys.readouterr().out
    assert printed.count("done before") == 6 and "downstream macro" not in printed
    written = sorted((tmp_path / "out").iterdir())
    md = (tmp_path / "out" / "convergence.md").read_text()
    for part in ("## llama: llama-tiny", "## overfit: resnet18-fmnist, S = 3 steps, 64 training",
                 "Convergence criterion: DDP's training loss", "### Wall-clock view",
                 "### Training vs test accuracy", "| b-sdp (FLOP-matched) | 6 |",
                 "### Downstream (zero-shot, lm-eval)", "### Findings"):
        assert part in md, part
    assert "| *chance* |" in md
    assert {p.name for p in written} >= {"convergence.md", "convergence.json",
                                         "convergence_llama.png", "convergence_overfit.png"}


def test_compare_refuses_bad_options(capsys: pytest.CaptureFixture[str]) -> None:
    from subnetdp.cli import main

    assert main(["compare", "--suite", "convergence", "--downstream-limit", "0"]) == 2
    assert "--downstream-limit must be >= 1" in capsys.readouterr().err
    assert main(["compare", "--suite", "convergence", "--tasks", "gpt"]) == 2
    assert "the suite has ['llama', 'resnet', 'overfit']" in capsys.readouterr().err
