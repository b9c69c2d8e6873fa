"""What a plan costs in gradient quality and mixing (docs/method.md §3, "Diagnostics").

With unit sizes s_u, shared size s_S and total S = s_S + Σ s_u:
- mask error ε = Σ_u s_u (1/c_u − 1/N) / S: the extra gradient-noise factor of averaging over
  c_u holders instead of all N workers. 0 for DDP, (N−1)/N for a disjoint partition.
- spectral gap ρ = 1 − λ₂(W) of the size-weighted mixing matrix W (see ``mixing_matrix``):
  1 for DDP, 0 when the worker graph is disconnected.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from subnetdp.plan.communicators import communicators_per_rank
from subnetdp.plan.plan import Plan, connected_components


def unit_coverage(plan: Plan) -> list[float]:
    """Per worker: the fraction of units it holds."""
    return [len(plan.held_units(i)) / plan.num_units for i in range(plan.world)]


def param_coverage(plan: Plan) -> list[float]:
    """Per worker: the fraction of all parameters (shared included) it holds.

    Units differ in size (ResNet-18's blocks hold 0.7% to 42% of the parameters), so this is the
    number that predicts memory. A model with no parameters at all counts as fully covered.
    """
    total = plan.total_size
    if total == 0:
        return [1.0] * plan.world
    return [plan.held_size(i) / total for i in range(plan.world)]


def _weights(plan: Plan) -> tuple[float, list[float]]:
    """(shared weight, unit weights) normalised to sum 1; equal unit sizes if all are zero."""
    sizes = [float(s) for s in plan.unit_sizes]
    shared = float(plan.shared_size)
    total = shared + sum(sizes)
    if total == 0:
        # A size-less plan (e.g. --units N with sizes 0) still has a shape worth scoring.
        sizes, shared, total = [1.0] * len(sizes), 0.0, float(len(sizes))
    return shared / total, [s / total for s in sizes]


def mask_error(plan: Plan) -> float:
    """ε = Σ_u s_u (1/c_u − 1/N) / S."""
    _, weights = _weights(plan)
    n = plan.world
    counts = plan.holder_counts()
    return float(sum(w * (1.0 / c - 1.0 / n) for w, c in zip(weights, counts, strict=True)))


def mixing_matrix(plan: Plan) -> np.ndarray:
    """W = (s_S·J/N + Σ_u s_u·A_u) / S.

    A_u averages among the holders of u (A_u[i,j] = 1/c_u for holders i, j) and leaves
    non-holders alone (A_u[i,i] = 1). W is symmetric, doubly stochastic and positive
    semidefinite (a convex mix of projections), so its eigenvalues lie in [0, 1].
    """
    n = plan.world
    shared_w, weights = _weights(plan)
    w = np.full((n, n), shared_w / n)
    for u, wu in enumerate(weights):
        holders = list(plan.holders(u))
        others = [i for i in range(n) if not plan.holds(i, u)]
        w[np.ix_(holders, holders)] += wu / len(holders)
        w[others, others] += wu  # diagonal entries of the non-holders
    return w


def spectral_gap(plan: Plan) -> float:
    """ρ = 1 − λ₂(W); 1.0 for a single worker."""
    if plan.world == 1:
        return 1.0
    eig = np.linalg.eigvalsh(mixing_matrix(plan))  # ascending
    gap = 1.0 - float(eig[-2])
    # Round-off can put λ₂ a hair above 1 for a disconnected plan; the gap is never negative.
    return min(1.0, max(0.0, gap))


def is_connected(plan: Plan) -> bool:
    """Whether the graph "workers that share a unit" is connected.

    Shared parameters are deliberately ignored: they mix across all workers anyway, but the
    question here is whether the *units* of two halves of the model ever meet.
    """
    return len(connected_components(plan.matrix)) == 1


def diagnostics(plan: Plan) -> dict[str, Any]:
    """JSON-ready summary of a plan (what ``subnetdp plan`` prints)."""
    return {
        "world": plan.world,
        "num_units": plan.num_units,
        "scheme": plan.scheme,
        "coverage": plan.coverage,
        "seed": plan.seed,
        "assignment": [plan.held_units(i) for i in range(plan.world)],
        "holders": plan.holder_counts(),
        "k_per_worker": [len(plan.held_units(i)) for i in range(plan.world)],
        "unit_coverage": unit_coverage(plan),
        "param_coverage": param_coverage(plan),
        "mask_error": mask_error(plan),
        "spectral_gap": spectral_gap(plan),
        "connected": is_connected(plan),
        "components": len(connected_components(plan.matrix)),
        "holder_sets": len(plan.holder_sets()),
        "communicators": communicators_per_rank(plan),
    }
