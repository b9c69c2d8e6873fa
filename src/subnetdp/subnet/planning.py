"""A model's plan for a strategy: block units or neuron groups, one function for every caller."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from subnetdp.plan import Plan, make_plan
from subnetdp.strategy import Strategy
from subnetdp.subnet.adapter import UnitAdapter
from subnetdp.subnet.neurons import make_neuron_plan
from subnetdp.subnet.units import describe_units


def plan_for(
    model: nn.Module, adapter: UnitAdapter, strategy: Strategy, *, world: int, coverage: float,
    scheme: str = "spread", seed: int = 0, neuron_groups: int | None = None,
    neuron_kinds: str | None = None, rotate: bool = False,
    costs: Sequence[float] | Sequence[Sequence[float]] | None = None,
    capacities: Sequence[float] | None = None, min_holders: int = 1,
) -> Plan:
    """The plan of ``strategy`` at ``coverage`` (``ddp``: everyone holds every block, so the
    reports of every strategy read one plan shape). ``model`` may be on the meta device.
    ``scheme="balanced"`` balances ``costs`` (per unit, e.g. ``subnet.costs``; default the
    parameter counts) at ``coverage`` or per-rank ``capacities``."""
    if strategy.neuron_level:
        if scheme == "balanced":
            raise ValueError("--scheme balanced is for block units; a layer's neuron groups "
                             "are equal, so spread already balances n-sdp/nb-sdp")
        return make_neuron_plan(model, adapter, world=world, coverage=coverage, scheme=scheme,
                                seed=seed, groups=neuron_groups, kinds=neuron_kinds,
                                rotate=rotate)
    units, shared = describe_units(model, adapter)
    if not strategy.is_sdp:
        return make_plan(world=world, units=units, coverage=1.0, shared_size=shared)
    return make_plan(world=world, units=units, coverage=coverage, scheme=scheme, seed=seed,
                     shared_size=shared, costs=costs, capacities=capacities,
                     min_holders=min_holders)
