"""The worlds an elastic run may shrink to and the plan each re-plans with: the one decision
that ``subnetdp plan`` reports and the launcher enforces ([Note: elastic shrink] in
train/elastic.py). Pure: the caller's ``make(world, min_holders)`` builds the run's plan.

[Note: shrinking plans]
A run with ``--min-nproc N`` may go on with any world from ``--nproc - 1`` down to ``N``, each
re-planned with the run's options. ``--min-holders H`` is kept at every such world above ``N``:
a loss there is rescued from the survivors' copies only if every unit has a second holder. At
``N`` itself a loss ends the run (no smaller world is allowed), so a second copy protects
nothing there: when ``N`` workers cannot hold ``H`` copies at the run's coverage (4 workers at
coverage 0.5 hold 2 copies, 3 do not), that world keeps as many as it can (at least one). A
world that cannot be planned even so, and a world above ``N`` that cannot keep ``H``, are
refused when the run starts, in one line naming the ``--min-nproc`` that works.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from subnetdp.plan.plan import Plan, PlanError

__all__ = ["Replan", "replan_blocker", "shrink_plans"]

Make = Callable[[int, int], Plan]  # (world, min_holders) -> the run's plan for that world


@dataclass(frozen=True)
class Replan:
    """The plan of one world the run may shrink to, and the ``--min-holders`` it keeps."""

    world: int
    min_holders: int
    plan: Plan


def replan_blocker(*, nproc: int, min_nproc: int, plan_file: bool, capacities: bool,
                   memory_gb: bool) -> str | None:
    """Why a run with these options cannot shrink to ``min_nproc`` workers (None: it can)."""
    if not 1 <= min_nproc <= nproc:
        return f"--min-nproc must be between 1 and --nproc ({nproc}), got {min_nproc}"
    if plan_file:
        return ("--min-nproc re-plans for fewer workers, which a --plan-file cannot do; use "
                "--coverage/--scheme, or drop --min-nproc")
    if capacities or memory_gb:
        flag = "--capacities" if capacities else "--memory-gb"
        return (f"--min-nproc re-plans for fewer workers, but {flag} gives one value per "
                f"worker of --nproc; drop one of them")
    return None


def shrink_plans(make: Make, *, nproc: int, min_nproc: int, min_holders: int) -> list[Replan]:
    """Every world from ``nproc - 1`` down to ``min_nproc``, re-planned ([Note: shrinking
    plans]); ``PlanError`` in one line when one cannot be."""
    out: list[Replan] = []
    for world in range(nproc - 1, min_nproc - 1, -1):
        try:
            out.append(Replan(world, min_holders, make(world, min_holders)))
            continue
        except PlanError as e:
            why = str(e)
        kept = _most_holders(make, world, min_holders - 1)
        if world == min_nproc and kept is not None:
            out.append(kept)
            continue
        works = world if kept is not None else world + 1
        fix = (f"--min-nproc {works} works" if works < nproc else
               "no smaller world works: drop --min-nproc")
        raise PlanError(
            f"--nproc {nproc} --min-nproc {min_nproc}: the run may shrink to {world} workers, "
            f"where its plan fails ({why.rstrip('.')}); {fix} (or raise --coverage"
            + (", lower --min-holders" if min_holders > 1 else "") + ")")
    return out


def _most_holders(make: Make, world: int, most: int) -> Replan | None:
    """The plan at ``world`` with the most holders per unit up to ``most`` (None: none)."""
    for holders in range(most, 0, -1):
        try:
            return Replan(world, holders, make(world, holders))
        except PlanError:
            continue
    return None
