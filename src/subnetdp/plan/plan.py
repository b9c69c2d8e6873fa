"""The plan: which worker holds which unit (docs/method.md §2-3).

A plan is a boolean matrix ``matrix[rank][unit]`` plus the units' names and sizes. It is pure
data: no torch, no process groups. Every rank of a run builds (or loads) the same plan, and the
plan is stored with every checkpoint, so it must survive a JSON round trip exactly.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

FORMAT_VERSION = 1
SCHEMES = ("spread", "random", "balanced", "explicit")


class PlanError(ValueError):
    """A plan request or a plan file that cannot be used; the message says how to fix it."""


@dataclass(frozen=True)
class Unit:
    """The smallest structural piece that can be masked (a block or a neuron group)."""

    name: str
    size: int  # parameter elements in this unit (not bytes)


def connected_components(matrix: Sequence[Sequence[bool]]) -> list[list[int]]:
    """Components of the graph "workers that share a unit", each a sorted list of ranks.

    Used by ``is_connected`` and by the random scheme's retry loop, so it works on a raw matrix.
    """
    world = len(matrix)
    parent = list(range(world))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    num_units = len(matrix[0]) if world else 0
    for u in range(num_units):
        holders = [i for i in range(world) if matrix[i][u]]
        for i in holders[1:]:
            a, b = find(holders[0]), find(i)
            if a != b:
                parent[max(a, b)] = min(a, b)
    groups: dict[int, list[int]] = {}
    for i in range(world):
        groups.setdefault(find(i), []).append(i)
    return sorted(groups.values())


@dataclass(frozen=True)
class Plan:
    """Which worker holds which unit; fixed for a whole run.

    ``holders(u)`` is the set of ranks that train unit ``u`` and average its gradient; shared
    parameters (``shared_size`` elements outside all units) are held by everyone.
    """

    world: int
    units: tuple[Unit, ...]
    shared_size: int
    matrix: tuple[tuple[bool, ...], ...]  # matrix[rank][unit]
    scheme: str = "explicit"
    coverage: float | None = None  # the requested coverage; informational only
    seed: int | None = None
    _holders: tuple[tuple[int, ...], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # Normalise lists/ints to tuples/bools so that equality and hashing are structural
        # (a plan read back from JSON compares equal to the one written).
        matrix = tuple(tuple(bool(x) for x in row) for row in self.matrix)
        object.__setattr__(self, "matrix", matrix)
        object.__setattr__(self, "units", tuple(self.units))
        width = min((len(row) for row in matrix), default=0)
        holders = tuple(
            tuple(i for i, row in enumerate(matrix) if row[u]) for u in range(width)
        )
        object.__setattr__(self, "_holders", holders)

    # -- queries -------------------------------------------------------------------------------
    @property
    def num_units(self) -> int:
        return len(self.units)

    @property
    def unit_sizes(self) -> list[int]:
        return [u.size for u in self.units]

    @property
    def total_size(self) -> int:
        """All parameter elements of the full model: shared plus every unit."""
        return self.shared_size + sum(u.size for u in self.units)

    def holds(self, rank: int, unit: int) -> bool:
        return self.matrix[rank][unit]

    def held_units(self, rank: int) -> list[int]:
        return [u for u, held in enumerate(self.matrix[rank]) if held]

    def holders(self, unit: int) -> tuple[int, ...]:
        return self._holders[unit]

    def holder_counts(self) -> list[int]:
        return [len(h) for h in self._holders]

    def owner(self, unit: int) -> int:
        """The lowest-ranked holder: the one that sends the unit to non-holders (refresh)."""
        holders = self._holders[unit]
        if not holders:
            raise PlanError(f"unit {unit} has no holder; validate() the plan first")
        return holders[0]

    def holder_sets(self) -> list[tuple[int, ...]]:
        """Distinct holder sets, in order of first appearance over units 0..U-1.

        This order is the one in which every rank creates its process groups, so it must be
        deterministic and identical everywhere.
        """
        seen: dict[tuple[int, ...], None] = {}
        for h in self._holders:
            seen.setdefault(h, None)
        return list(seen)

    def held_size(self, rank: int) -> int:
        """Parameter elements worker ``rank`` holds: shared plus its units."""
        return self.shared_size + sum(self.units[u].size for u in self.held_units(rank))

    # -- validation ----------------------------------------------------------------------------
    def validate(self, world_size: int | None = None) -> None:
        """Raise ``PlanError`` if the plan is malformed or does not fit ``world_size`` workers."""
        if self.world < 1:
            raise PlanError(f"a plan needs at least one worker, got world={self.world}")
        if self.num_units < 1:
            raise PlanError("a plan needs at least one unit; the model declares none")
        if self.scheme not in SCHEMES:
            raise PlanError(f"unknown scheme {self.scheme!r}; use one of {', '.join(SCHEMES)}")
        if self.shared_size < 0 or any(u.size < 0 for u in self.units):
            raise PlanError("unit sizes and shared_size must be >= 0 (parameter element counts)")
        names = [u.name for u in self.units]
        if len(set(names)) != len(names):
            raise PlanError(f"unit names must be distinct, got {names}")
        if len(self.matrix) != self.world:
            raise PlanError(
                f"the plan matrix has {len(self.matrix)} rows but world={self.world}; "
                "give one row per worker"
            )
        for rank, row in enumerate(self.matrix):
            if len(row) != self.num_units:
                raise PlanError(
                    f"row {rank} of the plan matrix has {len(row)} entries but there are "
                    f"{self.num_units} units; give one column per unit"
                )
        orphans = [u for u, h in enumerate(self._holders) if not h]
        if orphans:
            shown = ", ".join(f"{u} ({self.units[u].name})" for u in orphans[:8])
            raise PlanError(
                f"unit(s) {shown} have no holder, so nobody would train them; give every unit "
                "at least one worker (raise the coverage or fix the matrix column)"
            )
        if world_size is not None and world_size != self.world:
            raise PlanError(
                f"plan was built for {self.world} workers but {world_size} are running; rebuild "
                f"it for {world_size} (subnetdp plan --nproc {world_size} ..., or make_plan("
                f"world={world_size}, ...)) or launch {self.world} workers"
            )

    # -- serialisation -------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "format": "subnetdp-plan",
            "version": FORMAT_VERSION,
            "world": self.world,
            "scheme": self.scheme,
            "coverage": self.coverage,
            "seed": self.seed,
            "shared_size": self.shared_size,
            "units": [{"name": u.name, "size": u.size} for u in self.units],
            # 0/1 rather than true/false keeps files short and readable as a grid.
            "matrix": [[int(x) for x in row] for row in self.matrix],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Plan:
        if not isinstance(d, dict):
            raise PlanError("a plan must be a JSON object as written by Plan.to_json()")
        version = d.get("version", FORMAT_VERSION)
        if version != FORMAT_VERSION:
            raise PlanError(
                f"plan format version {version} is not supported (this subnetdp reads version "
                f"{FORMAT_VERSION}); rebuild the plan with `subnetdp plan`"
            )
        try:
            plan = cls(
                world=int(d["world"]),
                units=tuple(Unit(name=str(u["name"]), size=int(u["size"])) for u in d["units"]),
                shared_size=int(d.get("shared_size", 0)),
                matrix=tuple(tuple(_cell(x) for x in row) for row in d["matrix"]),
                scheme=str(d.get("scheme", "explicit")),
                coverage=None if d.get("coverage") is None else float(d["coverage"]),
                seed=None if d.get("seed") is None else int(d["seed"]),
            )
        except (KeyError, TypeError) as e:
            raise PlanError(
                f"not a valid subnetdp plan ({type(e).__name__}: {e}); it needs world, units "
                "and matrix as written by Plan.to_json()"
            ) from e
        plan.validate()
        return plan

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"))

    @classmethod
    def from_json(cls, s: str) -> Plan:
        try:
            d = json.loads(s)
        except json.JSONDecodeError as e:
            raise PlanError(f"the plan is not valid JSON: {e}") from e
        return cls.from_dict(d)


def _cell(x: object) -> bool:
    # Accept true/false and 0/1 only: a 2 or "yes" in a hand-written matrix is a typo.
    if isinstance(x, bool):
        return x
    if isinstance(x, int) and x in (0, 1):
        return bool(x)
    raise PlanError(f"plan matrix entries must be 0/1 or true/false, got {x!r}")


def explicit_plan(
    matrix: Sequence[Sequence[bool | int]],
    units: Sequence[Unit] | None = None,
    shared_size: int = 0,
) -> Plan:
    """A plan from a user matrix ``[world][units]`` (1 = the worker holds the unit); validated.

    Without ``units``, every column is a unit of size 1 named ``unit{i}``.
    """
    if isinstance(matrix, (str, bytes)) or not all(
        isinstance(row, Sequence) and not isinstance(row, (str, bytes)) for row in matrix
    ):
        raise PlanError(
            "the plan matrix must be a list of rows, one per worker, e.g. [[1,0],[0,1]]"
        )
    rows = tuple(tuple(_cell(x) for x in row) for row in matrix)
    if not rows:
        raise PlanError("the plan matrix is empty; give one row per worker")
    width = len(rows[0])
    if units is None:
        units = [Unit(f"unit{i}", 1) for i in range(width)]
    elif len(units) != width:
        raise PlanError(
            f"the matrix has {width} columns but {len(units)} units were given; give one column "
            "per unit"
        )
    plan = Plan(
        world=len(rows),
        units=tuple(units),
        shared_size=shared_size,
        matrix=rows,
        scheme="explicit",
        coverage=None,
        seed=None,
    )
    plan.validate()
    return plan
