"""A model's plan: the one builder every caller uses (``train``, ``bench``, ``plan``, the study).

From a plan file (``plan.files.read_plan_file``), or by the ``PlanSpec``'s scheme over the
model's units: block units, or the neuron groups of every layer pair (n-sdp, nb-sdp).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from subnetdp.plan import Plan, make_plan
from subnetdp.plan.files import check_shape, read_plan_file
from subnetdp.plan.nodes import spread_over_nodes
from subnetdp.strategy import PlanSpec, Strategy
from subnetdp.subnet.adapter import UnitAdapter
from subnetdp.subnet.neurons import make_neuron_plan
from subnetdp.subnet.units import describe_units

# balance -> the unit weights a balanced plan balances (e.g. ``subnet.costs``' measured
# costs' ``weights``), called only when a plan needs them
CostsFn = Callable[[str], Sequence[float] | Sequence[Sequence[float]]]


def build_plan(
    model: nn.Module, adapter: UnitAdapter, strategy: Strategy, spec: PlanSpec, *, world: int,
    costs: CostsFn | None = None,
) -> Plan:
    """The plan ``spec`` describes for ``world`` workers (``_scheme_plan``), its holders spread
    over ``spec.nnodes`` nodes when ``spec.spreads_nodes`` ([Note: holders across nodes])."""
    plan = _scheme_plan(model, adapter, strategy, spec, world=world, costs=costs)
    if not spec.spreads_nodes:
        return plan
    return spread_over_nodes(plan, min(spec.nnodes, world))


def _scheme_plan(
    model: nn.Module, adapter: UnitAdapter, strategy: Strategy, spec: PlanSpec, *, world: int,
    costs: CostsFn | None = None,
) -> Plan:
    """The plan ``spec`` describes for ``world`` workers (``ddp``: everyone holds every block,
    so the reports of every strategy read one plan shape). ``model`` may be on the meta
    device. A balanced plan balances ``costs(spec.balance)`` (default, and for
    ``balance="params"``: the parameter counts)."""
    if spec.plan_file is not None:
        units, shared = describe_units(model, adapter)  # a bare matrix's columns
        return read_plan_file(spec.plan_file, units=units, shared_size=shared, world=world)
    if strategy.splits_layers:
        if spec.balanced:
            raise ValueError("--scheme balanced is for block units; a layer's neuron groups "
                             "are equal, so spread already balances n-sdp/nb-sdp")
        return make_neuron_plan(model, adapter, world=world, coverage=spec.coverage,
                                scheme=spec.scheme, seed=spec.seed, groups=spec.neuron_groups,
                                kinds=spec.neuron_kinds, rotate=spec.rotate)
    units, shared = describe_units(model, adapter)
    if not strategy.is_sdp:
        return make_plan(world=world, units=units, coverage=1.0, shared_size=shared)
    weights = None
    if spec.balanced and spec.balance != "params" and costs is not None:
        weights = costs(spec.balance)
    return make_plan(world=world, units=units, coverage=spec.plan_coverage,
                     scheme="balanced" if spec.balanced else spec.scheme, seed=spec.seed,
                     shared_size=shared, costs=weights, capacities=spec.capacities,
                     min_holders=spec.min_holders, max_groups=spec.max_groups)


def plan_for(
    model: nn.Module, adapter: UnitAdapter, strategy: Strategy, *, world: int, coverage: float,
    scheme: str = "spread", seed: int = 0, neuron_groups: int | None = None,
    neuron_kinds: str | None = None, rotate: bool = False,
    costs: Sequence[float] | Sequence[Sequence[float]] | None = None,
    capacities: Sequence[float] | None = None, min_holders: int = 1,
) -> Plan:
    """``build_plan`` with the spec spelled out and the unit costs given as weights (the
    public helper of the tests and benchmarks)."""
    spec = PlanSpec(coverage=coverage, scheme=scheme, seed=seed, neuron_groups=neuron_groups,
                    neuron_kinds=neuron_kinds, rotate=rotate, min_holders=min_holders,
                    capacities=None if capacities is None else tuple(capacities))
    return build_plan(model, adapter, strategy, spec, world=world,
                      costs=None if costs is None else lambda _balance: costs)


def recipe_plan(
    recipe: Any, strategy: Strategy, spec: PlanSpec, *, world: int, costs: CostsFn | None = None,
) -> Plan:
    """``build_plan`` over a recipe's model (``models.registry.Recipe``), built on the meta
    device: nothing allocated."""
    with torch.device("meta"):
        model = recipe.build_model()
    return build_plan(model, recipe.adapter, strategy, spec, world=world, costs=costs)


def file_plan(path: str, recipe: Any, *, units: int | None = None,
              world: int | None = None) -> Plan:
    """A plan file (``plan.files.read_plan_file``): a bare matrix over ``recipe``'s units (its
    model built on the meta device), or a saved plan; refused if ``units`` or ``world``
    disagree with it (``plan.files.check_shape``)."""
    with torch.device("meta"):
        unit_list, shared = describe_units(recipe.build_model(), recipe.adapter)
    return check_shape(read_plan_file(path, units=unit_list, shared_size=shared),
                       units=units, world=world)
