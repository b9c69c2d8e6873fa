"""The worlds an elastic run may shrink to ([Note: shrinking plans] in plan/shrink.py), on the pure
planning functions: what ``subnetdp plan`` calls recoverable, the launcher's shrunk groups can
plan; what it does not, the launcher refuses at the start (issue 44, 1a, 1b and the property)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from subnetdp.cli import main
from subnetdp.plan import Plan, PlanError, make_plan
from subnetdp.plan.shrink import shrink_plans
from subnetdp.train.config import TrainConfig
from subnetdp.train.elastic import (
    check_replan_options,
    replanned,
    rescued_config,
    shrink_holders,
)


def _maker(units: int, cfg: TrainConfig):  # type: ignore[no-untyped-def]
    """The run's plan over ``units`` units of size 1, from ``cfg``'s plan options."""
    def make(world: int, holders: int) -> Plan:
        spec = cfg.plan_spec
        return make_plan(world=world, units=units, coverage=spec.plan_coverage,
                         scheme="balanced" if spec.balanced else spec.scheme, seed=spec.seed,
                         min_holders=holders, max_groups=spec.max_groups)
    return make


def _cfg(tmp_path: Path, **kw: object) -> TrainConfig:
    return TrainConfig(**{"recipe": "llama-tiny", "strategy": "b-sdp", "ckpt_every": 2,
                          "out": str(tmp_path), **kw})  # type: ignore[arg-type]


def test_the_minimum_world_keeps_what_it_can(tmp_path: Path) -> None:
    """1a: 4 workers at coverage 0.5 hold 2 copies, 3 cannot; at --min-nproc 3 a loss ends
    the run anyway, so the 3 survivors re-plan with one holder and go on (it was a PlanError
    in every worker). 1b (--nproc 3 --min-nproc 2 --coverage 0.75): the same at 2 workers."""
    cfg = _cfg(tmp_path, nproc=4, min_nproc=3, coverage=0.5, min_holders=2)
    assert shrink_holders(cfg, _maker(8, cfg)) == {3: 1}
    went, plan = replanned(TrainConfig(**{**cfg.to_dict(), "nproc": 3}), {3: 1})
    assert went.min_holders == 1 and went.nproc == 3 and plan is None
    _maker(8, went)(3, went.min_holders)  # the shrunk group's plan
    cfg = _cfg(tmp_path, nproc=3, min_nproc=2, coverage=0.75, min_holders=2)
    assert shrink_holders(cfg, _maker(8, cfg)) == {2: 1}


@pytest.mark.parametrize(("kw", "message"), [
    # a world above the minimum must keep --min-holders: its loss would be rescued
    ({"nproc": 8, "min_nproc": 2, "coverage": 0.5, "min_holders": 2},
     "--nproc 8 --min-nproc 2: the run may shrink to 3 workers, where its plan fails (4 unit(s) "
     "have fewer than --min-holders 2 holders under scheme spread; raise the coverage or use "
     "--scheme balanced); --min-nproc 3 works (or raise --coverage, lower --min-holders)"),
    # a world that cannot hold every unit once
    ({"nproc": 4, "min_nproc": 1, "coverage": 0.5},
     "--nproc 4 --min-nproc 1: the run may shrink to 1 workers, where its plan fails (1 workers "
     "holding 4 of 8 units each leave some unit with no holder (k*N = 4 < U = 8); the minimum "
     "coverage for 1 workers and 8 units is 8/8 = 1: raise the coverage or the number of "
     "workers); --min-nproc 2 works (or raise --coverage)"),
    ({"nproc": 4, "min_nproc": 3, "coverage": 0.25},
     "no smaller world works: drop --min-nproc (or raise --coverage)"),
])
def test_a_world_that_cannot_be_planned_is_refused_at_start(tmp_path: Path,
                                                            kw: dict[str, object],
                                                            message: str) -> None:
    cfg = _cfg(tmp_path, **kw)
    check_replan_options(cfg)
    with pytest.raises(PlanError) as e:
        shrink_holders(cfg, _maker(8, cfg))
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(("kw", "message"), [
    ({"capacities": [1.0, 0.5, 0.5, 0.5]}, "but --capacities gives one value per worker"),
    ({"memory_gb": [40.0, 40.0, 40.0, 40.0]}, "but --memory-gb gives one value per worker"),
])
def test_per_worker_plans_cannot_shrink(tmp_path: Path, kw: dict[str, object],
                                        message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_replan_options(_cfg(tmp_path, nproc=4, min_nproc=3, **kw))


def _plan_cli(capsys: pytest.CaptureFixture[str], units: int, cfg: TrainConfig) -> dict:
    capsys.readouterr()
    assert main(["plan", "--units", str(units), "--nproc", str(cfg.nproc), "--coverage",
                 str(cfg.coverage), "--scheme", cfg.scheme, "--seed", str(cfg.seed),
                 "--min-holders", str(cfg.min_holders), "--min-nproc", str(cfg.min_nproc),
                 "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_recoverable_means_the_shrunk_run_goes_on(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """The property, over 150 random small plans: ``plan`` and the launcher agree; whatever
    ``plan`` accepts, every world the launcher may shrink to (one loss after another, or
    several at once: ``rescued_config``'s survivors) plans with the configuration the launcher
    gives that group; whatever it refuses, the launcher refuses at the start with the same
    line."""
    rng = random.Random(44)
    accepted = refused = relaxed = 0
    for _ in range(150):
        nproc = rng.randint(2, 8)
        units = rng.randint(1, 12)
        cfg = _cfg(tmp_path, nproc=nproc, min_nproc=rng.randint(1, nproc),
                   coverage=rng.choice([0.25, 0.3, 0.5, 0.6, 0.75, 1.0]),
                   scheme=rng.choice(["spread", "random", "balanced"]),
                   min_holders=rng.randint(1, 3), seed=rng.randint(0, 3))
        make = _maker(units, cfg)
        try:
            make(nproc, cfg.min_holders)
        except PlanError:
            continue  # the run's own plan fails: refused before anything, as before
        shrink = _plan_cli(capsys, units, cfg)["shrink"]
        check_replan_options(cfg)
        try:
            holders = shrink_holders(cfg, make)
        except PlanError as e:
            assert shrink["refused"] == str(e)
            refused += 1
            continue
        accepted += 1
        assert shrink["min_holders"] == {str(w): h for w, h in holders.items()}
        assert sorted(holders) == list(range(cfg.min_nproc, nproc))
        for world in holders:  # each world the launcher may reach, as it configures it
            went, _ = replanned(TrainConfig(**{**cfg.to_dict(), "nproc": world}), holders)
            plan = _maker(units, went)(world, went.min_holders)
            assert min(plan.holder_counts()) >= went.min_holders >= 1
            if world > cfg.min_nproc:
                assert went.min_holders == cfg.min_holders
            relaxed += went.min_holders < cfg.min_holders
    assert accepted > 30 and refused > 10 and relaxed > 3, (accepted, refused, relaxed)


def test_shrink_plans_says_which_worlds(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, nproc=6, min_nproc=3, coverage=0.5, min_holders=2)
    steps = shrink_plans(_maker(6, cfg), nproc=6, min_nproc=3, min_holders=2)
    assert [(r.world, r.min_holders) for r in steps] == [(5, 2), (4, 2), (3, 1)]
    assert rescued_config(_cfg(tmp_path, nproc=4, min_nproc=None))[0] is None


def test_train_refuses_a_world_it_cannot_plan_in_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The launching process, before any worker or file: the run's recipe, re-planned."""
    from tests.faults.harness import clear_message, run_cli

    code, err = run_cli(["train", "--recipe", "llama-tiny", "--model-arg", "n_layers=2",
                         "--batch-size", "2", "--seq-len", "32", "--no-progress", "--steps",
                         "4", "--nproc", "4", "--min-nproc", "1", "--ckpt-every", "2",
                         "--coverage", "0.5", "--out", str(tmp_path / "run")], capsys)
    assert code == 2
    assert clear_message(err) == (
        "subnetdp train: --nproc 4 --min-nproc 1: the run may shrink to 1 workers, where its "
        "plan fails (1 workers holding 1 of 2 units each leave some unit with no holder (k*N = "
        "1 < U = 2); the minimum coverage for 1 workers and 2 units is 2/2 = 1: raise the "
        "coverage or the number of workers); --min-nproc 2 works (or raise --coverage)"), err
    assert not (tmp_path / "run").exists()
