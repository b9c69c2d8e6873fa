"""Communication of one training step, as counted by the run (not derived from the plan).

``comm_record(stats, steps=)`` turns what the reducers counted into bytes per
rank per step, by collective and by process group, as *payload* (the bytes handed to the
collective) and *ring* traffic (what a ring all-reduce sends per rank: 2·(c−1)/c × payload for a
group of c ranks). subnetdp's ``HolderReducer`` counts its buckets (``CommStats``); torch DDP is
counted by ``runtime.rank.TorchDDPRank``'s comm hook (one group: the world). The scalar
all-reduce of gradient clipping (4 bytes) is not counted by either.

No torch import: the counters are read by duck typing, so this stays a side layer.
"""

from __future__ import annotations

import functools
from typing import Any


def group_key(ranks: tuple[int, ...] | list[int]) -> str:
    """A JSON-friendly name for a process group: its ranks, e.g. ``"0,1,2"``."""
    return _key(tuple(ranks))


@functools.lru_cache(maxsize=256)
def _key(ranks: tuple[int, ...]) -> str:
    # the advisor names the same groups of thousands of ranks once per plan row
    return ",".join(map(str, ranks))


def ring_bytes(payload: float, group_size: int) -> float:
    """Bytes one rank sends for a ring all-reduce of ``payload`` bytes over ``group_size``."""
    return 0.0 if group_size < 2 else 2 * (group_size - 1) / group_size * payload


def comm_record(stats: Any, *, steps: int) -> dict[str, Any]:
    """Bytes per step of this rank: ``{"comm/bytes_per_step", "comm/ring_bytes_per_step",
    "by_collective": {...}, "by_group": {"0,1": {"size", "payload", "ring"}}}``.

    ``stats`` is a rank model's ``comm_stats`` (``runtime.reducer.CommStats``: the holder
    reducer's buckets, torch DDP's comm hook, or FSDP's per-step traffic); ``steps`` is the
    number of backward passes it saw (every step reduces the same buckets, so totals divide
    exactly)."""
    steps = max(1, steps)
    groups = {tuple(k): v / steps for k, v in stats.by_group.items()}
    return allreduce_record(groups, collective=stats.collective)


def allreduce_record(
    groups: dict[tuple[int, ...], float], collective: str = "all_reduce"
) -> dict[str, Any]:
    """The record of all-reduces of ``groups[ranks]`` payload bytes per step over each group
    (``comm_record`` from counted bytes, ``estimate.comm`` from the plan). With
    ``collective="fsdp"`` the payload is FSDP's all-gathers and reduce-scatters, of which a
    ring sends (n-1)/n; with ``"reduce_scatter+all_gather"`` (ZeRO in holder groups) the
    payload is the gradient's, reduce-scattered and all-gathered, 2(n-1)/n of it sent."""
    def sent(v: float, n: int) -> float:
        # ZeRO's reduce-scatter + all-gather of the same payload send what the all-reduce does
        whole = collective in ("all_reduce", "reduce_scatter+all_gather")
        return ring_bytes(v, n) if whole else (n - 1) / n * v

    by_group = {
        group_key(k): {"size": len(k), "payload": float(v), "ring": sent(v, len(k))}
        for k, v in sorted(groups.items())
    }
    payload = sum(g["payload"] for g in by_group.values())
    ring = sum(g["ring"] for g in by_group.values())
    return {
        "comm/bytes_per_step": payload,
        "comm/ring_bytes_per_step": ring,
        "by_collective": {collective: {"payload": payload, "ring": ring}} if by_group else {},
        "by_group": by_group,
    }


def comm_summary(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """The run summary's view: the busiest rank's record (it sets the pace) and per-rank totals,
    from the ``"comm"`` entry of each rank's stats (ranks without one are skipped)."""
    records = [(r.get("rank"), r["comm"]) for r in ranks if r.get("comm")]
    if not records:
        return {}
    rank, busiest = max(records, key=lambda x: x[1]["comm/ring_bytes_per_step"])
    return {
        "busiest_rank": rank,
        **busiest,
        "per_rank_bytes_per_step": [c["comm/bytes_per_step"] for _, c in records],
        "per_rank_ring_bytes_per_step": [c["comm/ring_bytes_per_step"] for _, c in records],
    }
