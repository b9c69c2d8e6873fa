"""What ``subnetdp plan`` reports of a plan: its diagnostics, per-worker bytes and, given
measured unit costs (``subnet.costs``' ``ModelCosts``, read by duck typing: this floor has
no torch), each rank's share of the full model's cost."""

from __future__ import annotations

from typing import Any

from subnetdp.plan.cost import worker_bytes
from subnetdp.plan.diagnostics import diagnostics
from subnetdp.plan.objectives import parse_balance
from subnetdp.plan.plan import Plan
from subnetdp.plan.schemes import units_for_coverage

# the per-rank cost table's columns (plus any other resource the plan balanced)
COST_COLUMNS = ("params", "flops", "memory", "time")


def plan_report(
    plan: Plan, model: str | None, *, param_bytes: int, optimizer_states: int,
    masking: str = "forward", costs: Any = None, balance: str | None = None,
) -> dict:
    """Everything ``subnetdp plan`` prints, JSON-ready; with ``costs`` (``subnet.costs``
    ``ModelCosts``), the measured unit costs and each rank's share of the full model's."""
    out = diagnostics(plan)
    if costs is not None:
        out["unit_costs"] = costs.to_dict()
        out["per_rank_cost"] = per_rank_cost(plan, costs, balance)
        out["balance"] = balance
    if plan.coverage is not None:
        # Neuron-level units are named "pair[g]" and k applies per layer pair.
        first = plan.units[0].name.partition("[")[0]
        per_layer = [u for u in plan.units if u.name.partition("[")[0] == first]
        n = len(per_layer) if plan.units[0].name.endswith("]") else plan.num_units
        out["k"] = n if plan.coverage >= 1 else units_for_coverage(plan.coverage, n)
        out["units_per_layer"] = n
    out["model"] = model
    out["shared_size"] = plan.shared_size
    # a lost rank's units live on if each has another holder ([Note: rescue], train/rescue.py)
    single = [u for u in range(plan.num_units) if len(plan.holders(u)) == 1]
    out["single_holder_units"] = len(single)
    out["rescuable_ranks"] = [r for r in range(plan.world)
                              if not any(plan.holders(u) == (r,) for u in single)]
    out["unit_names"] = [u.name for u in plan.units]
    out["unit_sizes"] = plan.unit_sizes
    out["bytes_per_worker"] = [
        worker_bytes(
            plan, i, param_bytes=param_bytes, optimizer_states=optimizer_states, masking=masking
        ).to_dict()
        for i in range(plan.world)
    ]
    return out


def per_rank_cost(plan: Plan, costs: Any, balance: str | None) -> list[dict[str, float]]:
    """Per rank: parameters, FLOPs (forward + backward), the cost model's memory (state +
    activations), step time (``subnet.costs``) and what ``balance`` names, each as a fraction
    of the full model's."""
    kinds = list(COST_COLUMNS)
    kinds += [k for k in (parse_balance(balance) if balance else ()) if k not in kinds]
    full = {k: costs.cost(costs.shared, k) + sum(costs.cost(u, k) for u in costs.units)
            for k in kinds}
    return [{k: (costs.cost(costs.shared, k) + sum(costs.cost(costs.units[u], k)
                                                   for u in plan.held_units(i)))
             / (full[k] or 1.0) for k in kinds} for i in range(plan.world)]
