"""Gloo's collectives on an emulated network, each against the step-time model's prediction for
the same call (issue 29, part 5; issue 45: the two-tier layout).

    python benchmarks/network_collectives.py [--link 300mbit] [--nodes 1] [--nproc 4]
        [--repeats 5] [--sizes 0.5,2,8]

``--nproc`` gloo workers in one emulated layout (``bench.netem``, root and iproute2): one shared
link (``--nodes 1``) or ``--nodes`` nodes whose NICs are the link. After a link probe (the
benchmark's: a bulk send and a ping-pong across the link, and within a node), every case runs
``--repeats`` times after one untimed call, all ranks together, each after a barrier and a
50 ms pause (the token bucket refills): single all-reduces, all-gathers and reduce-scatters
(gloo's, and ``runtime.ring``'s ring that FSDP uses) of each size; with two nodes also a bulk
send across the link one way and both ways at once, a DDP-like sequence of asynchronous bucket
all-reduces, and FSDP-like sequences of blocking calls separated by sleeps (the compute
between FSDP modules); on every layout DDP's buckets right after a fixed compute on every
rank (timed from each rank's end of it: a step's exposed communication), the first bucket
issued after or before it. "predicted" is ``steptime._phase_time`` on the cluster
``benchmarks/network_model.py`` builds from the same probe; for sequences the sleeps are taken
out of the measured time. Writes benchmarks/results/network_collectives_<layout>.{json,md}
(``--report FILE.json``: predicts and writes an earlier record again, measuring nothing).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from subnetdp.bench.netem import TBF_BURST, Layout, Placement, parse_link, run_emulated

OUT = Path(__file__).parent / "results"
PAUSE_S = 0.05  # before each timed call: tbf's 512 KiB bucket refills in <= 42 ms at 100 Mbit
DDP_BUCKETS_MB = (1.0, 9.6)  # llama-tiny ddp's buckets: torch's 1 MiB first, then the rest
FSDP_CALLS, FSDP_MB, FSDP_GAP_S = 14, 0.75, 0.01  # blocking calls per sequence, size, compute
# two-rank groups of 2 x 2 nodes at once (SDP's holder groups): across the link, within nodes
CROSS_PAIRS, NODE_PAIRS = ((0, 3), (1, 2)), ((0, 1), (2, 3))
WORK = 24  # 512 x 512 matmuls per rank before a case's calls (about 0.2 s, 4 ranks, 2 cores)


def _cases(n: int, sizes: tuple[float, ...], two_tier: bool) -> list[dict[str, Any]]:
    """What to time: per case its label and calls ``(kind, MB)`` in order (``async``: all
    issued, then waited; else one after the other with ``gap_s`` of sleep before each)."""
    out = [{"label": f"{kind} {mb:g} MB", "calls": [(kind, mb)]}
           for mb in sizes for kind in ("all_reduce", "all_gather", "reduce_scatter",
                                        "ring_reduce_scatter")]
    # latency (one float per rank) and the token bucket (a send after the pause: within the bucket,
    # 512 KiB, it passes at once if the bucket does)
    out += [{"label": f"{kind} 16 bytes", "calls": [(kind, 4e-6 * 4)]}
            for kind in ("all_reduce", "all_gather")]
    out += [{"label": f"send {mb:g} MB, one way", "calls": [("send", mb)]}
            for mb in (0.25, 0.5, 1.0, 2.0)]
    if two_tier:
        out += [{"label": "send across, one way", "calls": [("send", sizes[-1])]},
                {"label": "send across, both ways", "calls": [("send_both", sizes[-1])]},
                {"label": "send across, both ways, two pairs",
                 "calls": [("send_two", sizes[-1])]}]
        out += [{"label": f"{kind} {mb:g} MB in {CROSS_PAIRS[0]} and {CROSS_PAIRS[1]}",
                 "calls": [(kind, mb, CROSS_PAIRS)]}
                for mb in (1.6, sizes[-1]) for kind in ("all_reduce", "all_gather",
                                                        "ring_reduce_scatter")]
        out += [{"label": f"{kind} {mb:g} MB in {NODE_PAIRS[0]} and {NODE_PAIRS[1]}",
                 "calls": [(kind, mb, NODE_PAIRS)]} for mb in (1.6,) for kind in ("all_reduce",)]
        out += [{"label": "ddp buckets, async", "calls": [("all_reduce", mb)
                                                          for mb in DDP_BUCKETS_MB],
                 "async": True},
                {"label": f"{FSDP_CALLS} x all_gather, {FSDP_GAP_S * 1e3:g} ms apart",
                 "calls": [("all_gather", FSDP_MB)] * FSDP_CALLS, "gap_s": FSDP_GAP_S},
                {"label": f"{FSDP_CALLS} x (all_gather + ring_reduce_scatter), "
                          f"{FSDP_GAP_S * 1e3:g} ms apart",
                 "calls": [("all_gather", FSDP_MB), ("ring_reduce_scatter", FSDP_MB)]
                 * FSDP_CALLS, "gap_s": FSDP_GAP_S, "gap_every": 2}]
    # after compute on every rank (WORK matmuls: the ranks share the cores), timed from
    # each rank's end of compute: what a step's exposed communication is
    ddp = [("all_reduce", mb) for mb in DDP_BUCKETS_MB]
    out += [{"label": f"16 bytes all_reduce after {WORK} matmuls",
             "calls": [("all_reduce", 1.6e-5)], "work": WORK},
            {"label": f"ddp buckets after {WORK} matmuls", "calls": ddp, "async": True,
             "work": WORK},
            {"label": f"ddp buckets, the first before {WORK} matmuls", "calls": ddp,
             "async": True, "work": WORK, "first_before": True}]
    return out


def _call(kind: str, mb: float, n: int, rank: int,
          groups: tuple[tuple[int, ...], ...] | None = None) -> Callable[[], Any]:
    """One collective of ``mb`` MB (the full tensor), ready to issue (returns its work);
    ``groups``: disjoint rank groups that each run it at once (None: the world)."""
    import torch
    import torch.distributed as dist

    from subnetdp.runtime.ring import ring_reduce_scatter

    # every rank creates every group (torch requires it), in the same order
    pgs = {g: dist.new_group(list(g)) for g in groups or ()}
    mine = next((g for g in pgs if rank in g), None)
    h = n if groups is None else len(mine or (0,))
    group = pgs[mine] if mine else None
    numel = int(mb * 1e6 / 4) // h * h
    full, shard = torch.ones(numel), torch.ones(numel // h)
    if (groups is not None and mine is None) or kind.startswith("send"):
        return _send(kind, full, n, rank) if kind.startswith("send") else lambda: None
    if kind == "all_reduce":
        return lambda: dist.all_reduce(full, group=group, async_op=True)
    if kind == "all_gather":
        return lambda: dist.all_gather_into_tensor(full, shard, group=group, async_op=True)
    if kind == "reduce_scatter":
        return lambda: dist.reduce_scatter_tensor(shard, full, group=group, async_op=True)
    return lambda: ring_reduce_scatter(shard, full, group or dist.group.WORLD)


def send_pairs(kind: str, n: int) -> list[tuple[int, int]]:
    """(source, destination) of the bulk sends of ``kind``: across the link between ranks 0
    and n-1 one way, both ways, or both ways on two rank pairs (0 to n-1, n-2 to 1)."""
    return {"send": [(0, n - 1)], "send_both": [(0, n - 1), (n - 1, 0)],
            "send_two": [(0, n - 1), (n - 2, 1)]}[kind]


def _send(kind: str, full: Any, n: int, rank: int) -> Callable[[], Any]:
    import torch
    import torch.distributed as dist

    pairs = send_pairs(kind, n)
    ops = [dist.P2POp(dist.isend, full, d) for s, d in pairs if s == rank]
    ops += [dist.P2POp(dist.irecv, torch.empty_like(full), s) for s, d in pairs if d == rank]

    def run() -> None:
        for w in dist.batch_isend_irecv(ops) if ops else ():
            w.wait()

    return run


def _time_case(case: dict[str, Any], n: int, rank: int, repeats: int) -> float:
    import torch
    import torch.distributed as dist

    calls = [_call(*c[:2], n, rank, *c[2:]) for c in case["calls"]]
    gap, every = case.get("gap_s", 0.0), case.get("gap_every", 1)
    a = torch.ones(512, 512)
    times = []
    for i in range(repeats + 1):
        dist.barrier()
        time.sleep(PAUSE_S)
        works = [calls[0]()] if case.get("first_before") else []
        for _ in range(case.get("work", 0)):  # compute, fixed work per rank (backward's)
            torch.mm(a, a)
        t0 = time.perf_counter()  # from this rank's end of compute
        for j, call in enumerate(calls[len(works):], len(works)):
            if gap and j % every == 0:
                time.sleep(gap)
            w = call()
            if case.get("async"):
                works.append(w)
            elif w is not None:
                w.wait()
        for w in works:
            w.wait()
        if i:
            times.append(time.perf_counter() - t0)
    slowest = torch.tensor(times, dtype=torch.float64)  # per repeat, the slowest rank's
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return statistics.median(slowest.tolist())


def _worker(repeats: int, sizes: tuple[float, ...], two_tier: bool) -> dict[str, Any]:
    from subnetdp.bench.netem import probe_link
    from subnetdp.distributed.process_group import init_distributed, shutdown_distributed

    rank, n = init_distributed("gloo")
    try:
        out: dict[str, Any] = {"link": probe_link(0, n - 1, nbytes=8 * 2**20), "rows": []}
        if two_tier:
            out["intra"] = probe_link(0, 1, nbytes=32 * 2**20)
        for case in _cases(n, sizes, two_tier):
            out["rows"].append({**case, "median_s": _time_case(case, n, rank, repeats)})
        return out
    finally:
        shutdown_distributed()


def _launch(nproc: int, repeats: int, sizes: tuple[float, ...],
            placement: Placement) -> dict[str, Any]:
    from subnetdp.distributed.launch import launch

    two_tier = len(placement.namespaces) > 1
    return launch(placement.wrap(_worker), (repeats, sizes, two_tier), nproc=nproc,
                  run_id="netem-coll")[0]


def predict(res: dict[str, Any], nodes: int, n: int) -> None:
    """Each row's ``predicted_s``: the model's time for its calls on the probed cluster
    (``benchmarks/network_model.py``'s ``cluster_of``: β the bulk send's rate, α half the
    ping-pong, tbf's bucket; within a node the intra probe's loopback)."""
    from subnetdp.estimate.cluster import DEVICES, Cluster, Link
    from subnetdp.estimate.steptime import (
        RING_REDUCE_SCATTER_WIRE,
        WIRE,
        Collective,
        _phase_time,
    )

    def link(probe: dict[str, float], burst: float) -> Link:
        return Link(probe["mbit"] * 1e6 / 8, probe["rtt_ms"] / 2e3, burst)

    across = link(res["link"], TBF_BURST)
    cluster = (Cluster(1, n, DEVICES["cpu"], across, shared_intra=True) if nodes == 1 else
               Cluster(nodes, n // nodes, DEVICES["cpu"], link(res["intra"], 0.0), across,
                       shared_intra=True))
    world = tuple(range(n))
    for r in res["rows"]:
        per_rank: list[list[Collective]] = [[] for _ in range(n)]
        for kind, mb, *groups in r["calls"]:
            if kind.startswith("send"):
                for s, d in send_pairs(kind, n):
                    per_rank[s].append(Collective("send", (s, d), int(mb * 1e6 / 4) * 4.0,
                                                  1, "after"))
                continue
            model_kind = "reduce_scatter" if kind == "ring_reduce_scatter" else kind
            for g in (groups[0] if groups else [world]):
                g = tuple(g)
                for rank in g:
                    per_rank[rank].append(Collective(
                        model_kind, g, int(mb * 1e6 / 4) // len(g) * len(g) * 4.0, 1,
                        "backward"))
        # gloo's reduce-scatter is an all-reduce on the wire; runtime.ring's is the ring
        ring = any(c[0] == "ring_reduce_scatter" for c in r["calls"])
        wire = {**WIRE["gloo"], "reduce_scatter": RING_REDUCE_SCATTER_WIRE} if ring else \
            WIRE["gloo"]
        gaps = 1 if not r.get("gap_s") else len(r["calls"]) // r.get("gap_every", 1)
        gap_s = r.get("gap_s") or PAUSE_S
        r["sleep_s"] = (r.get("gap_s") or 0.0) * (len(r["calls"]) // r.get("gap_every", 1))
        r["predicted_s"] = _phase_time(cluster, per_rank, wire, gaps=gaps, gap_s=gap_s)
        r["measured_over_predicted"] = (r["median_s"] - r["sleep_s"]) / r["predicted_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--link", default="300mbit")
    ap.add_argument("--nodes", type=int, default=1)
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--sizes", default="0.5,2,8", help="payloads in MB, comma-separated")
    ap.add_argument("--report", metavar="FILE.json",
                    help="measure nothing: predict and write this earlier record again")
    args = ap.parse_args()
    if args.report:
        report(json.loads(Path(args.report).read_text()))
        return
    sizes = tuple(float(s) for s in args.sizes.split(","))
    layout = Layout(parse_link(args.link), args.nodes)
    # the child and its workers unpickle _launch/_worker by this module's name, not __main__
    here = str(Path(__file__).resolve().parent)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (here, os.environ.get("PYTHONPATH")) if p)
    from network_collectives import _launch as launch_here

    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    res = run_emulated(layout, args.nproc, launch_here, (args.nproc, args.repeats, sizes))
    res.update(link_arg=args.link, nodes=args.nodes, nproc=args.nproc, uptime=load,
               sizes_arg=args.sizes)
    report(res)


def report(res: dict[str, Any]) -> None:
    """Predict ``res``'s rows and write its json and md (``--report FILE.json``: again, from
    a measured record)."""
    n, nodes, link_arg = res["nproc"], res["nodes"], res["link_arg"]
    predict(res, nodes, n)
    tier = "one shared" if nodes == 1 else f"{nodes} nodes x {n // nodes}, a"
    name = f"network_collectives_{'' if nodes == 1 else f'{nodes}n_'}" \
        f"{link_arg.replace(',', '_')}"
    (OUT / f"{name}.json").write_text(json.dumps(res, indent=1) + "\n")
    intra = (f", within a node {res['intra']['mbit']:.0f} Mbit/s, RTT "
             f"{res['intra']['rtt_ms']:.2f} ms" if "intra" in res else "")
    lines = [f"Gloo collectives, {n} workers, {tier} {link_arg} link (measured "
             f"{res['link']['mbit']:.0f} Mbit/s, RTT {res['link']['rtt_ms']:.2f} ms{intra}); "
             f"`python benchmarks/network_collectives.py --link {link_arg} --nodes "
             f"{nodes} --sizes {res['sizes_arg']}`; `uptime` before: {res['uptime']}.", "",
             "| case | median s | sleeps s | model s (steptime) | (median - sleeps) / model |",
             "|---|---:|---:|---:|---:|"]
    lines += [f"| {r['label']} | {r['median_s']:.3f} | {r['sleep_s']:.3f} | "
              f"{r['predicted_s']:.3f} | {r['measured_over_predicted']:.2f} |"
              for r in res["rows"]]
    (OUT / f"{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
