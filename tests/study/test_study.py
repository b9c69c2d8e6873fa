"""The quality study without processes: cells, budgets, aggregation, tables, resumability."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pytest

from subnetdp.metrics.sinks import rank_jsonl_path
from subnetdp.study.aggregate import Stat, all_rows
from subnetdp.study.runner import WALL_FILE, load_result, run_suite
from subnetdp.study.suite import (
    QUALITY,
    QUICK,
    Cell,
    Suite,
    TaskSpec,
    budget_cells,
    budget_steps,
    cell_config,
    enumerate_cells,
    neuron_groups,
    select,
)
from subnetdp.study.tables import pm, rows_table, task_markdown

LM = TaskSpec("llama", "llama-tiny", steps=40, train={"batch_size": 2, "seq_len": 16})
IMG = TaskSpec("resnet", "resnet18-fmnist", steps=40, train={"model_args": {"width": 4}})
SUITE = Suite("t", (LM, IMG), coverages=(0.75, 0.5, 0.375), seeds=3, nproc=4)


def test_flop_matching_steps() -> None:
    assert budget_steps("b-sdp", 0.5, 40, "step") == 40
    assert budget_steps("b-sdp", 0.5, 40, "flop") == 80
    assert budget_steps("n-sdp", 0.375, 40, "flop") == round(40 / 0.375) == 107
    assert budget_steps("ddp+sd", 0.75, 40, "flop") == 53
    for m in ("ddp", "bb-sdp", "nb-sdp", "ddp+dropout"):
        assert budget_steps(m, 0.375, 40, "flop") == 40
    with pytest.raises(ValueError, match="unknown budget"):
        budget_steps("ddp", 1.0, 40, "time")


def test_cell_enumeration_shares_cells_between_budgets() -> None:
    cells = enumerate_cells(SUITE)
    assert len(cells) == len(set(cells))
    # per task and seed: ddp 1 + 6 methods x 3 C step-matched + 3 FLOP-scaled methods x 3 C
    assert len(cells) == 2 * 3 * (1 + 6 * 3 + 3 * 3)
    step = set(budget_cells(SUITE, LM, "step"))
    flop = set(budget_cells(SUITE, LM, "flop"))
    shared = step & flop
    assert {c.method for c in shared} == {"ddp", "bb-sdp", "nb-sdp", "ddp+dropout"}
    assert {c.method for c in flop - step} == {"b-sdp", "n-sdp", "ddp+sd"}
    # seed-major order: every cell of seed 0 (both tasks) comes before any of seed 1
    seeds = [c.seed for c in cells]
    assert seeds == sorted(seeds)
    assert len(enumerate_cells(QUICK)) == 2 * (1 + 6 + 3)


def test_cell_config_maps_methods_to_strategies_and_baselines() -> None:
    sd = cell_config(SUITE, LM, Cell("llama", "ddp+sd", 0.375, 107, 2), "x")
    assert (sd.strategy, sd.stochastic_depth, sd.neuron_dropout) == ("ddp", 0.625, 0.0)
    assert (sd.steps, sd.seed, sd.nproc, sd.batch_size, sd.progress) == (107, 2, 4, 2, False)
    do = cell_config(SUITE, IMG, Cell("resnet", "ddp+dropout", 0.5, 40, 0), "x")
    assert (do.strategy, do.neuron_dropout, do.model_args) == ("ddp", 0.5, {"width": 4})
    nb = cell_config(SUITE, LM, Cell("llama", "nb-sdp", 0.75, 40, 0), "x")
    assert (nb.strategy, nb.coverage, nb.stochastic_depth) == ("nb-sdp", 0.75, 0.0)
    # C = 0.375 on 4 workers needs 8 neuron groups (3 held), else round(1.5) = 2 of 4
    assert neuron_groups("n-sdp", 0.375, 4) == 8 and neuron_groups("nb-sdp", 0.5, 4) is None
    assert neuron_groups("b-sdp", 0.375, 4) is None and neuron_groups("n-sdp", 0.75, 4) is None
    ns = cell_config(SUITE, LM, Cell("llama", "n-sdp", 0.375, 40, 0), "x")
    assert ns.neuron_groups == 8
    assert Cell("llama", "n-sdp", 0.375, 40, 0).run_name_in(4) == "llama/n-sdp-C0.375-g8-s40-seed0"
    assert Cell("llama", "ddp", 1.0, 40, 1).run_name_in(4) == "llama/ddp-s40-seed1"
    for cell in enumerate_cells(QUALITY):  # every cell of the real suite is a valid config
        task = next(t for t in QUALITY.tasks if t.name == cell.task)
        cell_config(QUALITY, task, cell, "x").resolved()


def test_select() -> None:
    s = select(QUALITY, tasks=["resnet"], seeds=1, steps=7)
    assert [t.name for t in s.tasks] == ["resnet"] and s.seeds == 1 and s.tasks[0].steps == 7
    with pytest.raises(ValueError, match="unknown task"):
        select(QUALITY, tasks=["gpt"])


def test_stat() -> None:
    s = Stat.of([1.0, 2.0, 4.0])
    assert s.mean == pytest.approx(7 / 3) and s.std == pytest.approx(statistics.stdev([1, 2, 4]))
    assert Stat.of([3.0]).std == 0.0
    d = Stat.of([1.0, None, float("nan")])
    assert (d.mean, d.n, d.failed) == (1.0, 1, 2)
    assert math.isnan(Stat.of([None]).mean)
    assert pm(Stat.of([1.0])) == "1.000" and pm(Stat.of([1.0, 2.0]), 2) == "1.50 ± 0.71"
    assert pm(Stat.of([None])) == "diverged" and pm(Stat.of([])) == "-"


def _summary(cell: Cell, quality: float, memory: float, metric: str) -> dict:
    rank = {"params_held": 100, "peak_memory_bytes": memory, "comm_bytes_per_step": 400.0,
            "refresh_bytes_per_step": 0}
    s = {"strategy": cell.method, "coverage": cell.coverage, "steps": cell.steps,
         "step_time_s": 0.1, "val_loss": quality if metric == "val_loss" else 1.5,
         "per_rank": [rank, rank | {"peak_memory_bytes": memory / 2}],
         "plan": {"param_coverage": [cell.coverage, cell.coverage]}}
    if metric == "val_accuracy":
        s["val_accuracy"] = quality
    return s


def _fake_runs(root: Path, suite: Suite) -> None:
    """Write summaries (quality = coverage + seed/10, memory = 1 MiB x coverage) and curves."""
    for cell in enumerate_cells(suite):
        d = root / cell.run_name_in(suite.nproc)
        d.mkdir(parents=True)
        task = next(t for t in suite.tasks if t.name == cell.task)
        q = cell.coverage + cell.seed / 10
        (d / "summary.json").write_text(json.dumps(
            _summary(cell, q, 2**20 * cell.coverage, task.metric)))
        (d / WALL_FILE).write_text(json.dumps({"wall_s": 2.0}))
        for rank in range(suite.nproc):
            path = rank_jsonl_path(d, rank)
            path.parent.mkdir(exist_ok=True)
            path.write_text("".join(json.dumps({"step": i, "loss": 5.0 - i / 10 + rank})
                                    + "\n" for i in range(cell.steps)))


def test_aggregation_and_tables_from_synthetic_summaries(tmp_path: Path) -> None:
    suite = Suite("t", (LM, IMG), coverages=(0.5, 0.375), seeds=2, nproc=2)
    _fake_runs(tmp_path, suite)
    results = run_suite(suite, tmp_path, log=lambda m: None)  # everything stored: nothing runs
    rows = all_rows(suite, results)
    step, flop = rows["llama"]["step"], rows["llama"]["flop"]
    assert [r.method for r in step[:7]] == ["ddp", "b-sdp", "n-sdp", "bb-sdp", "nb-sdp",
                                             "ddp+sd", "ddp+dropout"]
    assert len(step) == len(flop) == 1 + 6 * 2
    b = next(r for r in flop if r.method == "b-sdp" and r.coverage == 0.375)
    assert b.steps == 107 and b.quality.n == 2
    assert b.quality.mean == pytest.approx(0.375 + 0.05)
    assert b.quality.std == pytest.approx(statistics.stdev([0.375, 0.475]))
    assert b.memory.mean == pytest.approx(2**20 * 0.375)  # the worst rank
    assert b.curve == pytest.approx([5.5 - i / 10 for i in range(107)])  # mean over ranks
    assert b.curve_std == pytest.approx([0.0] * 107)
    table = rows_table(LM, step)
    assert "| ddp | 1 | 40 | 1.050 ± 0.071 | - |" in table
    assert "| b-sdp | 0.5 | 40 | 0.550 ± 0.071 | -0.500 |" in table
    # params held, memory (MiB), memory / ddp, bytes (MiB), bytes / ddp
    assert "| -0.500 | 0.50 | 0.5 | 0.50 | 0.00 | 1.00 |" in table
    img = task_markdown(suite, IMG, rows["resnet"], command="c", wall_s=60, versions="v")
    assert "val accuracy ↑" in img and "FLOP-matched" in img and "ddp + neuron dropout" in img


def test_results_files(tmp_path: Path) -> None:
    from subnetdp.study.results import write_results

    suite = Suite("t", (IMG,), coverages=(0.5,), seeds=2, nproc=2)
    _fake_runs(tmp_path / "runs", suite)
    results = run_suite(suite, tmp_path / "runs", log=lambda m: None)
    written = write_results(suite, results, tmp_path / "out", command="c")
    names = sorted(p.name for p in written)
    assert names == ["quality_resnet.json", "quality_resnet.md", "quality_resnet_curves.png",
                     "quality_resnet_memory.png"]
    data = json.loads((tmp_path / "out" / "quality_resnet.json").read_text())
    assert len(data["cells"]) == 2 * (1 + 6 + 3) and data["seeds"] == 2
    assert all((tmp_path / "out" / n).stat().st_size > 1000 for n in names)


def test_resumability(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Stored cells are read back; missing or half-written ones (no summary) are trained,
    after their folder is cleared; a diverged cell counts as done."""
    from subnetdp.study import runner

    suite = Suite("t", (IMG,), coverages=(0.5,), seeds=1, nproc=2)
    _fake_runs(tmp_path, suite)
    cells = enumerate_cells(suite)
    half = cells[3]
    (tmp_path / half.run_name_in(2) / "summary.json").unlink()  # interrupted: folder, no summary
    diverged = cells[4]
    (tmp_path / diverged.run_name_in(2) / "summary.json").unlink()
    failed = tmp_path / diverged.run_name_in(2) / runner.FAILED_FILE
    failed.write_text(json.dumps({"error": "nan"}))
    trained: list[str] = []

    def fake_run_training(cfg, *, start_method=None):  # type: ignore[no-untyped-def]
        assert not Path(cfg.out).exists()  # cleared first
        trained.append(cfg.out)
        cell = half
        Path(cfg.out).mkdir(parents=True)
        (Path(cfg.out) / "summary.json").write_text(json.dumps(
            _summary(cell, 0.9, 1.0, "val_accuracy")))
        return {}

    monkeypatch.setattr("subnetdp.train.run.run_training", fake_run_training)
    results = run_suite(suite, tmp_path, log=lambda m: None)
    assert trained == [str(tmp_path / half.run_name_in(2))]
    by = {r.cell: r for r in results}
    assert by[half].summary is not None and math.isfinite(by[half].wall_s)
    assert by[diverged].summary is None and by[diverged].error == "nan"
    assert load_result(tmp_path, half, 2) is not None
    rows = all_rows(suite, results)["resnet"]["step"]
    d = next(r for r in rows if r.method == diverged.method and r.coverage == 0.5)
    assert d.quality.failed == 1 and "diverged" in rows_table(IMG, rows)


def test_remeasure_ddp_memory_reruns_only_torch_ddp_cells(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from subnetdp.study.remeasure import remeasure_ddp_memory
    from subnetdp.study.results import write_results

    suite = Suite("t", (IMG,), coverages=(0.5,), seeds=2, nproc=2)
    _fake_runs(tmp_path / "runs", suite)
    results = run_suite(suite, tmp_path / "runs", log=lambda m: None)
    write_results(suite, results, tmp_path / "out", command="c", plots=False)
    trained: list[str] = []
    change = {"memory": 0.5, "quality": 0.0}

    def fake_run_training(cfg, *, start_method=None):  # type: ignore[no-untyped-def]
        name = "/".join(Path(cfg.out).parts[-2:])  # task/cell
        trained.append(name)
        summary = json.loads((tmp_path / "runs" / name / "summary.json").read_text())
        summary["val_accuracy"] += change["quality"]
        for r in summary["per_rank"]:
            r["peak_memory_bytes"] *= change["memory"]
        Path(cfg.out).mkdir(parents=True)
        (Path(cfg.out) / "summary.json").write_text(json.dumps(summary))
        return summary

    def remeasure(runs: str) -> list[Path]:
        return remeasure_ddp_memory(suite, IMG, tmp_path / "out", tmp_path / runs,
                                    log=lambda m: None, plots=False)

    monkeypatch.setattr("subnetdp.train.run.run_training", fake_run_training)
    md = tmp_path / "out" / "quality_resnet.md"
    before = md.read_text()
    # b-sdp: quality, Δ, val loss, params held, memory (MiB), memory / ddp
    b_sdp = "| b-sdp | 0.5 | 40 | 0.5500 ± 0.0707 | -0.500 | 1.500 ± 0.000 | 0.50 | 0.5 |"
    assert f"{b_sdp} 0.50 |" in before
    change.update(memory=0.5, quality=0.2)  # beyond the seeds' spread (std 0.07): refused
    with pytest.raises(RuntimeError, match="differs from the stored"):
        remeasure("a")
    assert md.read_text() == before  # nothing written
    change.update(memory=0.5, quality=0.007)  # float rounding grown by training: accepted
    trained.clear()
    remeasure("c")
    # seed 0 of ddp, stochastic depth (both budgets) and dropout; no SDP cell, no seed 1
    assert sorted(trained) == ["resnet/ddp+dropout-C0.5-s40-seed0",
                               "resnet/ddp+sd-C0.5-s40-seed0", "resnet/ddp+sd-C0.5-s80-seed0",
                               "resnet/ddp-s40-seed0"]
    text = md.read_text()
    # b-sdp keeps its 0.5 MiB; DDP's peak halved, so b-sdp's ratio to it is 1.00 now
    assert f"{b_sdp} 1.00 |" in text
    assert "re-measured by `python -m subnetdp.study.remeasure`" in text
    assert "within 0.10 seed std of its stored quality" in text
    assert remeasure("d") == []  # done once
