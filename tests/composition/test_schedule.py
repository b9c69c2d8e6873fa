"""The collective-schedule checker (plan.schedule): accepts what the runtime issues, rejects
what deadlocks, and names the groups and ranks."""

from __future__ import annotations

import random

import pytest

from subnetdp.plan import Plan, Unit, make_plan
from subnetdp.plan.schedule import (
    ADJACENT,
    DEFAULT,
    OFF,
    Op,
    ScheduleError,
    check,
    fsdp_schedule,
    reducer_schedule,
)


def _plan(matrix: list[list[bool]]) -> Plan:
    return Plan(world=len(matrix), units=tuple(Unit(f"layers.{u}", 1) for u in
                                               range(len(matrix[0]))),
                shared_size=1, matrix=matrix)


def _random_plan(rng: random.Random) -> Plan:
    world, units = rng.randint(2, 8), rng.randint(1, 16)
    density = rng.uniform(0.15, 0.95)
    m = [[rng.random() < density for _ in range(units)] for _ in range(world)]
    for u in range(units):
        if not any(row[u] for row in m):
            m[rng.randrange(world)][u] = True
    return _plan(m)


def _fsdp_ok(plan: Plan, prefetch: str, **kw: object) -> bool:
    try:
        check({r: fsdp_schedule(plan, r, prefetch=prefetch, **kw)  # type: ignore[arg-type]
               for r in range(plan.world)})
    except ScheduleError:
        return False
    return True


def test_the_plan_that_deadlocked() -> None:
    """8 layers on 4 workers, spread at C = 0.5: FSDP2's default backward prefetch cannot be
    ordered (what hung), our adjacent rule and no prefetch can."""
    plan = make_plan(world=4, units=8, coverage=0.5)
    assert _fsdp_ok(plan, ADJACENT) and _fsdp_ok(plan, OFF)
    with pytest.raises(ScheduleError, match=r"cannot be ordered \(deadlock\)") as e:
        check({r: fsdp_schedule(plan, r, prefetch=DEFAULT) for r in range(4)})
    msg = str(e.value)
    assert "on groups [" in msg and " and [" in msg and "rank " in msg


def test_thousands_of_random_plans() -> None:
    rng = random.Random(0)
    default_rejected = 0
    for _ in range(3000):
        plan = _random_plan(rng)
        refresh = rng.random() < 0.5
        assert _fsdp_ok(plan, ADJACENT, refresh=refresh), plan.matrix
        assert _fsdp_ok(plan, OFF, refresh=refresh), plan.matrix
        # n-sdp: kept gathered through backward, reduce-scatters only
        assert _fsdp_ok(plan, OFF, reshard_after_forward=False), plan.matrix
        default_rejected += not _fsdp_ok(plan, DEFAULT)
    # the checker is not vacuous: FSDP2's own prefetch fails on most overlapping plans
    assert default_rejected > 1000


def test_spread_and_random_schemes() -> None:
    for world in (2, 3, 4, 6, 8):
        for units in (world, 2 * world, 12, 32):
            for coverage in (0.25, 0.375, 0.5, 0.69, 0.75, 1.0):
                for scheme in ("spread", "random"):
                    try:
                        plan = make_plan(world=world, units=units, coverage=coverage,
                                         scheme=scheme, seed=world + units)
                    except ValueError:
                        continue  # not connectable at this size
                    assert _fsdp_ok(plan, ADJACENT), (world, units, coverage, scheme)


def test_constructed_cycle_names_both_groups_and_ranks() -> None:
    """Ranks 0 and 1 share groups [0, 1] (via rank 0) and [1, 2] ... a three-rank cycle."""
    a, b, c = (0, 1), (1, 2), (0, 2)
    sched = {
        0: [Op("all_reduce", a, "x"), Op("all_reduce", c, "z")],
        1: [Op("all_reduce", b, "y"), Op("all_reduce", a, "x")],
        2: [Op("all_reduce", c, "z"), Op("all_reduce", b, "y")],
    }
    with pytest.raises(ScheduleError) as e:
        check(sched)
    msg = str(e.value)
    for g in ("[0, 1]", "[1, 2]", "[0, 2]"):
        assert g in msg
    for r in (0, 1, 2):
        assert f"rank {r} issues" in msg


def test_two_groups_in_opposite_orders() -> None:
    g, h = (0, 1), (0, 1, 2)
    sched = {0: [Op("all_reduce", g, "u1"), Op("all_reduce", h, "u2")],
             1: [Op("all_reduce", h, "u2"), Op("all_reduce", g, "u1")],
             2: [Op("all_reduce", h, "u2")]}
    with pytest.raises(ScheduleError, match=r"groups \[0, 1\] and \[0, 1, 2\].*rank 0.*rank 1"):
        check(sched)


def test_same_group_opposite_order_and_missing_member() -> None:
    g = (0, 1)
    with pytest.raises(ScheduleError, match="deadlock"):
        check({0: [Op("all_gather", g, "a"), Op("reduce_scatter", g, "b")],
               1: [Op("reduce_scatter", g, "b"), Op("all_gather", g, "a")]})
    with pytest.raises(ScheduleError, match="rank 1 never does"):
        check({0: [Op("all_gather", g, "a")], 1: []})
    with pytest.raises(ScheduleError, match="not in"):
        check({0: [Op("all_gather", (1, 2), "a")], 1: [], 2: []})


def test_one_rank_groups_never_wait() -> None:
    check({0: [Op("all_gather", (0,), "a"), Op("all_reduce", (0, 1), "s")],
           1: [Op("all_reduce", (0, 1), "s"), Op("all_gather", (1,), "b")]})


def test_adjacent_prefetch_shape() -> None:
    """Rank 0 holds 0, 1, 3 of 4: backward prefetches 0 from 1, nothing from 3 (2 is not
    held), forward prefetches 1 from 0 only."""
    plan = _plan([[True, True, False, True], [False, True, True, True]])
    ops = [(o.kind[0:2], o.what, o.phase[0]) for o in fsdp_schedule(plan, 0, step_end=())]
    assert ops == [
        ("al", "root", "f"), ("al", "layers.0", "f"), ("al", "layers.1", "f"),
        ("al", "layers.3", "f"),
        ("al", "layers.3", "b"), ("re", "layers.3", "b"),
        ("al", "layers.1", "b"), ("al", "layers.0", "b"), ("re", "layers.1", "b"),
        ("re", "layers.0", "b"), ("re", "root", "b")]


def test_reducer_schedule_is_safe() -> None:
    rng = random.Random(1)
    for _ in range(500):
        plan = _random_plan(rng)
        buckets = [(plan.holders(u), f"b{u}") for u in reversed(range(plan.num_units))]
        buckets.append((tuple(range(plan.world)), "shared"))
        check({r: reducer_schedule(plan, r, buckets, refresh=True) for r in range(plan.world)})


def _plan_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    import argparse

    from subnetdp.commands import plan_cmd

    parser = argparse.ArgumentParser()
    plan_cmd.add_parser(parser.add_subparsers())
    args = parser.parse_args(["plan", *argv])
    code = args.func(args)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cli_check_schedule(capsys: pytest.CaptureFixture[str]) -> None:
    base = ["--nproc", "4", "--units", "8", "--coverage", "0.5", "--check-schedule"]
    for extra in ([], ["--fsdp"], ["--fsdp", "--strategy", "bb-sdp"]):
        code, out, _ = _plan_cli([*base, *extra], capsys)
        assert code == 0 and "schedule: one global order exists" in out
    code, out, err = _plan_cli([*base, "--fsdp", "--prefetch", "default"], capsys)
    assert code == 2 and not out
    assert err.startswith("subnetdp plan: error: collectives on groups [") and "rank " in err
    assert err.count("\n") == 1
