"""The convergence study's pure parts: the flattening criterion, curves against time, the
suite's cells and the Fashion-MNIST subset folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from subnetdp.study.convergence import CONVERGENCE, METHODS, SMOKE
from subnetdp.study.convergence_report import flattened, run_curves, value_at_time
from subnetdp.study.suite import cell_config, enumerate_cells, select


def test_flattened() -> None:
    decaying = [10.0 / (1 + i) for i in range(100)]  # still falling 25% over the last fifth
    flat, change = flattened(decaying)
    assert not flat and change == pytest.approx((10 / 81 - 10 / 100) / (10 / 100))
    plateau = [5.0 - 1.0 / (1 + i) for i in range(100)]
    assert flattened(plateau) == (True, pytest.approx((1 / 81 - 1 / 100) / (5 - 1 / 100)))
    noisy = [4.0 + (0.5 if i % 2 else -0.5) for i in range(100)]
    assert flattened(noisy, window=10)[0] and not flattened(noisy)[0]
    assert flattened([1.0]) == (False, pytest.approx(float("nan"), nan_ok=True))


def test_run_curves_and_value_at_time(tmp_path: Path) -> None:
    (tmp_path / "metrics").mkdir()
    recs = [{"step": s, "loss": 5.0 - s, "time/step_s": 2.0} for s in range(1, 5)]
    (tmp_path / "metrics" / "rank0.jsonl").write_text("\n".join(json.dumps(r) for r in recs))
    # a periodic validation after step 2 (--eval-every: metrics/val.jsonl)
    (tmp_path / "metrics" / "val.jsonl").write_text(json.dumps({"step": 2, "val_loss": 4.5}))
    c = run_curves(tmp_path)
    assert c["train"] == [(1, 2.0, 4.0), (2, 4.0, 3.0), (3, 6.0, 2.0), (4, 8.0, 1.0)]
    assert c["val"] == [(2, 4.0, 4.5)]
    assert value_at_time(c["train"], 6.5) == 2.0 and value_at_time(c["train"], 100) == 1.0
    assert value_at_time(c["train"], 1.0) != value_at_time(c["train"], 1.0)  # NaN: none yet


def test_suite_cells_are_valid_configs() -> None:
    for suite in (CONVERGENCE, SMOKE):
        cells = enumerate_cells(suite)
        assert {c.method for c in cells} == set(METHODS)
        assert len(cells) == 6 * len(suite.tasks)  # ddp, bb-sdp; b-sdp, n-sdp at S and 2S
        for cell in cells:
            task = next(t for t in suite.tasks if t.name == cell.task)
            cfg = cell_config(suite, task, cell, "/tmp/x").resolved()
            assert cfg.coverage == (1.0 if cell.method == "ddp" else 0.5)
            assert cfg.ckpt_every == task.steps  # a checkpoint at the end, for the extras
    overfit = next(t for t in select(CONVERGENCE, steps=5).tasks if t.name == "overfit")
    assert overfit.train_images == 2000 and overfit.steps == 5  # select keeps the subset


def test_fmnist_subset(tmp_path: Path) -> None:
    from subnetdp.data import DatasetMissingError, load_fashion_mnist
    from subnetdp.study.subset import fmnist_subset

    try:
        full_x, full_y = load_fashion_mnist("train")
    except DatasetMissingError as e:
        pytest.skip(str(e))
    d = fmnist_subset(tmp_path, 100)
    x, y = load_fashion_mnist("train", str(d))
    tx, _ = load_fashion_mnist("test", str(d))
    assert x.shape == (100, 1, 28, 28) and len(tx) == 10_000
    # rows of the full set, in order, and every class present
    hits = [int((full_x == x[i]).flatten(1).all(1).nonzero()[0, 0]) for i in (0, 50, 99)]
    assert hits == sorted(hits) and all(bool(full_y[h] == y[i]) for h, i in
                                        zip(hits, (0, 50, 99), strict=True))
    assert len(set(y.tolist())) == 10
    assert fmnist_subset(tmp_path, 100) == d  # reused
