"""Failure domains: which node each rank runs on, plans whose holders span nodes, and what the
loss of one node would take. Pure: no torch, no environment.

[Note: holders across nodes]
A node's ranks fail together (power, NIC, kernel). With ``--min-holders 2`` both holders of a
unit may sit on one node, and that node's loss takes the unit with it: rescue ([Note: rescue]
in train/rescue.py) then falls back to the newest checkpoint. ``spread_over_nodes`` gives
each rank a row of the scheme's plan such that every unit with two or more holders has them
on two or more nodes, where a relabelling of the rows can: it only permutes the rows (rank
``r`` takes row ``perm[r]``), so every row, and with it each rank's load, the holder graph's
shape (connectivity, spectral gap, mask error) and every holder count, is the scheme's own.
A plan already spread stays as it is. Else the first try interleaves the nodes (consecutive
rows, which share the most units in a spread plan, go to different nodes: NVIDIA resiliency's
``replication_jump``); then swaps of two ranks on different nodes, in a fixed order, while one
lowers the number of units held on one node only. Deterministic: every rank computes the
same plan. Per-rank capacities that differ size each row for its rank: such a plan is not
relabelled.

Ranks sit on nodes in contiguous blocks, as torchrun numbers them (``GROUP_RANK *
LOCAL_WORLD_SIZE + LOCAL_RANK``) and as the built-in launcher's ``--nnodes`` and
``bench/netem.py``'s ``--nodes`` emulate them: ``node_of``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from subnetdp.plan.plan import Plan, PlanError

__all__ = ["NodeLoss", "blast_radius", "check_nnodes", "confined_units", "node_of",
           "node_ranks", "node_report", "spread_over_nodes"]


def check_nnodes(nnodes: int, world: int) -> None:
    if not 1 <= nnodes <= world:
        raise PlanError(f"--nnodes must be between 1 and the number of workers ({world}), got "
                        f"{nnodes}")


def node_of(rank: int, world: int, nnodes: int) -> int:
    """The node of ``rank`` among ``world`` ranks on ``nnodes`` nodes: contiguous blocks, as
    equal as integers allow (``world // nnodes`` each when that divides)."""
    return rank * nnodes // world


def node_ranks(world: int, nnodes: int) -> list[list[int]]:
    """Each node's ranks."""
    out: list[list[int]] = [[] for _ in range(nnodes)]
    for r in range(world):
        out[node_of(r, world, nnodes)].append(r)
    return out


def confined_units(plan: Plan, nnodes: int) -> list[int]:
    """Units with two or more holders, all on one node (one node's loss takes them)."""
    return [int(u) for u in np.flatnonzero(_confined(np.array(plan.matrix, dtype=bool),
                                                      _onehot(plan.world, nnodes)))]


def _onehot(world: int, nnodes: int) -> np.ndarray:
    hot = np.zeros((world, nnodes), dtype=np.int64)
    hot[np.arange(world), [node_of(r, world, nnodes) for r in range(world)]] = 1
    return hot


def _confined(matrix: np.ndarray, hot: np.ndarray) -> np.ndarray:
    per_node = matrix.T.astype(np.int64) @ hot  # [unit][node]: holders there
    return (per_node.sum(axis=1) >= 2) & ((per_node > 0).sum(axis=1) == 1)


def spread_over_nodes(plan: Plan, nnodes: int) -> Plan:
    """``plan`` with its rows relabelled so that each unit's holders span two or more nodes
    where they can ([Note: holders across nodes]); the plan itself on one node."""
    check_nnodes(nnodes, plan.world)
    if nnodes == 1:
        return plan
    world = plan.world
    rows = np.array(plan.matrix, dtype=bool)
    hot = _onehot(world, nnodes)
    start = int(_confined(rows, hot).sum())
    if start == 0:  # already spread: the scheme's own plan
        return plan
    # interleaved: the j-th rank of the order n0, n1, ..., n0, n1, ... takes row j
    blocks = node_ranks(world, nnodes)
    order = [b[i] for i in range(max(map(len, blocks))) for b in blocks if i < len(b)]
    perm = np.empty(world, dtype=np.int64)
    perm[order] = np.arange(world)
    best = int(_confined(rows[perm], hot).sum())
    node = hot.argmax(axis=1)
    improved = best > 0
    while improved:
        improved = False
        for a in range(world):
            for b in range(a + 1, world):
                if node[a] == node[b]:
                    continue
                trial = perm.copy()
                trial[a], trial[b] = perm[b], perm[a]
                score = int(_confined(rows[trial], hot).sum())
                if score < best:
                    perm, best, improved = trial, score, True
    return _relabelled(plan, perm) if best < start else plan


def _relabelled(plan: Plan, perm: Sequence[int] | np.ndarray) -> Plan:
    return Plan(world=plan.world, units=plan.units, shared_size=plan.shared_size,
                matrix=tuple(plan.matrix[int(p)] for p in perm), scheme=plan.scheme,
                coverage=plan.coverage, seed=plan.seed)


@dataclass(frozen=True)
class NodeLoss:
    """What losing node ``node`` (its ``ranks``) takes: the units only it holds."""

    node: int
    ranks: tuple[int, ...]
    lost_units: tuple[int, ...]


def blast_radius(plan: Plan, nnodes: int) -> list[NodeLoss]:
    """Per node, the units whose every holder is on it."""
    check_nnodes(nnodes, plan.world)
    out = []
    for k, ranks in enumerate(node_ranks(plan.world, nnodes)):
        on = set(ranks)
        lost = tuple(u for u in range(plan.num_units) if set(plan.holders(u)) <= on)
        out.append(NodeLoss(k, tuple(ranks), lost))
    return out


def node_report(plan: Plan, nnodes: int, min_nproc: int | None) -> list[dict[str, object]]:
    """Per node: its ranks, the units its loss takes, and why the run would roll back to its
    newest checkpoint (None: the survivors' copies rescue the step in flight, as
    ``train --min-nproc`` does it; [Note: rescue] in train/rescue.py). ``min_nproc``: the
    elastic run's (None: not elastic)."""
    out: list[dict[str, object]] = []
    for loss in blast_radius(plan, nnodes):
        left = plan.world - len(loss.ranks)
        why = None
        if loss.lost_units:
            why = "every holder of those units is on it"
        elif left < 1:
            why = "no worker survives"
        elif min_nproc is None:
            why = f"only an elastic run (--min-nproc {left} or fewer) goes on"
        elif left < min_nproc:
            why = f"{left} survivors are fewer than --min-nproc {min_nproc}"
        out.append({"node": loss.node, "ranks": list(loss.ranks),
                    "lost_units": list(loss.lost_units), "survivors": left, "rollback": why})
    return out
