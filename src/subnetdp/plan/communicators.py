"""How many communicators each rank joins under a plan (``runtime.groups.HolderGroups``).

A rank joins the world group and one group per distinct holder set that contains it, has
at least two ranks and is not the whole world (that one reuses the world group). ZeRO inside
holder groups and FSDP per holder mesh use those same groups; FSDP's one-rank meshes are
not counted (NCCL connects no peers, so allocates no peer buffers, for a one-rank
communicator). On NCCL every communicator costs device memory (``estimate.communicators``).
"""

from __future__ import annotations

from subnetdp.plan.plan import Plan


def communicators_per_rank(plan: Plan) -> list[int]:
    """Per rank: the world group + the multi-rank, non-world holder groups it belongs to."""
    everyone = tuple(range(plan.world))
    groups = [s for s in plan.holder_sets() if len(s) >= 2 and tuple(sorted(s)) != everyone]
    counts = [1] * plan.world
    for s in groups:  # linear in the groups' sizes: a world of thousands has big groups
        for r in s:
            counts[r] += 1
    return counts
