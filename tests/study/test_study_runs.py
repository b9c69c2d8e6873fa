"""The quality study end to end on real data, tiny: the runner trains real cells (2 workers,
3 steps), including both DDP baselines, reuses them on a second call, and writes the tables."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from subnetdp.study.results import write_results
from subnetdp.study.runner import run_suite
from subnetdp.study.suite import Suite, TaskSpec, enumerate_cells

pytestmark = pytest.mark.dist

TINY = TaskSpec("llama", "llama-tiny", steps=3, train={
    "batch_size": 2, "seq_len": 16, "warmup": 1, "eval_batches": 1, "memory_step": 2,
    "model_args": {"n_layers": 4}})


def test_runner_end_to_end(tmp_path: Path) -> None:
    suite = Suite("tiny", (TINY,), coverages=(0.5,), seeds=1, nproc=2,
                  methods=("ddp", "b-sdp", "ddp+sd", "ddp+dropout"))
    logs: list[str] = []
    results = run_suite(suite, tmp_path / "runs", log=logs.append)
    cells = enumerate_cells(suite)  # ddp, b-sdp x 2 budgets, sd x 2 budgets, dropout
    assert len(results) == len(cells) == 6
    for r in results:
        assert r.summary is not None and 0 < r.summary["val_loss"] < 20
        assert len(r.curve) == r.cell.steps and r.wall_s > 0
        cfg = r.summary["config"]
        assert cfg["stochastic_depth"] == (0.5 if r.cell.method == "ddp+sd" else 0.0)
        assert cfg["neuron_dropout"] == (0.5 if r.cell.method == "ddp+dropout" else 0.0)
    assert {r.cell.steps for r in results if r.cell.method == "b-sdp"} == {3, 6}
    # a second call trains nothing
    again = run_suite(suite, tmp_path / "runs", log=logs.append)
    assert all("done before" in m for m in logs[len(cells):])
    assert [r.summary for r in again] == [r.summary for r in results]
    written = write_results(suite, again, tmp_path / "out", command="test", plots=False)
    md = (tmp_path / "out" / "quality_llama.md").read_text()
    assert "ddp + stochastic depth" in md and "| b-sdp | 0.5 | 6 |" in md
    assert json.loads(written[1].read_text())["task"]["recipe"] == "llama-tiny"
