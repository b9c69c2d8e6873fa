"""Plans: which worker holds which unit, and what that costs. Pure data and maths (no torch).

``make_plan`` builds a plan from a scheme (spread, random, cost-balanced), ``explicit_plan``
from a user matrix; ``diagnostics`` scores it (coverage, mask error, spectral gap,
connectivity) and ``worker_bytes`` prices it.
"""

from subnetdp.plan.balance import balanced_matrix, max_ratio
from subnetdp.plan.cost import WorkerBytes, worker_bytes
from subnetdp.plan.diagnostics import (
    diagnostics,
    is_connected,
    mask_error,
    mixing_matrix,
    param_coverage,
    spectral_gap,
    unit_coverage,
)
from subnetdp.plan.plan import Plan, PlanError, Unit, connected_components, explicit_plan
from subnetdp.plan.schemes import (
    can_connect,
    make_layered_plan,
    make_plan,
    min_units_per_worker,
    naive_window,
    random_matrix,
    spread_matrix,
    units_for_coverage,
)

__all__ = [
    "Plan",
    "PlanError",
    "Unit",
    "WorkerBytes",
    "balanced_matrix",
    "can_connect",
    "connected_components",
    "diagnostics",
    "explicit_plan",
    "is_connected",
    "make_layered_plan",
    "make_plan",
    "mask_error",
    "max_ratio",
    "min_units_per_worker",
    "mixing_matrix",
    "naive_window",
    "param_coverage",
    "random_matrix",
    "spectral_gap",
    "spread_matrix",
    "unit_coverage",
    "units_for_coverage",
    "worker_bytes",
]
