"""``plan --memory-gb``: a line per estimate on stderr, --strategies, no estimate twice
(issue 28, item 5). A stand-in estimator keeps it fast; the search is the real one."""

from __future__ import annotations

import json

import pytest

from subnetdp.cli import main
from subnetdp.estimate import budget
from subnetdp.estimate.spec import BenchSpec

COST = {"ddp": 100, "ddp+ac": 80, "fsdp": 60, "fsdp+ac": 40}


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[BenchSpec]:
    seen: list[BenchSpec] = []

    def estimate(spec: BenchSpec) -> int:
        seen.append(spec)
        return COST.get(spec.strategy, int(20 + 100 * spec.coverage))  # grows with coverage

    monkeypatch.setattr(budget, "_estimate_peak", estimate)
    return seen


ARGS = ["plan", "budget", "--recipe", "llama-tiny", "--nproc", "4", "--memory-gb", "70e-9",
        "--seq-len", "32", "--json"]


def test_one_line_per_estimate_on_stderr_and_json_on_stdout(
        calls: list[BenchSpec], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(ARGS) == 0
    out, err = capsys.readouterr()
    options = json.loads(out)["options"]  # stdout: one JSON object, nothing else
    assert {o["strategy"] for o in options} == {"ddp", "ddp+ac", "fsdp", "fsdp+ac", "b-sdp",
                                                "n-sdp", "bb-sdp", "nb-sdp"}
    # every configuration estimated once
    assert len(calls) == len(set(calls))
    lines = err.splitlines()
    assert lines[0].startswith("subnetdp plan: searching 8 strategies") and "at most" in lines[0]
    per_estimate = lines[1:]
    assert len(per_estimate) == len(calls)
    left = []
    for spec, line in zip(calls, per_estimate, strict=True):
        assert spec.label in line and " s" in line, line
        left.append(int(line.split("at most ")[1].split(" more")[0]))
    assert left == sorted(left, reverse=True) and left[-1] == 0


def test_strategies_filter(calls: list[BenchSpec], capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*ARGS, "--strategies", "b-sdp,ddp"]) == 0
    options = json.loads(capsys.readouterr().out)["options"]
    assert sorted(o["strategy"] for o in options) == ["b-sdp", "ddp"]
    assert {s.strategy for s in calls} == {"b-sdp", "ddp"}


def test_strategies_filter_refuses_composed_sdp_names(
        calls: list[BenchSpec], capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*ARGS, "--strategies", "b-sdp+fsdp"]) == 2
    err = capsys.readouterr().err
    assert "--fsdp" in err and len(err.strip().splitlines()) == 1 and not calls


def test_search_never_estimates_a_configuration_twice() -> None:
    seen: list[BenchSpec] = []

    def estimate(spec: BenchSpec) -> int:
        seen.append(spec)
        return int(20 + 100 * spec.coverage)

    base = BenchSpec(recipe="llama-tiny", strategy="ddp", world=4, batch=1, seq=32)
    # nothing fits: the search ends on its smallest k, which it has probed already; a
    # strategy named twice is searched once
    opts = budget.plan_budget(base, 1e-9, strategies=("b-sdp", "bb-sdp", "b-sdp"),
                              estimator=estimate)
    assert [o.spec.strategy for o in opts] == ["b-sdp", "bb-sdp"]
    assert len(seen) == len(set(seen))
