"""Neuron-level units (n-sdp): groups of hidden units, heads or channels of a layer pair.

A model's adapter lists its layer pairs (``NeuronPair``); n-sdp splits each selected pair's
``slots`` into ``min(groups, slots)`` contiguous, near-equal groups, and every group is one plan
unit named ``f"{pair.name}[{g}]"``. The plan's unit names are therefore enough to recover the
structure on any rank (and from a plan file): ``plan_groups`` maps them back.
"""

from __future__ import annotations

import math
import re
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from torch import nn

from subnetdp.plan import Plan, PlanError, Unit, make_layered_plan
from subnetdp.subnet.adapter import NeuronPair, UnitAdapter


@dataclass(frozen=True)
class NeuronGroup:
    """Group ``index`` of ``pair``: slots ``[slot_start, slot_stop)`` of its hidden dimension."""

    pair: NeuronPair
    index: int
    slot_start: int
    slot_stop: int

    @property
    def name(self) -> str:
        return f"{self.pair.name}[{self.index}]"

    def span(self, size: int) -> tuple[int, int]:
        """The group's entries along a tensor dimension of ``size`` (a multiple of slots)."""
        per_slot = size // self.pair.slots
        return self.slot_start * per_slot, self.slot_stop * per_slot


def group_bounds(slots: int, groups: int) -> list[tuple[int, int]]:
    """``min(groups, slots)`` contiguous slot ranges whose sizes differ by at most one."""
    g = min(groups, slots)
    return [(i * slots // g, (i + 1) * slots // g) for i in range(g)]


def select_pairs(
    model: nn.Module, adapter: UnitAdapter, kinds: Collection[str] | None = None
) -> list[NeuronPair]:
    """The adapter's layer pairs of the requested kinds (all kinds when ``kinds`` is None)."""
    if adapter.neuron_pairs is None:
        raise ValueError(
            f"{type(model).__name__}'s adapter declares no neuron pairs, so n-sdp cannot split "
            "it; give the UnitAdapter a neuron_pairs function or use --strategy b-sdp"
        )
    pairs = adapter.neuron_pairs(model)
    available = sorted({p.kind for p in pairs})
    if kinds is not None:
        unknown = sorted(set(kinds) - set(available))
        if unknown:
            raise ValueError(
                f"unknown neuron kind(s) {unknown} for {type(model).__name__}; "
                f"it has {available}"
            )
        pairs = [p for p in pairs if p.kind in kinds]
    if not pairs:
        raise ValueError(f"no neuron pairs selected; choose kinds among {available}")
    _check_pairs(model, pairs)
    return pairs


def _check_pairs(model: nn.Module, pairs: Sequence[NeuronPair]) -> None:
    state = model.state_dict(keep_vars=True)
    for pair in pairs:
        for key, dim in pair.tensors:
            if key not in state:
                raise ValueError(f"neuron pair {pair.name!r} names {key!r}, not in the model")
            shape = state[key].shape
            if not 0 <= dim < len(shape) or shape[dim] % pair.slots:
                raise ValueError(
                    f"neuron pair {pair.name!r}: {key} {tuple(shape)} has no dimension {dim} "
                    f"that is a multiple of its {pair.slots} slots"
                )


def neuron_groups(pairs: Sequence[NeuronPair], groups: int) -> list[NeuronGroup]:
    """Every group of every pair, pair by pair (the plan's unit order)."""
    if groups < 1:
        raise ValueError(f"neuron groups per layer must be >= 1, got {groups}")
    return [
        NeuronGroup(pair, g, a, b)
        for pair in pairs
        for g, (a, b) in enumerate(group_bounds(pair.slots, groups))
    ]


def unit_sizes(model: nn.Module, groups: Sequence[NeuronGroup]) -> list[int]:
    """Parameter elements in each group (buffers such as BatchNorm statistics are not
    counted); the model's parameters are listed once (a plan for thousands of ranks has
    tens of thousands of groups)."""
    params = dict(model.named_parameters())
    sizes = []
    for group in groups:
        size = 0
        for key, dim in group.pair.tensors:
            if key in params:
                shape = params[key].shape
                a, b = group.span(shape[dim])
                size += math.prod(shape) // shape[dim] * (b - a)
        sizes.append(size)
    return sizes


def describe_neuron_units(
    model: nn.Module, adapter: UnitAdapter, *, groups: int, kinds: Collection[str] | None = None
) -> tuple[list[Unit], int, list[int]]:
    """The plan's view of a model at neuron level: units (groups) with parameter counts, the
    shared size (everything not in a group) and each unit's layer (its pair's index)."""
    pairs = select_pairs(model, adapter, kinds)
    found = neuron_groups(pairs, groups)
    units = [Unit(g.name, n) for g, n in zip(found, unit_sizes(model, found), strict=True)]
    layer_of = {p.name: i for i, p in enumerate(pairs)}
    total = sum(p.numel() for p in model.parameters())
    return units, total - sum(u.size for u in units), [layer_of[g.pair.name] for g in found]


def make_neuron_plan(
    model: nn.Module,
    adapter: UnitAdapter,
    *,
    world: int,
    coverage: float,
    scheme: str = "spread",
    seed: int = 0,
    groups: int | None = None,
    kinds: str | Collection[str] | None = None,
    rotate: bool = False,
) -> Plan:
    """The neuron-level plan of a model: ``groups`` per layer pair (default:
    ``default_groups(world, coverage)``), of the pair ``kinds`` given as a list or a
    comma-separated string (default: all), each worker holding round(coverage·G) groups of
    every pair (``make_layered_plan``)."""
    if isinstance(kinds, str):
        kinds = [k for k in kinds.split(",") if k]
    units, shared, layers = describe_neuron_units(
        model, adapter, groups=groups or default_groups(world, coverage), kinds=kinds or None
    )
    return make_layered_plan(world=world, units=units, layers=layers, coverage=coverage,
                             scheme=scheme, seed=seed, shared_size=shared, rotate=rotate)


def default_groups(world: int, coverage: float) -> int:
    """Groups per layer pair: the world size, or its smallest multiple (up to 4x) for which
    coverage·G is a whole number of groups. With G = world = 4 and C = 0.375 each worker would
    hold round(1.5) = 2 of 4 groups, i.e. C = 0.5, silently; G = 8 gives exactly 3 of 8."""
    for m in range(1, 5):
        if abs(coverage * m * world - round(coverage * m * world)) < 1e-9:
            return m * world
    return world


_GROUP_NAME = re.compile(r"^(?P<pair>.+)\[(?P<g>\d+)\]$")


def plan_groups(
    model: nn.Module, adapter: UnitAdapter, unit_names: Sequence[str]
) -> list[NeuronGroup]:
    """Map a neuron-level plan's unit names back onto the model's pairs, in plan order.

    Raises ``PlanError`` when a name is not a group of this model or a pair's groups are not
    ``0 … G-1`` (a plan made for another model or another strategy)."""
    pairs = {p.name: p for p in select_pairs(model, adapter)}
    counts: dict[str, int] = {}
    parsed: list[tuple[str, int]] = []
    for name in unit_names:
        m = _GROUP_NAME.match(name)
        if m is None or m["pair"] not in pairs:
            raise PlanError(
                f"plan unit {name!r} is not a neuron group of {type(model).__name__}; "
                "build the plan with --strategy n-sdp for this model"
            )
        parsed.append((m["pair"], int(m["g"])))
        counts[m["pair"]] = counts.get(m["pair"], 0) + 1
    out = []
    for pair_name, g in parsed:
        pair, n = pairs[pair_name], counts[pair_name]
        bounds = group_bounds(pair.slots, n)
        if g >= len(bounds) or len(bounds) != n:
            raise PlanError(
                f"plan splits {pair_name} into {n} groups, which its {pair.slots} slots "
                "cannot give; rebuild the plan from this model"
            )
        out.append(NeuronGroup(pair, g, *bounds[g]))
    if len({g.name for g in out}) != len(out):
        raise PlanError("the plan lists a neuron group twice; rebuild it")
    return out
