"""Per-rank memory budgets (bench/hetero.py): met by every rank as the estimator sees it, or
refused with budgets that do work; ``subnetdp plan --memory-gb A,B,...``."""

from __future__ import annotations

import re
from functools import cache

import pytest

from subnetdp.cli import main
from subnetdp.estimate.hetero import GB, BudgetError, plan_for_budgets
from subnetdp.estimate.memory import MemoryEstimate, estimate_memory
from subnetdp.estimate.spec import BenchSpec

BASE = BenchSpec(recipe="resnet18-fmnist", strategy="b-sdp", world=4, batch=4, seq=2,
                 model_args=(("width", 4),))


@cache
def _estimate(spec: BenchSpec) -> MemoryEstimate:
    return estimate_memory(spec)


def _full_gb() -> float:
    full = BASE.replace(coverage=1.0, scheme="balanced", balance="memory")  # as the planner
    return _estimate(full).peak_bytes / GB


def test_budgets_2_1_1_1_are_met_by_every_rank() -> None:
    full = _full_gb()
    budgets = [full, 0.6 * full, 0.6 * full, 0.6 * full]
    bp = plan_for_budgets(BASE, budgets, estimate=_estimate)
    caps = bp.spec.capacities
    assert caps is not None and caps[0] > max(caps[1:])
    for r in bp.estimate.per_rank:
        assert r.peak_bytes <= budgets[r.rank] * GB, r.rank
        assert r.state == r.analytic
    # the small ranks really hold less than the big one
    small = max(r.state["params"] for r in bp.estimate.per_rank[1:])
    assert small < bp.estimate.per_rank[0].state["params"]


def test_too_small_budgets_are_refused_with_budgets_that_work() -> None:
    full = _full_gb()
    with pytest.raises(BudgetError, match="too small") as e:
        plan_for_budgets(BASE, [0.3 * full] * 4, estimate=_estimate)
    found = re.search(r"--memory-gb ([0-9.e,-]+);", str(e.value))
    assert found is not None
    suggested = [float(x) for x in found.group(1).split(",")]
    assert min(suggested) > 0.3 * full
    bp = plan_for_budgets(BASE, suggested, estimate=_estimate)
    assert all(r.peak_bytes <= suggested[r.rank] * GB for r in bp.estimate.per_rank)


def test_plan_command_per_rank_budgets_errors(capsys) -> None:  # type: ignore[no-untyped-def]
    args = ["plan", "--recipe", "llama-tiny", "--seq-len", "32", "--batch-size", "2"]
    assert main([*args, "--world", "3", "--memory-gb", "1,1,1,1"]) == 2
    assert "one per worker" in capsys.readouterr().err
    # two workers: each estimate of llama-tiny (8 blocks) is a few seconds per rank
    assert main([*args, "--memory-gb", "0.001,0.0005"]) == 2
    err = capsys.readouterr().err
    assert "too small" in err and "--memory-gb" in err
    assert main([*args, "--memory-gb", "1,x"]) == 2
    assert "numbers separated by commas" in capsys.readouterr().err
