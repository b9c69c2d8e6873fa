"""Plan schemes: who holds which unit (docs/method.md §3).

Two facts shape the schemes (N workers, U units, k units per worker):

- Every unit needs a holder, so k·N >= U.
- The graph "workers that share a unit" can only be connected if k·N - U >= N - 1: a unit with
  c holders joins at most c - 1 components, and the units together offer Σ(c_u - 1) = k·N - U
  joins, while N workers need N - 1 of them. (N = 1 is trivially connected.)

``spread`` (the default) is connected exactly when that bound allows it; see ``spread_matrix``.
``random`` always returns a connected plan, or refuses. ``balanced`` (``plan/balance.py``) holds
about the same share of the units' *cost* on every rank; see ``make_plan`` for how it is kept
never worse than spread and its spectral gap bounded below.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from subnetdp.plan.balance import balanced_matrix, max_ratio
from subnetdp.plan.diagnostics import spectral_gap
from subnetdp.plan.plan import Plan, PlanError, Unit, connected_components

Matrix = tuple[tuple[bool, ...], ...]

# The random scheme retries with the same generator this many times before falling back to a
# randomly relabelled spread window (which is connected whenever any plan can be).
RANDOM_TRIES = 200
# The balanced scheme's spectral gap is kept >= GAP_FLOOR x the spread plan's at the same
# (mean) coverage: a cost-balanced plan may give heavy units fewer holders, which mixes less.
GAP_FLOOR = 0.5


def units_for_coverage(coverage: float, num_units: int) -> int:
    """k, the number of units per worker: ``round(coverage * U)``, halves rounded up, >= 1.

    Halves go up (not Python's round-half-to-even) so that e.g. C=0.5 of 5 units gives 3,
    the side that never drops below the requested coverage. The tiny epsilon absorbs binary
    floating error such as 0.7 * 10 = 7.000000000000001 or 0.35 * 10 = 3.4999999999999996.
    """
    return max(1, math.floor(coverage * num_units + 0.5 + 1e-9))


def min_units_per_worker(world: int, num_units: int, *, connected: bool = False) -> int:
    """Smallest k such that every unit has a holder (and, if asked, a connected plan exists)."""
    if connected and world > 1:
        return min(num_units, math.ceil((num_units + world - 1) / world))
    return math.ceil(num_units / world)


def can_connect(world: int, num_units: int, k: int) -> bool:
    """Whether any plan with k units per worker has a connected worker graph (module docstring)."""
    return world == 1 or k * world - num_units >= world - 1


def _check_k(world: int, num_units: int, k: int) -> None:
    if world < 1:
        raise PlanError(f"world must be >= 1 worker, got {world}")
    if num_units < 1:
        raise PlanError("a plan needs at least one unit; give a unit count >= 1 or a model")
    if not 1 <= k <= num_units:
        raise PlanError(f"units per worker must be in [1, {num_units}], got {k}")
    if k * world < num_units:
        kmin = min_units_per_worker(world, num_units)
        raise PlanError(
            f"{world} workers holding {k} of {num_units} units each leave some unit with no "
            f"holder (k*N = {k * world} < U = {num_units}); the minimum coverage for {world} "
            f"workers and {num_units} units is {kmin}/{num_units} = {kmin / num_units:.4g}: "
            "raise the coverage or the number of workers"
        )


def spread_matrix(world: int, num_units: int, k: int, *, offset: int = 0) -> Matrix:
    """Spread window: worker i holds k consecutive units from ⌊i·U/N⌋ (+ offset), cyclically.

    Starts are as evenly spaced as integers allow, so holder counts differ by at most one
    (exactly k·N/U each when that divides) and consecutive workers overlap whenever k exceeds
    their start gap. A cut in the worker ring needs a gap of k = ⌈U/N⌉; with U = qN + r there are
    r such gaps, and r <= 1 is exactly the bound k·N - U >= N - 1, so spread is connected
    whenever any plan with k units per worker can be. ``offset`` rotates all windows (e.g. by
    layer index for neuron-level plans) without changing these properties.
    """
    _check_k(world, num_units, k)
    rows = []
    for i in range(world):
        start = i * num_units // world + offset
        held = {(start + j) % num_units for j in range(k)}
        rows.append(tuple(u in held for u in range(num_units)))
    return tuple(rows)


def naive_window(world: int, num_units: int, k: int) -> Matrix:
    """Worker i holds units i·k … i·k+k−1 (mod U). Balanced, but it can split workers into
    islands (e.g. N=8, U=6, k=3: even and odd workers never meet). Kept for tests and docs."""
    _check_k(world, num_units, k)
    rows = []
    for i in range(world):
        held = {(i * k + j) % num_units for j in range(k)}
        rows.append(tuple(u in held for u in range(num_units)))
    return tuple(rows)


def _random_balanced(world: int, num_units: int, k: int, rng: np.random.Generator) -> Matrix:
    """Every worker holds k units, holder counts differ by at most one, chosen at random.

    Target counts are ⌊kN/U⌋ plus one for (kN mod U) random units. Workers then pick, one after
    the other, the k units with the largest remaining demand (random tie-break). Taking the
    largest demands first keeps the remaining demands within one of each other and never above
    the number of workers left, so the construction always completes (Gale-Ryser / Ryser).
    """
    base, extra = divmod(k * world, num_units)
    demand = np.full(num_units, base, dtype=np.int64)
    demand[rng.permutation(num_units)[:extra]] += 1
    rows = []
    for _ in range(world):
        # lexsort: last key is primary -> largest demand first, random priority breaks ties.
        order = np.lexsort((rng.random(num_units), -demand))
        chosen = order[:k]
        demand[chosen] -= 1
        row = np.zeros(num_units, dtype=bool)
        row[chosen] = True
        rows.append(tuple(bool(x) for x in row))
    return tuple(rows)


def random_matrix(world: int, num_units: int, k: int, rng: np.random.Generator) -> Matrix:
    """A seeded, balanced and connected random plan (see ``_random_balanced``).

    Draws until the worker graph is connected. Near the connectivity bound almost no balanced
    plan is connected, so after ``RANDOM_TRIES`` draws it falls back to a spread window with
    workers and units relabelled at random, which is balanced and connected by construction.
    """
    _check_k(world, num_units, k)
    if not can_connect(world, num_units, k):
        kmin = min_units_per_worker(world, num_units, connected=True)
        raise PlanError(
            f"no connected plan exists for {world} workers holding {k} of {num_units} units each "
            f"(needs k*N - U >= N - 1, i.e. k >= {kmin}, coverage >= {kmin / num_units:.4g}); "
            "raise the coverage, or use the spread scheme to accept a disconnected plan"
        )
    for _ in range(RANDOM_TRIES):
        m = _random_balanced(world, num_units, k, rng)
        if len(connected_components(m)) == 1:
            return m
    spread = spread_matrix(world, num_units, k)
    ranks, cols = rng.permutation(world), rng.permutation(num_units)
    return tuple(tuple(spread[int(ranks[i])][int(cols[u])] for u in range(num_units))
                 for i in range(world))


def make_plan(
    *,
    world: int,
    units: int | Sequence[Unit],
    coverage: float,
    scheme: str = "spread",
    seed: int = 0,
    shared_size: int = 0,
    costs: Sequence[float] | Sequence[Sequence[float]] | None = None,
    capacities: Sequence[float] | None = None,
    min_holders: int = 1,
    max_groups: int | None = None,
) -> Plan:
    """Build a plan where each of ``world`` workers holds k = round(coverage·U) units.

    ``units`` is a count (that many units of size 1 named ``unit{i}``) or the model's units with
    their sizes. See ``units_for_coverage`` for the rounding. ``coverage == 1`` gives every worker
    every unit (DDP). ``seed`` only matters for ``scheme="random"`` and ``"balanced"``.

    ``balanced`` balances ``costs`` (one per unit, or one row of resource costs per unit for a
    joint min-max; default: the units' sizes) so that every rank
    holds about ``coverage`` of the total, or ``capacities[i]`` of it on rank i (heterogeneous
    workers). Every unit keeps >= ``min_holders`` holders (checked for every scheme).

    ``max_groups`` K (spread, random): at most K distinct holder sets, so at most K process
    groups (communicators): the scheme's plan for K units gives K holder patterns and unit u
    takes pattern u mod K, so each worker holds round(coverage·K) of every K consecutive units.
    """
    unit_list = _unit_list(units)
    if isinstance(coverage, bool) or not (0.0 < float(coverage) <= 1.0):
        raise PlanError(
            f"coverage must be in (0, 1] (the fraction of units each worker holds), got {coverage}"
        )
    if world < 1:
        raise PlanError(f"world must be >= 1 worker, got {world}")
    if capacities is not None and scheme != "balanced":
        raise PlanError("per-rank capacities need --scheme balanced (spread and random give "
                        "every worker the same number of units)")
    num_units, asked = len(unit_list), scheme
    k = num_units if coverage >= 1.0 else units_for_coverage(coverage, num_units)
    plan_coverage: float | None = float(coverage)
    if scheme == "spread":
        matrix = spread_matrix(world, num_units, k)
    elif scheme == "random":
        matrix = random_matrix(world, num_units, k, np.random.default_rng(seed))
    elif scheme == "balanced":
        weights: list[Any] = [_cost(c) for c in costs] if costs is not None else \
            [float(u.size) for u in unit_list]
        if len(weights) != num_units:
            raise PlanError(f"{len(weights)} unit costs for {num_units} units")
        caps = [float(coverage)] * world if capacities is None else [float(c) for c in capacities]
        if len(set(caps)) > 1:
            plan_coverage = None  # per-rank capacities: no single coverage
        matrix, scheme = _balanced(world, unit_list, shared_size, weights, caps, min_holders,
                                   seed)
    else:
        raise PlanError(
            f"unknown scheme {scheme!r}; use 'spread', 'random' or 'balanced' (or explicit_plan "
            "/ --plan-file FILE for a hand-written matrix)"
        )
    if max_groups is not None:  # the scheme asked for (balanced may answer with spread)
        matrix = _tiled(matrix, world, num_units, coverage, asked, seed, max_groups)
    plan = Plan(
        world=world,
        units=unit_list,
        shared_size=shared_size,
        matrix=matrix,
        scheme=scheme,
        coverage=plan_coverage,
        seed=seed,
    )
    plan.validate()
    _check_min_holders(plan, min_holders)
    return plan


def _tiled(matrix: Matrix, world: int, num_units: int, coverage: float, scheme: str,
           seed: int, k_groups: int) -> Matrix:
    """``matrix`` with its units tiled into ``k_groups`` holder patterns (``max_groups``)."""
    if scheme not in ("spread", "random"):
        raise PlanError("--max-groups tiles a spread or random plan; a balanced plan places "
                        "each unit by its cost, so drop one of them")
    if k_groups < 1:
        raise PlanError(f"--max-groups must be >= 1, got {k_groups}")
    if k_groups >= num_units:
        return matrix  # as many patterns as units: nothing to bound
    k = k_groups if coverage >= 1.0 else units_for_coverage(coverage, k_groups)
    patterns = (spread_matrix(world, k_groups, k) if scheme == "spread" else
                random_matrix(world, k_groups, k, np.random.default_rng(seed)))
    return tuple(tuple(row[u % k_groups] for u in range(num_units)) for row in patterns)


def _cost(c: float | Sequence[float]) -> float | list[float]:
    return float(c) if isinstance(c, int | float) else [float(x) for x in c]


def _unit_list(units: int | Sequence[Unit]) -> tuple[Unit, ...]:
    if isinstance(units, bool):
        raise PlanError("units must be a count or a list of Unit, got a bool")
    if isinstance(units, int):
        if units < 1:
            raise PlanError(f"a plan needs at least one unit, got units={units}")
        return tuple(Unit(f"unit{i}", 1) for i in range(units))
    if not units:
        raise PlanError("a plan needs at least one unit; the model declares none")
    return tuple(units)


def _check_min_holders(plan: Plan, min_holders: int) -> None:
    if not 1 <= min_holders <= plan.world:  # no scheme or coverage can give more holders
        raise PlanError(f"--min-holders (min_holders) must be in [1, {plan.world}], the "
                        f"number of workers; got {min_holders}")
    few = [u for u, c in enumerate(plan.holder_counts()) if c < min_holders]
    if few:
        raise PlanError(
            f"{len(few)} unit(s) have fewer than --min-holders {min_holders} holders under "
            f"scheme {plan.scheme}; raise the coverage or use --scheme balanced")


def _balanced(
    world: int, units: tuple[Unit, ...], shared_size: int, weights: list[Any],
    caps: list[float], min_holders: int, seed: int,
) -> tuple[Matrix, str]:
    """The balanced matrix, or spread's when balanced would not be strictly better.

    Candidates, first acceptable wins: the full scheme, the full scheme with a gap-aware local
    search, and its greedy phases alone (``balance.py``). With equal
    capacities the spread plan at the same coverage is the reference: a candidate must lower
    the largest per-rank cost strictly, stay connected and keep its spectral gap >=
    GAP_FLOOR x spread's, or spread is returned (and named: scheme "spread"). With unequal
    capacities there is no spread plan to fall back to: the reference gap is spread's at the
    mean capacity, and a plan that cannot meet the floor is refused.
    """
    num_units = len(units)

    def gap(m: Matrix) -> float:
        return spectral_gap(Plan(world=world, units=units, shared_size=shared_size, matrix=m))

    mean = sum(caps) / world
    k = num_units if mean >= 1.0 else units_for_coverage(mean, num_units)
    spread = spread_matrix(world, num_units, k) if k * world >= num_units else None
    if spread is not None and min(sum(col) for col in zip(*spread, strict=True)) < min_holders:
        spread = None
    homogeneous = len(set(caps)) == 1
    ref_gap = gap(spread) if spread is not None else 0.0
    # fast search first; then one that refuses moves below the gap floor; then greedy alone
    for local_search, watch_gap in ((True, False), (True, True), (False, False)):
        m = balanced_matrix(weights, world=world, capacities=caps, min_holders=min_holders,
                            seed=seed, local_search=local_search,
                            gap=gap if watch_gap else None, min_gap=GAP_FLOOR * ref_gap)
        if len(connected_components(m)) > 1 or gap(m) < GAP_FLOOR * ref_gap:
            continue
        if not (homogeneous and spread is not None) or \
                max_ratio(m, weights, caps) < max_ratio(spread, weights, caps) - 1e-9:
            return m, "balanced"
    if homogeneous and spread is not None:
        return spread, "spread"
    raise PlanError(
        f"no balanced plan for these per-rank capacities keeps the worker graph connected with "
        f"a spectral gap >= {GAP_FLOOR} x spread's ({ref_gap:.3g}); raise the smallest "
        "capacities (budgets) or --min-holders")


def make_layered_plan(
    *,
    world: int,
    units: Sequence[Unit],
    layers: Sequence[int],
    coverage: float,
    scheme: str = "spread",
    seed: int = 0,
    shared_size: int = 0,
    rotate: bool = False,
) -> Plan:
    """A neuron-level plan (docs/method.md §3): units are grouped by layer (``layers[u]`` is unit
    u's layer) and every worker holds k_l = round(coverage·U_l) units *of every layer*, chosen
    by ``scheme`` within the layer. With ``rotate`` the spread window of the l-th layer starts
    l units later, which varies which workers share which layers; the holder sets stay the
    same windows (so the number of process groups does not grow)."""
    unit_list = tuple(units)
    if len(layers) != len(unit_list):
        raise PlanError(f"{len(unit_list)} units but {len(layers)} layer indices")
    if isinstance(coverage, bool) or not (0.0 < float(coverage) <= 1.0):
        raise PlanError(f"coverage must be in (0, 1], got {coverage}")
    if scheme not in ("spread", "random"):
        raise PlanError(f"unknown scheme {scheme!r}; use 'spread' or 'random'")
    order: dict[int, list[int]] = {}
    for u, layer in enumerate(layers):
        order.setdefault(layer, []).append(u)
    rng = np.random.default_rng(seed)
    columns: dict[int, tuple[bool, ...]] = {}
    for pos, members in enumerate(order.values()):
        n = len(members)
        k = n if coverage >= 1.0 else units_for_coverage(coverage, n)
        if scheme == "spread":
            sub = spread_matrix(world, n, k, offset=pos if rotate else 0)
        else:
            sub = random_matrix(world, n, k, rng)
        for j, u in enumerate(members):
            columns[u] = tuple(sub[i][j] for i in range(world))
    matrix = tuple(
        tuple(columns[u][i] for u in range(len(unit_list))) for i in range(world)
    )
    plan = Plan(world=world, units=unit_list, shared_size=shared_size, matrix=matrix,
                scheme=scheme, coverage=float(coverage), seed=seed)
    plan.validate()
    return plan
