"""Collective schedules: can every rank's sequence of collectives run without a deadlock?

A collective over a group blocks until every member issues it, and the members must issue a
group's collectives in the same order (the k-th call of each member is one collective). So a
set of per-rank sequences runs to completion iff (1) on every group, every member issues the
same collectives in the same order, and (2) the "issued before" relation between those
collectives, taken over all ranks, has no cycle: then one global order exists in which each
rank meets its collectives in its own order. This module derives each rank's sequence for one
training step from a plan and the composition (FSDP2 all-gathers and reduce-scatters with the
chosen prefetch, or the reducer's buckets; the step-end collectives) and checks both
conditions. It is pure (no torch, no processes), so it runs when a model is wrapped and from
``subnetdp plan --check-schedule``.

[Note: FSDP2's issue order]
What FSDP2 (torch 2.13) issues, per FSDP module, on this rank's host thread:
- forward: the root's all-gather first (it stays unsharded until backward); each module's
  pre-forward all-gathers it (nothing if already gathered) and then its forward-prefetch list;
- backward (reverse module order): each pre-backward all-gathers the module when it was
  resharded after forward, then its backward-prefetch targets; its post-backward issues the
  reduce-scatter; the root's reduce-scatter comes last (its inputs need no gradient, so its
  post-backward runs in the final callback). Recomputation under activation checkpointing
  issues nothing new: FSDP2 skips pre-forward during backward.
- prefetch: ``DEFAULT`` is FSDP2's own backward choice, the previous module in *this rank's*
  post-forward order; with per-rank block sets it jumps over the gaps, so ranks meet shared
  groups in different orders (the deadlock we saw). ``ADJACENT`` is our rule: held unit j
  prefetches j-1 in backward and j+1 in forward only when this rank also holds it. ``OFF``
  prefetches nothing.
Groups are keyed by their ranks: units with the same holders share one process group
(``runtime.groups``), so their collectives interleave on it. One-rank groups never wait.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from subnetdp.plan.plan import Plan

OFF, ADJACENT, DEFAULT = "off", "adjacent", "default"
PREFETCH = (OFF, ADJACENT, DEFAULT)


class ScheduleError(ValueError):
    """A schedule that can deadlock or mismatch; the message names the groups and ranks."""


@dataclass(frozen=True)
class Op:
    """One collective as a rank issues it."""

    kind: str  # all_gather | reduce_scatter | all_reduce | refresh
    group: tuple[int, ...]
    what: str  # what it moves, for messages (a unit or bucket name)
    phase: str = ""  # forward | backward | step: a unit is all-gathered in both passes

    def __str__(self) -> str:
        at = f" in {self.phase}" if self.phase else ""
        return f"{self.kind}({self.what}){at} on group {list(self.group)}"


def fsdp_schedule(
    plan: Plan, rank: int, *, prefetch: str = ADJACENT, order: Sequence[int] | None = None,
    reshard_after_forward: bool = True, refresh: bool = False,
    step_end: Sequence[str] = ("grad_norm",),
) -> list[Op]:
    """The collectives ``rank`` issues in one step of SDP + FSDP2 ([Note: FSDP2's issue order]).

    ``order``: the units of this rank's FSDP modules in forward order (default: its held units
    ascending; n-sdp passes its parts, one entry per part, a unit repeated once per layer it
    splits). ``reshard_after_forward=False`` (n-sdp) keeps modules gathered through backward,
    which then issues reduce-scatters only. ``step_end``: world collectives after backward
    (the gradient norm for clipping); ``refresh``: backward masking's point-to-point batch.
    """
    if prefetch not in PREFETCH:
        raise ValueError(f"prefetch must be one of {PREFETCH}, not {prefetch!r}")
    mods = list(order) if order is not None else plan.held_units(rank)
    world = tuple(range(plan.world))
    names = [u.name for u in plan.units]
    held = set(plan.held_units(rank))

    # a unit split across several layers (n-sdp) has one FSDP module per layer: name each by
    # its occurrence, which every holder counts alike
    seen: dict[int, int] = {}
    labels = []
    for u in mods:
        seen[u] = seen.get(u, 0) + 1
        labels.append(names[u] if seen[u] == 1 else f"{names[u]}#{seen[u]}")

    def op(kind: str, i: int, phase: str) -> Op:
        return Op(kind, plan.holders(mods[i]), labels[i], phase)

    def forward_targets(i: int) -> list[int]:
        # forward prefetch is FSDP2's explicit list only (empty by default)
        nxt = i + 1
        if prefetch == ADJACENT and nxt < len(mods) and mods[nxt] == mods[i] + 1 \
                and mods[nxt] in held:
            return [nxt]
        return []

    def backward_targets(i: int) -> list[int]:
        prev = i - 1
        if prev < 0 or prefetch == OFF:
            return []
        if prefetch == DEFAULT or (mods[prev] == mods[i] - 1 and mods[prev] in held):
            return [prev]
        return []

    ops = [Op("all_gather", world, "root", "forward")]
    gathered: set[int] = set()
    for i in range(len(mods)):
        for j in [i, *forward_targets(i)]:
            if j not in gathered:
                ops.append(op("all_gather", j, "forward"))
                gathered.add(j)
        if reshard_after_forward:
            gathered.discard(i)
    for i in reversed(range(len(mods))):
        for j in [i, *backward_targets(i)] if reshard_after_forward else []:
            if j not in gathered:
                ops.append(op("all_gather", j, "backward"))
                gathered.add(j)
        ops.append(op("reduce_scatter", i, "backward"))
        gathered.discard(i)
    ops.append(Op("reduce_scatter", world, "root", "backward"))
    ops += [Op("all_reduce", world, what) for what in step_end]
    if refresh:
        ops.append(Op("refresh", world, "refresh"))
    return ops


def reducer_schedule(
    plan: Plan, rank: int, buckets: Sequence[tuple[tuple[int, ...], str]], *,
    refresh: bool = False, step_end: Sequence[str] = ("grad_norm",),
) -> list[Op]:
    """The collectives ``rank`` issues in one step of the plain SDP runtime: one all-reduce per
    bucket it belongs to, in the global bucket order (``buckets``: holders and a name per
    bucket, as ``runtime.reducer.global_buckets`` lays them out), then the step-end ones."""
    world = tuple(range(plan.world))
    ops = [Op("all_reduce", holders, name) for holders, name in buckets if rank in holders]
    ops += [Op("all_reduce", world, what) for what in step_end]
    if refresh:
        ops.append(Op("refresh", world, "refresh"))
    return ops


def plan_schedules(
    plan: Plan, *, fsdp: bool, keep_gathered: bool = False, backward_masked: bool = False,
    prefetch: str = ADJACENT,
) -> dict[int, list[Op]]:
    """Every rank's collectives for a plan and composition without the model (``subnetdp plan
    --check-schedule``): FSDP modules one per unit in unit order (``keep_gathered``: the
    strategy's ``fsdp_keeps_gathered``, no prefetch); the reducer's buckets one per unit in
    reverse unit order, then the shared parameters (the runtime checks its real modules and
    buckets when it wraps)."""
    if fsdp:
        return {r: fsdp_schedule(plan, r, prefetch=OFF if keep_gathered else prefetch,
                                 reshard_after_forward=not keep_gathered,
                                 refresh=backward_masked) for r in range(plan.world)}
    names = [u.name for u in plan.units]
    buckets = [(plan.holders(u), names[u]) for u in reversed(range(plan.num_units))]
    buckets.append((tuple(range(plan.world)), "shared"))
    return {r: reducer_schedule(plan, r, buckets, refresh=backward_masked)
            for r in range(plan.world)}


def summary(schedules: Mapping[int, Sequence[Op]]) -> str:
    """One line for a schedule that ``check`` accepted."""
    ops = {o for seq in schedules.values() for o in seq if len(o.group) > 1}
    groups = {o.group for o in ops}
    most = max((sum(len(o.group) > 1 for o in seq) for seq in schedules.values()), default=0)
    return (f"schedule: one global order exists ({len(ops)} collectives per step on "
            f"{len(groups)} groups; at most {most} per rank)")


def check(schedules: Mapping[int, Sequence[Op]]) -> None:
    """Raise ``ScheduleError`` unless the per-rank sequences run to completion (module doc).

    Collectives are matched by identity (kind, group, what): when every member of a group
    issues the same ones and the "issued before" graph over all ranks has no cycle, a global
    order exists, and in it each group's collectives come in one order for all its members, so
    matching by position (what a backend does) pairs the same collectives."""
    members: dict[Op, set[int]] = {}
    for rank, ops in schedules.items():
        for o in ops:
            if rank not in o.group:
                raise ScheduleError(f"rank {rank} issues {o}, a group it is not in")
            if o in members.get(o, ()):
                raise ScheduleError(f"rank {rank} issues {o} twice in one step")
            members.setdefault(o, set()).add(rank)
    for o, ranks in members.items():
        missing = [r for r in o.group if r not in ranks]
        if missing:
            raise ScheduleError(f"rank {min(ranks)} issues {o} but rank {missing[0]} never does; "
                                "the group would hang")
    succ: dict[Op, dict[Op, int]] = {}  # edge a -> b: a rank (the first seen) issues a then b
    for rank, ops in schedules.items():
        waits = [o for o in ops if len(o.group) > 1]  # one-rank groups never wait
        for a, b in itertools.pairwise(waits):
            succ.setdefault(a, {}).setdefault(b, rank)
            succ.setdefault(b, {})
    cycle = _find_cycle(succ)
    if cycle is not None:
        cycle = _shortest_cycle(succ, cycle)
        raise ScheduleError(_cycle_message(cycle, succ))


def _cycle_message(cycle: Sequence[Op], succ: Mapping[Op, Mapping[Op, int]]) -> str:
    """Each rank's stretch of the cycle as one chain: "rank 0 issues a, then b; rank 3 ..."."""
    edges = list(zip(cycle, [*cycle[1:], cycle[0]], strict=True))
    chains: list[tuple[int, list[Op]]] = []
    for a, b in edges:
        rank = succ[a][b]
        if chains and chains[-1][0] == rank:
            chains[-1][1].append(b)
        else:
            chains.append((rank, [a, b]))
    groups = [str(list(g)) for g in sorted({o.group for o in cycle})]
    return ("collectives on groups " + " and ".join(groups) + " cannot be ordered "
            "(deadlock): " + "; ".join(f"rank {r} issues " + ", then ".join(map(str, ops))
                                        for r, ops in chains))


def _shortest_cycle(succ: Mapping[Op, Mapping[Op, int]], cycle: list[Op]) -> list[Op]:
    """The shortest cycle through any node of ``cycle`` (BFS from each): a short message."""
    best = cycle
    for start in cycle:
        parent: dict[Op, Op] = {}
        frontier = [start]
        while frontier and start not in parent:
            nxt = []
            for node in frontier:
                for b in succ[node]:
                    if b not in parent:
                        parent[b] = node
                        nxt.append(b)
            frontier = nxt
        if start in parent:
            path = [parent[start]]
            while path[-1] != start:
                path.append(parent[path[-1]])
            path.reverse()
            if len(path) < len(best):
                best = path
    return best


def _find_cycle(succ: Mapping[Op, Mapping[Op, int]]) -> list[Op] | None:
    """A cycle of the graph as a node list, or None (iterative DFS, deterministic order)."""
    state: dict[Op, int] = {}  # 1: on the current path, 2: finished
    for start in succ:
        if start in state:
            continue
        stack = [(start, iter(succ[start]))]
        path = [start]
        state[start] = 1
        while stack:
            node, it = stack[-1]
            nxt = next(it, None)
            if nxt is None:
                state[node] = 2
                stack.pop()
                path.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):]
            elif nxt not in state:
                state[nxt] = 1
                stack.append((nxt, iter(succ[nxt])))
                path.append(nxt)
    return None
