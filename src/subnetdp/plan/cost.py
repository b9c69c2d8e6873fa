"""Analytic per-worker cost of a plan: bytes held and bytes all-reduced per step.

These are the numbers the runtime's measured memory and communication are asserted against,
so they count exactly what the holder-averaging reducer sends (docs/method.md §6): shared gradients
over all N workers, each unit's gradient over its holders, and nothing for a unit that only one
worker holds.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from fractions import Fraction

from subnetdp.plan.plan import Plan


@dataclass(frozen=True)
class WorkerBytes:
    """Bytes for one worker.

    ``allreduce_payload`` is the gradient bytes the worker contributes to all-reduces per step;
    ``allreduce_ring`` is what a ring all-reduce actually sends per worker: 2·(c−1)/c times the
    payload of each group of c workers.
    """

    params: int
    grads: int
    optimizer: int
    allreduce_payload: int
    allreduce_ring: int
    # backward masking: parameter bytes sent to / received from other workers by the refresh
    refresh_sent: int = 0
    refresh_received: int = 0

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


def worker_bytes(
    plan: Plan,
    rank: int,
    *,
    param_bytes: int = 4,
    optimizer_states: int = 2,
    masking: str = "forward",
) -> WorkerBytes:
    """Bytes worker ``rank`` holds and communicates.

    ``optimizer_states`` is the number of per-parameter state tensors (AdamW: exp_avg and
    exp_avg_sq = 2; SGD with momentum = 1), each ``param_bytes`` wide. With
    ``masking="backward"`` (bb-sdp, nb-sdp) the worker stores the full model's parameters, but
    gradients and optimizer state only for what it holds, and the refresh moves each unit from
    its owner to every non-holder once per step.
    """
    if masking not in ("forward", "backward"):
        raise ValueError(f"masking must be 'forward' or 'backward', got {masking!r}")
    if not 0 <= rank < plan.world:
        raise IndexError(f"rank {rank} is outside the plan's {plan.world} workers")
    held = plan.held_size(rank) * param_bytes
    # Group sizes -> elements all-reduced in groups of that size.
    groups: dict[int, int] = {}
    if plan.world > 1:
        groups[plan.world] = plan.shared_size
    for u in plan.held_units(rank):
        c = len(plan.holders(u))
        if c >= 2:
            groups[c] = groups.get(c, 0) + plan.units[u].size
    payload = sum(groups.values()) * param_bytes
    # Exact fractions, rounded once at the end, so summing per group never drifts.
    ring = sum((Fraction(2 * (c - 1), c) * n * param_bytes for c, n in groups.items()), Fraction())
    sent = received = 0
    if masking == "backward":
        for u, unit in enumerate(plan.units):
            non_holders = plan.world - len(plan.holders(u))
            if plan.owner(u) == rank:
                sent += unit.size * non_holders * param_bytes
            if not plan.holds(rank, u):
                received += unit.size * param_bytes
    return WorkerBytes(
        params=plan.total_size * param_bytes if masking == "backward" else held,
        grads=held,
        optimizer=optimizer_states * held,
        allreduce_payload=payload,
        allreduce_ring=round(ring),
        refresh_sent=sent,
        refresh_received=received,
    )
