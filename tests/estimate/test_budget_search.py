"""The memory-budget planner's search and ranking (with a stand-in estimator: fast)."""

from __future__ import annotations

from subnetdp.cli import main
from subnetdp.estimate.budget import format_options, plan_budget
from subnetdp.estimate.spec import BenchSpec

BASE = BenchSpec(recipe="llama-tiny", strategy="ddp", world=4, batch=1, seq=32)
COST = {"ddp": 100, "ddp+ac": 80, "fsdp": 60, "fsdp+ac": 40}


def fake_estimator(spec: BenchSpec) -> int:
    if spec.strategy in COST:
        return COST[spec.strategy]
    return int(20 + 100 * spec.coverage)  # grows with coverage


def test_ranks_fitting_options_by_coverage_then_traffic() -> None:
    opts = plan_budget(BASE, 70e-9, estimator=fake_estimator)  # 70 bytes
    fits = [o for o in opts if o.fits]
    # full-model options first (coverage 1), equal traffic: the smaller peak first
    assert [o.spec.strategy for o in fits[:2]] == ["fsdp+ac", "fsdp"]
    sdp = next(o for o in fits if o.spec.strategy == "b-sdp")
    assert sdp.spec.coverage == 0.5  # 8 blocks: k=4 costs 70, k=5 costs 82
    assert all(o.peak_bytes <= 70 for o in fits)
    assert all(not o.fits for o in opts[len(fits):])
    assert "fits" in format_options(opts, BASE, 70e-9)


def test_nothing_fits_is_reported() -> None:
    opts = plan_budget(BASE, 1e-9, estimator=fake_estimator)
    assert not any(o.fits for o in opts)
    assert "nothing fits" in format_options(opts, BASE, 1e-9)


def test_plan_memory_budget_needs_a_model(capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(["plan", "budget", "--nproc", "4", "--memory-gb", "1"]) == 2
    assert "--recipe" in capsys.readouterr().err


def test_compositions_apply_to_sdp_options_only() -> None:
    seen: list[BenchSpec] = []

    def estimator(spec: BenchSpec) -> int:
        seen.append(spec)
        return fake_estimator(spec) // (2 if spec.fsdp else 1)

    opts = plan_budget(BASE, 40e-9, estimator=estimator, fsdp=True, ac=True)
    labels = {o.spec.label.split(" ")[0] for o in opts}
    # baselines keep their names; every SDP strategy is offered composed
    assert labels == {"ddp", "ddp+ac", "fsdp", "fsdp+ac", "b-sdp+fsdp+ac", "bb-sdp+fsdp+ac",
                      "n-sdp+fsdp+ac", "nb-sdp+fsdp+ac"}
    assert all(s.fsdp and s.ac for s in seen if s.is_sdp)
    best = next(o for o in opts if o.spec.strategy == "b-sdp")
    assert best.fits and best.spec.coverage == 0.5  # k=4 costs 35, k=5 costs 41
    assert "b-sdp+fsdp+ac (C=0.5)" in format_options(opts, BASE, 40e-9)
