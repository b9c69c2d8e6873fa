"""Gloo's collectives on a throttled shared link: seconds per byte of all-reduce, all-gather and
reduce-scatter (issue 29, part 5: where the composed path's exposed time goes).

    python benchmarks/network_collectives.py [--link 300mbit] [--nproc 4] [--repeats 5]

Four gloo workers in one emulated shared link (``bench.netem``, root and iproute2). For each
payload P (the size of FSDP's per-block gathers and of a reducer bucket on llama-tiny) every
collective runs ``--repeats`` times after one untimed call, all ranks together; the table gives
the median time and the *wire time* a ring needs on the shared link: every rank's ring bytes
(all-reduce 2(n-1)/n P, all-gather and reduce-scatter (n-1)/n P) cross the one link, so
n x that / the measured rate. Writes benchmarks/results/network_collectives.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

from subnetdp.bench.netem import Layout, Placement, parse_link, run_emulated

OUT = Path(__file__).parent / "results"
SIZES_MB = (0.5, 2.0, 8.0)


def _worker(repeats: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from subnetdp.bench.netem import probe_link
    from subnetdp.distributed.process_group import init_distributed, shutdown_distributed

    _, n = init_distributed("gloo")
    try:
        link = probe_link(0, n - 1, nbytes=8 * 2**20)
        out: dict[str, Any] = {"link": link, "rows": []}
        for mb in SIZES_MB:
            numel = int(mb * 1e6 / 4) // n * n
            full, shard = torch.ones(numel), torch.ones(numel // n)
            calls = {
                "all_reduce": (dist.all_reduce, (full,)),
                "all_gather": (dist.all_gather_into_tensor, (full, shard)),
                "reduce_scatter": (dist.reduce_scatter_tensor, (shard, full)),
            }
            for name, (call, tensors) in calls.items():
                times = []
                for i in range(repeats + 1):
                    dist.barrier()
                    t0 = time.perf_counter()
                    call(*tensors)
                    if i:
                        times.append(time.perf_counter() - t0)
                out["rows"].append({"collective": name, "payload_mb": numel * 4 / 1e6,
                                    "median_s": statistics.median(times)})
        return out
    finally:
        shutdown_distributed()


def _launch(nproc: int, repeats: int, placement: Placement) -> dict[str, Any]:
    from subnetdp.distributed.launch import launch

    return launch(placement.wrap(_worker), (repeats,), nproc=nproc, run_id="netem-coll")[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--link", default="300mbit")
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    layout = Layout(parse_link(args.link))
    # the child and its workers unpickle _launch/_worker by this module's name, not __main__
    here = str(Path(__file__).resolve().parent)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (here, os.environ.get("PYTHONPATH")) if p)
    from network_collectives import _launch as launch_here

    res = run_emulated(layout, args.nproc, launch_here, (args.nproc, args.repeats))
    n, rate = args.nproc, res["link"]["mbit"] * 1e6
    for r in res["rows"]:
        share = 2 * (n - 1) / n if r["collective"] == "all_reduce" else (n - 1) / n
        r["wire_s"] = n * share * r["payload_mb"] * 1e6 * 8 / rate
        r["time_over_wire"] = r["median_s"] / r["wire_s"]
    res.update(link_arg=args.link, nproc=n)
    name = f"network_collectives_{args.link.replace(',', '_')}"
    (OUT / f"{name}.json").write_text(json.dumps(res, indent=1) + "\n")
    lines = [f"Gloo collectives, {n} workers on one shared {args.link} link (measured "
             f"{res['link']['mbit']:.0f} Mbit/s, RTT {res['link']['rtt_ms']:.2f} ms); "
             "`python benchmarks/network_collectives.py --link " + args.link + "`.", "",
             "| collective | payload MB | median s | wire s (ring bytes x n / rate) | "
             "time / wire |", "|---|---|---|---|---|"]
    lines += [f"| {r['collective']} | {r['payload_mb']:.2f} | {r['median_s']:.3f} | "
              f"{r['wire_s']:.3f} | {r['time_over_wire']:.2f} |" for r in res["rows"]]
    (OUT / f"{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
