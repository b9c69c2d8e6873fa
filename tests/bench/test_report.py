"""Run tables: the headline figures, ratios to the base run, backward masking's refresh, and
the demo's matched-compute comparison (with a fake trainer)."""

from __future__ import annotations

from typing import Any

import pytest

from subnetdp.cli import main
from subnetdp.metrics.report import comparison_table, format_summary, label
from subnetdp.train.config import TrainConfig


def _summary(strategy: str, loss: float, params: int, refresh: int = 0, steps: int = 10,
             **extra: Any) -> dict[str, Any]:
    return {"strategy": strategy, "recipe": "llama-tiny", "coverage": 0.5, "world": 2,
            "steps": steps, "final_train_loss": loss, "val_loss": loss, "step_time_s": 2.0,
            "per_rank": [{"params_held": params, "peak_memory_bytes": 2 * params,
                          "comm_bytes_per_step": 4 * params, "refresh_bytes_per_step": refresh}
                         for _ in range(2)], **extra}


def _row(table: str, title: str) -> list[str]:
    return next(line for line in table.splitlines() if line.startswith(title)).split()


def test_table_has_one_column_and_one_ratio_per_run() -> None:
    ddp, b, bb = (_summary("ddp", 4.0, 100), _summary("b-sdp", 5.0, 50),
                  _summary("bb-sdp", 4.4, 100, refresh=2**20))
    table = comparison_table(ddp, b, bb)
    lines = table.splitlines()
    assert "b-sdp (C=0.5)" in lines[0] and "bb-sdp / ddp" in lines[0]
    assert _row(table, "val loss")[-2:] == ["1.250", "1.100"]
    assert _row(table, "refresh sent")[-2:] == ["-", "-"]  # no ratio to a base that sends nothing
    assert "refresh sent" not in comparison_table(ddp, b)
    assert "refresh / step" in format_summary(bb) and "refresh" not in format_summary(b)
    assert "wall time" not in table  # no summary records it


def test_table_shows_steps_and_training_wall_time() -> None:
    ddp = _summary("ddp", 4.0, 100, steps=10, train_time_s=20.0)
    b = _summary("b-sdp", 3.9, 50, steps=20, train_time_s=30.0)
    table = comparison_table(ddp, b)
    assert _row(table, "steps") == ["steps", "10", "20", "2.000"]
    assert _row(table, "wall time (train)")[-3:] == ["30.0", "s", "1.500"]
    assert "wall time (train)  30.0 s" in format_summary(b)
    # a run without the figure: a dash, and no ratio
    assert _row(comparison_table(ddp, _summary("b-sdp", 3.9, 50)), "wall time")[-3:] == \
        ["s", "-", "-"]


@pytest.mark.parametrize("match, bsdp_steps", [("compute", 20), ("steps", 10)])
def test_demo_matches_compute_or_steps(match: str, bsdp_steps: int, monkeypatch: Any,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    trained: list[TrainConfig] = []

    def fake_run_training(cfg: TrainConfig, **_: Any) -> dict[str, Any]:
        trained.append(cfg)
        return _summary(cfg.strategy, 4.0, 100, steps=cfg.steps, train_time_s=cfg.steps * 1.0)

    monkeypatch.setattr("subnetdp.train.run.run_training", fake_run_training)
    assert main(["demo", "--steps", "10", "--coverage", "0.5", "--match", match,
                 "--no-progress"]) == 0
    assert [(c.strategy, c.steps, c.device) for c in trained] == \
        [("ddp", 10, "cpu"), ("b-sdp", bsdp_steps, "cpu")]
    out = capsys.readouterr().out
    assert f"matched {match}" in out
    assert _row(out, "steps")[1:3] == ["10", str(bsdp_steps)]
    assert _row(out, "wall time (train)")[3] == "10.0"


def test_demo_refuses_a_coverage_outside_0_1(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--coverage", "0"]) == 2
    assert "--coverage" in capsys.readouterr().err


def test_column_labels_name_the_composition() -> None:
    run = {"strategy": "ddp", "coverage": 1.0, "config": {"fsdp": True, "ac": True}}
    assert label(run) == "fsdp+ac"
    assert label({"strategy": "b-sdp", "coverage": 0.5}) == "b-sdp (C=0.5)"
    assert label({**run, "strategy": "b-sdp", "coverage": 0.5}) == "b-sdp+fsdp+ac (C=0.5)"


def test_unmeasured_figures_show_as_such() -> None:
    """A run whose only step measured memory has no step time: ``null`` in summary.json
    (issue 28 item 3); the tables say so instead of failing or inventing a figure."""
    untimed = _summary("b-sdp", 3.9, 50, step_time_s=None, **{"throughput(tps)": None})
    assert "step time          not measured" in format_summary(untimed)
    assert _row(comparison_table(_summary("ddp", 4.0, 100), untimed), "median step time")[-2:] \
        == ["-", "-"]


def test_the_summary_shows_what_eval_tasks_scored() -> None:
    """Issue 41 item 11: ``--eval-tasks``' scores were in summary.json, not in what it prints."""
    run = _summary("b-sdp", 4.0, 50, **{"eval/arc_easy/acc": 0.25, "eval/arc_easy/acc_norm": 0.5,
                                        "eval/sciq/acc": 0.125, "eval/sciq/acc_norm": 0.375,
                                        "config": {"eval_limit": 8}})
    lines = format_summary(run).splitlines()
    assert lines[-2:] == ["  arc_easy           acc 0.2500, acc_norm 0.5000 (first 8 documents)",
                          "  sciq               acc 0.1250, acc_norm 0.3750 (first 8 documents)"]
    assert "acc" not in format_summary(_summary("b-sdp", 4.0, 50))
