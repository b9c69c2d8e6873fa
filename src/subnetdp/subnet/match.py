"""Checking that a plan was made for this model and strategy."""

from __future__ import annotations

from torch import nn

from subnetdp.plan import Plan, PlanError
from subnetdp.strategy import Strategy
from subnetdp.subnet.adapter import UnitAdapter
from subnetdp.subnet.neurons import NeuronGroup, plan_groups, unit_sizes
from subnetdp.subnet.units import describe_units


def match_plan(
    plan: Plan, module: nn.Module, adapter: UnitAdapter, strategy: Strategy
) -> list[NeuronGroup] | None:
    """Raise ``PlanError`` unless ``plan``'s units are this model's units at the strategy's
    level; at neuron level, return the neuron groups its units name (in plan order)."""
    name = type(module).__name__
    groups: list[NeuronGroup] | None = None
    if strategy.splits_layers:
        groups = plan_groups(module, adapter, [u.name for u in plan.units])
        sizes = unit_sizes(module, groups)
    else:
        units, _ = describe_units(module, adapter)
        if len(units) != plan.num_units:
            raise PlanError(
                f"the plan has {plan.num_units} units but {name} declares {len(units)}; build "
                "the plan from this model (make_plan(units=describe_units(...)))"
            )
        sizes = [u.size for u in units]
    plan_sizes = [u.size for u in plan.units]
    # Plans written by hand may give every unit size 1 (counts, not parameters).
    if plan_sizes != sizes and any(s != 1 for s in plan_sizes):
        raise PlanError(
            "the plan's unit sizes do not match the model's parameter counts; "
            "rebuild the plan from this model"
        )
    return groups
