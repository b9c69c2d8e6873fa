"""The balanced scheme (plan/balance.py via make_plan): never worse than spread on random unit
sizes, min holders kept, connected, spectral gap above its floor, deterministic; per-rank
capacities for heterogeneous workers."""

from __future__ import annotations

import numpy as np
import pytest

from subnetdp.plan import (
    PlanError,
    Unit,
    balanced_matrix,
    is_connected,
    make_plan,
    max_ratio,
    param_coverage,
    spectral_gap,
)
from subnetdp.plan.schemes import GAP_FLOOR

# ResNet-18 (CIFAR-10) residual branches and its shared part, as describe_units gives them
RESNET18 = [73984, 73984, 221696, 295424, 885760, 1180672, 3540992, 4720640]
RESNET18_SHARED = 180810


def _units(sizes: list[int]) -> list[Unit]:
    return [Unit(f"u{i}", int(s)) for i, s in enumerate(sizes)]


CASES = [(world, n_units, cov, h, seed)
         for seed in range(6)
         for world, n_units, cov, h in ((4, 8, 0.5, 1), (4, 8, 0.375, 1), (8, 12, 0.5, 2),
                                         (8, 24, 0.69, 1), (6, 10, 0.75, 3), (16, 40, 0.3, 1))]


@pytest.mark.parametrize(("world", "n_units", "cov", "min_holders", "seed"), CASES)
def test_balanced_never_worse_than_spread_on_random_sizes(world, n_units, cov, min_holders,
                                                          seed) -> None:
    rng = np.random.default_rng(seed)
    sizes = (rng.lognormal(10, 1.5, n_units) + 1).astype(int).tolist()
    units = _units(sizes)
    spread = make_plan(world=world, units=units, coverage=cov, scheme="spread")
    bal = make_plan(world=world, units=units, coverage=cov, scheme="balanced", seed=seed,
                    min_holders=min_holders)
    caps = [cov] * world
    assert max_ratio(bal.matrix, sizes, caps) <= max_ratio(spread.matrix, sizes, caps) + 1e-12
    assert min(bal.holder_counts()) >= min_holders
    assert is_connected(bal)
    assert spectral_gap(bal) >= GAP_FLOOR * spectral_gap(spread) - 1e-12
    again = make_plan(world=world, units=units, coverage=cov, scheme="balanced", seed=seed,
                      min_holders=min_holders)
    assert again.matrix == bal.matrix  # deterministic


def test_balanced_is_strictly_better_on_most_random_cases() -> None:
    """The fallback must not be what makes the property hold: count real improvements. (The
    rest fall back to spread for the gap floor: with one unit of > 50% of the cost, a
    balanced plan mixes its holders with the others only through light units.)"""
    better = 0
    for world, n_units, cov, h, seed in CASES:
        rng = np.random.default_rng(seed)
        sizes = (rng.lognormal(10, 1.5, n_units) + 1).astype(int).tolist()
        plan = make_plan(world=world, units=_units(sizes), coverage=cov, scheme="balanced",
                         seed=seed, min_holders=h)
        better += plan.scheme == "balanced"
    assert better >= 0.6 * len(CASES)


def test_resnet18_worst_rank_falls_to_the_coverage_bound() -> None:
    units = _units(RESNET18)
    kw = {"world": 4, "units": units, "coverage": 0.5, "shared_size": RESNET18_SHARED}
    spread = param_coverage(make_plan(scheme="spread", **kw))
    bal_plan = make_plan(scheme="balanced", **kw)
    bal = param_coverage(bal_plan)
    assert bal_plan.scheme == "balanced"
    assert max(spread) > 0.93  # layer4's branches on one rank
    # bound: the mean share (every rank ~ C of the cost) plus at most a few small units
    assert max(bal) < 0.53
    assert abs(np.mean(bal) - np.mean(spread)) < 0.02  # the same total coverage
    # same holder counts as spread (2 per unit at C = 0.5 on 4 workers): same mask error
    assert bal_plan.holder_counts() == [2] * len(units)


SWIN_T = [111987, 111987, 445158, 445158] + [1775052] * 6 + [7088088] * 2


@pytest.mark.parametrize(("sizes", "shared"), [(RESNET18, RESNET18_SHARED), (SWIN_T, 1564330)])
@pytest.mark.parametrize(("world", "cov"),
                         [(4, 0.75), (4, 0.5), (8, 0.5), (8, 0.69), (4, 0.375), (8, 0.375)])
def test_model_units_are_balanced_strictly(sizes, shared, world, cov) -> None:
    units = _units(sizes)
    plan = make_plan(world=world, units=units, coverage=cov, scheme="balanced",
                     shared_size=shared)
    spread = make_plan(world=world, units=units, coverage=cov, shared_size=shared)
    assert plan.scheme == "balanced"
    caps = [cov] * world
    assert max_ratio(plan.matrix, sizes, caps) < max_ratio(spread.matrix, sizes, caps)
    assert spectral_gap(plan) >= GAP_FLOOR * spectral_gap(spread)


def test_equal_units_keep_spread() -> None:
    plan = make_plan(world=8, units=12, coverage=0.5, scheme="balanced")
    assert plan.scheme == "spread"
    assert plan.matrix == make_plan(world=8, units=12, coverage=0.5).matrix


def test_heterogeneous_capacities_are_met() -> None:
    rng = np.random.default_rng(3)
    sizes = (rng.lognormal(8, 0.5, 30) + 1).astype(int).tolist()
    caps = [1.0, 0.5, 0.5, 0.5]
    plan = make_plan(world=4, units=_units(sizes), coverage=1.0, scheme="balanced",
                     capacities=caps)
    assert plan.coverage is None
    total = sum(sizes)
    for rank, cap in enumerate(caps):
        held = sum(sizes[u] for u in plan.held_units(rank))
        assert held <= cap * total * 1.02  # within 2% of its capacity
        assert held >= cap * total * 0.9
    assert is_connected(plan)
    assert len(plan.held_units(0)) > len(plan.held_units(1))  # unequal numbers of units


def test_capacities_too_small_are_refused() -> None:
    with pytest.raises(PlanError, match=r"capacities sum to 0\.8"):
        balanced_matrix([1.0] * 6, world=4, capacities=[0.2] * 4, min_holders=1)
    with pytest.raises(PlanError, match="need >= 2"):
        balanced_matrix([1.0] * 6, world=4, capacities=[0.4] * 4, min_holders=2)


def test_capacities_need_the_balanced_scheme() -> None:
    with pytest.raises(PlanError, match="--scheme balanced"):
        make_plan(world=2, units=4, coverage=0.5, capacities=[0.5, 0.5])


def test_min_holders_is_checked_for_spread_too() -> None:
    with pytest.raises(PlanError, match="--min-holders 3"):
        make_plan(world=4, units=8, coverage=0.5, min_holders=3)
    plan = make_plan(world=4, units=_units(RESNET18), coverage=0.75, scheme="balanced",
                     min_holders=3)
    assert min(plan.holder_counts()) >= 3
    for scheme in ("spread", "balanced"):  # more holders than workers: that is the cause
        with pytest.raises(PlanError, match=r"must be in \[1, 4\], the number of workers"):
            make_plan(world=4, units=8, coverage=0.5, scheme=scheme, min_holders=9)


def test_hundreds_of_units_and_workers_are_fast() -> None:
    import time

    rng = np.random.default_rng(0)
    sizes = (rng.lognormal(10, 1.5, 150) + 1).astype(int).tolist()
    t0 = time.perf_counter()
    plan = make_plan(world=128, units=_units(sizes), coverage=0.4, scheme="balanced")
    assert time.perf_counter() - t0 < 60  # a few seconds on a quiet core
    assert plan.scheme == "balanced" and is_connected(plan)


def test_plan_command_explains_a_balanced_recipe_plan(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from subnetdp.cli import main

    argv = ["plan", "--nproc", "4", "--recipe", "resnet18-cifar10", "--coverage", "0.5",
            "--scheme", "balanced", "--balance", "params", "--batch-size", "8"]
    assert main([*argv, "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["scheme"] == "balanced" and max(rep["param_coverage"]) < 0.53
    assert len(rep["unit_costs"]["units"]) == 8 and rep["unit_costs"]["batch"] == 8
    assert all(u["fwd_flops"] > 0 and u["act_bytes"] > 0 for u in rep["unit_costs"]["units"])
    assert [round(r["params"], 6) for r in rep["per_rank_cost"]] == \
        [round(p, 6) for p in rep["param_coverage"]]
    assert main(argv) == 0
    table = capsys.readouterr().out
    assert "per-rank cost" in table and "#" in table and "max / mean" in table


# ResNet-18 (CIFAR-10, batch 128) forward + backward FLOPs per residual branch (subnet.costs)
RESNET18_FLOPS = [0.136, 0.136, 0.102, 0.136, 0.102, 0.136, 0.102, 0.136]


@pytest.mark.parametrize(("world", "n_units", "cov", "min_holders", "seed"), CASES[::2])
def test_joint_objective_never_worse_than_spread_on_random_sizes(world, n_units, cov,
                                                                 min_holders, seed) -> None:
    """Two resources per unit (e.g. parameters and time), drawn independently: the largest
    ratio over both is never above spread's; holders, connectivity and gap floor kept."""
    rng = np.random.default_rng(100 + seed)
    sizes = (rng.lognormal(10, 1.5, n_units) + 1).astype(int).tolist()
    other = rng.lognormal(0, 0.7, n_units).tolist()
    costs = [[float(s), t] for s, t in zip(sizes, other, strict=True)]
    units = _units(sizes)
    spread = make_plan(world=world, units=units, coverage=cov, scheme="spread")
    bal = make_plan(world=world, units=units, coverage=cov, scheme="balanced", seed=seed,
                    min_holders=min_holders, costs=costs)
    caps = [cov] * world
    assert max_ratio(bal.matrix, costs, caps) <= max_ratio(spread.matrix, costs, caps) + 1e-12
    assert min(bal.holder_counts()) >= min_holders
    assert is_connected(bal)
    assert spectral_gap(bal) >= GAP_FLOOR * spectral_gap(spread) - 1e-12


def test_joint_resnet18_keeps_params_and_flops_near_the_coverage() -> None:
    """One resource at a time trades the other away (params: FLOPs max/mean ~1.5; FLOPs:
    spread's 94% worst params); both at once keep both near C = 0.5 on 8 workers."""
    units = _units(RESNET18)
    kw = {"world": 8, "units": units, "coverage": 0.5, "shared_size": RESNET18_SHARED}
    flops = np.asarray(RESNET18_FLOPS)

    def flops_ratio(plan) -> float:  # type: ignore[no-untyped-def]
        per = np.asarray(plan.matrix, dtype=float) @ flops
        return float(per.max() / per.mean())

    by_params = make_plan(scheme="balanced", **kw)
    costs = [[float(p), f] for p, f in zip(RESNET18, RESNET18_FLOPS, strict=True)]
    joint = make_plan(scheme="balanced", costs=costs, **kw)
    spread = make_plan(scheme="spread", **kw)
    assert joint.scheme == "balanced"
    assert max(param_coverage(joint)) < 0.6 < max(param_coverage(spread))
    assert flops_ratio(joint) < 1.3 < flops_ratio(by_params)


def test_balance_names_are_checked() -> None:
    from subnetdp.cli import main
    from subnetdp.plan.objectives import parse_balance

    assert parse_balance("params+time") == ("params", "time")
    for bad in ("speed", "params+params", "params+"):
        with pytest.raises(PlanError, match="--balance"):
            parse_balance(bad)
    with pytest.raises(SystemExit):
        main(["plan", "--nproc", "4", "--units", "8", "--coverage", "0.5", "--scheme",
              "balanced", "--balance", "speed"])


def test_plan_command_shows_the_balanced_resources(capsys: pytest.CaptureFixture[str]) -> None:
    from subnetdp.cli import main

    argv = ["plan", "--nproc", "4", "--recipe", "resnet18-fmnist", "--coverage", "0.5",
            "--scheme", "balanced", "--balance", "params+cpu-time", "--batch-size", "8"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.strip().startswith("worker")
                  and "params" in line and "time" in line)
    assert "cpu-time" in header and "flops" in header and "memory" in header
    assert "cpu-time: max / mean" in out


def test_readme_balanced_resnet18_plan(capsys: pytest.CaptureFixture[str]) -> None:
    """The README's command: the default objective (params+time) keeps the worst rank's
    parameters near C = 0.5 and FLOPs as even as spread's."""
    import json

    from subnetdp.cli import main

    argv = ["plan", "--nproc", "8", "--recipe", "resnet18-cifar10", "--coverage", "0.5",
            "--scheme", "balanced"]
    assert main([*argv, "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["scheme"] == "balanced" and rep["balance"] == "params+time"
    assert max(rep["param_coverage"]) < 0.55
    flops = [r["flops"] for r in rep["per_rank_cost"]]
    assert max(flops) / np.mean(flops) < 1.05
    assert main(argv) == 0
    assert "the plan balances params+time" in capsys.readouterr().out
