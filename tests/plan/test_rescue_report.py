"""``subnetdp plan`` says how many units have a single holder and whether a lost worker is
recoverable without rollback ([Note: rescue])."""

from __future__ import annotations

import json

import pytest

from subnetdp.cli import main


def _plan(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    capsys.readouterr()
    assert main(["plan", "--units", "8", "--nproc", "4", *args]) == 0
    return capsys.readouterr().out


def test_plan_reports_single_holders_and_rescue(capsys: pytest.CaptureFixture[str]) -> None:
    assert ("single-holder units 0   a lost worker is recoverable without rollback"
            in _plan(capsys, "--coverage", "0.5", "--min-holders", "2"))
    assert ("single-holder units 8   a lost worker costs a rollback to the newest checkpoint"
            in _plan(capsys, "--coverage", "0.25"))
    rep = json.loads(_plan(capsys, "--coverage", "0.25", "--json"))
    assert rep["single_holder_units"] == 8 and rep["rescuable_ranks"] == []
    rep = json.loads(_plan(capsys, "--coverage", "0.5", "--min-holders", "2", "--json"))
    assert rep["single_holder_units"] == 0 and rep["rescuable_ranks"] == [0, 1, 2, 3]


def test_plan_and_train_agree_on_shrinking(capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 44 (1a): the 3 survivors of coverage 0.5 re-plan with one holder (said); a world
    above --min-nproc that cannot keep two is the launcher's refusal, word for word."""
    line = _plan(capsys, "--coverage", "0.5", "--min-holders", "2", "--min-nproc", "3")
    assert ("a lost worker is recoverable without rollback (any one rank; --min-nproc 3, not "
            "with --zero/--fsdp); at 3 workers it re-plans with --min-holders 1") in line
    capsys.readouterr()
    assert main(["plan", "--units", "8", "--nproc", "8", "--coverage", "0.5", "--min-holders",
                 "2", "--min-nproc", "2"]) == 0
    assert ("an elastic run is refused at its start: --nproc 8 --min-nproc 2: the run may "
            "shrink to 3 workers") in capsys.readouterr().out
