"""The step-time model against the emulated-network benchmark: predicted / measured per row.

    python benchmarks/network_model.py [--measured benchmarks/results/network_measured.json]
        [--out docs/results/network_model.md] [--plot docs/results/network_model.png]

Every row of the measured grid (``subnetdp bench step --link ...``, benchmarks/network.py) is
predicted by ``subnetdp.estimate.steptime.predict_step`` on the cluster the row ran on, built
from the row's own link probe only: β = the measured bandwidth of a large transfer, α = half
the ping-pong round trip; one node with its throttled loopback shared by all ranks, or two
nodes whose loopbacks are unthrottled (the unthrottled campaign's probe) and whose NICs are
the throttled link. The device rate is calibrated once per campaign (one link setting) from a
compute-only quantity: ddp's counted FLOPs per step over ddp's measured compute-only step
(sync off) in that campaign, so the machine's load at the time is in it; no step time is
fitted. Backend gloo (its reduce-scatter is an all-reduce on the wire: ``steptime.WIRE``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

from subnetdp.estimate.cluster import DEVICES, Cluster, Link
from subnetdp.estimate.spec import BenchSpec
from subnetdp.estimate.steptime import predict_step
from subnetdp.models import get_recipe
from subnetdp.subnet.costs import recipe_costs

REPO = Path(__file__).resolve().parents[1]
BAND = 0.15


def spec_of(row: dict[str, Any]) -> BenchSpec:
    return BenchSpec(recipe=row["recipe"], strategy=row["strategy"], world=row["nproc"],
                     batch=row["batch_size"], seq=row["seq_len"],
                     coverage=row["coverage"] or 1.0)


def campaign(row: dict[str, Any]) -> tuple[Any, ...]:
    link = row["link"]
    return (row["nodes"], link["rate_mbit"], link["latency_ms"], row["recipe"],
            row["batch_size"], row["seq_len"], row["nproc"])


def link_of(row: dict[str, Any]) -> Link:
    """β from the large transfer, α = half the ping-pong's round trip."""
    return Link(row["measured_mbit"] * 1e6 / 8, row["rtt_ms"] / 2e3)


def cluster_of(row: dict[str, Any], loopback: Link) -> Cluster:
    cpu = DEVICES["cpu"]
    if row["nodes"] == 1:
        return Cluster(1, row["nproc"], cpu, link_of(row), shared_intra=True)
    return Cluster(row["nodes"], row["nproc"] // row["nodes"], cpu, loopback, link_of(row),
                   shared_intra=True)


def predict(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    by_campaign: dict[tuple[Any, ...], list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        by_campaign[campaign(r)].append(r)
    unthrottled = [r for r in rows if r["link"]["rate_mbit"] is None and r["nodes"] == 1]
    if not unthrottled:
        raise SystemExit("network_model: no unthrottled shared-link row (the loopback of the "
                         "two-tier layout is calibrated from it); measure one")
    loopback = link_of(unthrottled[0])
    costs_cache: dict[tuple[str, int, int], Any] = {}
    out = []
    for key, group in by_campaign.items():
        ddp = next((r for r in group if r["strategy"] == "ddp"), None)
        if ddp is None:
            print(f"network_model: campaign {key} has no ddp row: skipped", file=sys.stderr)
            continue
        ck = (ddp["recipe"], ddp["batch_size"], ddp["seq_len"])
        if ck not in costs_cache:
            costs_cache[ck] = recipe_costs(get_recipe(ck[0]), batch=ck[1], seq=ck[2])
        costs = costs_cache[ck]
        ddp_flops = costs.shared.flops + sum(u.flops for u in costs.units)
        rate = ddp_flops / ddp["compute_s"]
        for r in group:
            p = predict_step(spec_of(r), cluster_of(r, loopback), rate=rate, backend="gloo",
                             costs=costs)
            out.append({**r, "rate_flops": rate, "predicted": p.to_dict(),
                        "ratio": p.step_s / r["step_s_median"],
                        "compute_ratio": p.compute_s / r["compute_s"]})
    return out


def _link_text(r: dict[str, Any]) -> str:
    rate = r["link"]["rate_mbit"]
    tier = "2x2 nodes, " if r["nodes"] > 1 else ""
    return tier + ("unthrottled" if rate is None else f"{rate:g} Mbit/s")


def table(results: list[dict[str, Any]]) -> str:
    lines = ["| link | measured Mbit/s | RTT ms | strategy | measured s | predicted s | "
             "ratio | compute meas. / pred. s | ring MB/rank |",
             "|---|---:|---:|---|---:|---:|---:|---:|---:|"]
    for r in results:
        p = r["predicted"]
        miss = "" if abs(r["ratio"] - 1) <= BAND else " **miss**"
        lines.append(
            f"| {_link_text(r)} | {r['measured_mbit']:.0f} | {r['rtt_ms']:.2f} | "
            f"{r['strategy']} | {r['step_s_median']:.3f} | {p['step_s']:.3f} | "
            f"{r['ratio']:.2f}{miss} | {r['compute_s']:.3f} / {p['compute_s']:.3f} | "
            f"{p['ring_bytes_per_rank'] / 1e6:.1f} |")
    return "\n".join(lines)


def plot(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shared = [r for r in results if r["nodes"] == 1]
    if not shared:
        return
    rate = statistics.median(r["rate_flops"] for r in shared)
    unthrottled = [r for r in shared if r["link"]["rate_mbit"] is None]
    loop = link_of(unthrottled[0]) if unthrottled else Link(2.5e9 / 8)
    mbits = [50 * 1.25**i for i in range(int(round(
        (2 * max(r["measured_mbit"] for r in shared) / 50) ** (1 / 1) and 40)))]
    mbits = [m for m in mbits if m <= 1.2 * max(r["measured_mbit"] for r in shared)]
    fig, ax = plt.subplots(figsize=(8, 5))
    strategies = list(dict.fromkeys(r["strategy"] for r in shared))
    costs = None
    for i, s in enumerate(strategies):
        color = f"C{i % 10}"
        pts = [r for r in shared if r["strategy"] == s]
        ax.scatter([r["measured_mbit"] for r in pts], [r["step_s_median"] for r in pts],
                   color=color, label=f"{s} measured")
        row = pts[0]
        spec = spec_of(row)
        if costs is None:
            costs = recipe_costs(get_recipe(row["recipe"]), batch=row["batch_size"],
                                 seq=row["seq_len"])
        ys = [predict_step(spec, Cluster(1, row["nproc"], DEVICES["cpu"],
                                         Link(m * 1e6 / 8, loop.latency), shared_intra=True),
                           rate=rate, backend="gloo", costs=costs).step_s for m in mbits]
        ax.plot(mbits, ys, color=color, lw=1)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("shared link, measured Mbit/s")
    ax.set_ylabel("step time, s (median)")
    ax.set_title("4 workers on one shared link: measured (points), model (lines; device rate "
                 f"{rate / 1e9:.1f} GFLOP/s, the campaigns' median)", fontsize=9)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--measured", default=str(REPO / "benchmarks/results/network_measured.json"))
    p.add_argument("--out", default=str(REPO / "docs/results/network_model.md"))
    p.add_argument("--plot", default=str(REPO / "docs/results/network_model.png"))
    p.add_argument("--json", default=str(REPO / "benchmarks/results/network_model.json"))
    args = p.parse_args(argv)
    rows = json.loads(Path(args.measured).read_text())
    results = predict(rows)
    Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    plot(results, Path(args.plot))
    misses = sum(abs(r["ratio"] - 1) > BAND for r in results)
    text = table(results)
    Path(args.out + ".table").write_text(text + "\n")
    print(text)
    print(f"{len(results)} rows, {misses} outside ±{BAND:.0%}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
