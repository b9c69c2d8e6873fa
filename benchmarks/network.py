"""Step time on emulated networks: every strategy, 4 workers, throttled links (issue 29).

    python benchmarks/network.py            # run what is missing (root, iproute2), then report
    python benchmarks/network.py --report   # only regenerate docs/results/network.{md,png}

Each *layout* is one ``subnetdp bench step --link RATE [--nodes 2] --compute`` run
(``bench.step.run_step_bench`` with a ``bench.netem.Layout``): llama-tiny, 4 gloo workers,
micro-batch 4 x 128, C = 0.5, 3 warm-up and 8 timed steps, the strategies interleaved step by
step. Layouts: one shared link unthrottled, 1 Gbit/s, 300 Mbit/s and 100 Mbit/s; two nodes of
two ranks with 1 Gbit/s and 300 Mbit/s between them. Rows (one per strategy and layout) go to
``benchmarks/results/network_measured.json`` as each layout finishes; a layout whose rows are
all there is skipped, so an interrupted campaign resumes. The step-time model's predictions
(``estimate.steptime``) are validated against these rows.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path
from typing import Any

from subnetdp.bench.netem import Layout, Link
from subnetdp.bench.step import run_step_bench
from subnetdp.estimate.advisor import OPTIONS, candidates
from subnetdp.estimate.spec import BenchSpec

ROOT = Path(__file__).resolve().parent.parent
JSON = ROOT / "benchmarks" / "results" / "network_measured.json"
DOC = ROOT / "docs" / "results" / "network.md"
PNG = ROOT / "docs" / "results" / "network.png"
RECIPE, NPROC, BATCH, SEQ, COVERAGE, STEPS, WARMUP = "llama-tiny", 4, 4, 128, 0.5, 8, 3
STRATEGIES = OPTIONS  # every option the advisor ranks (estimate.advisor)
MBIT = 1e6
# the layouts first (shared unthrottled, 1 Gbit/s, 2 x 2 nodes, 100 Mbit/s), so a
# campaign cut short has measured those
LAYOUTS = [Layout(Link(None), 1), Layout(Link(1000 * MBIT), 1), Layout(Link(1000 * MBIT), 2),
           Layout(Link(100 * MBIT), 1), Layout(Link(300 * MBIT), 1),
           Layout(Link(300 * MBIT), 2)]


def spec(name: str) -> BenchSpec:
    """``name`` as the advisor lists it (``ddp+zero1``, ``b-sdp+fsdp+ac``), built as the
    advisor builds it (``estimate.advisor.candidates``), SDP at ``COVERAGE``."""
    base = BenchSpec(RECIPE, "ddp", NPROC, BATCH, SEQ)
    (out,) = candidates(base, (COVERAGE,), (name,))
    return out


def _key(rate_mbit: float | None, nodes: int, strategy: str) -> tuple[Any, ...]:
    return (rate_mbit, nodes, strategy)


def load() -> list[dict[str, Any]]:
    return json.loads(JSON.read_text()) if JSON.exists() else []


def save(rows: list[dict[str, Any]]) -> None:
    tmp = JSON.with_suffix(".tmp")
    tmp.write_text(json.dumps(rows, indent=1) + "\n")
    os.replace(tmp, JSON)


def rows_of(layout: Layout, names: list[str], out: dict[str, Any], elapsed: float,
            load_before: float) -> list[dict[str, Any]]:
    net = out["network"]
    link = net["links"]["link"]
    intra = net["links"].get("intra")
    rows = []
    for name in names:
        s = spec(name)
        r = out["rows"][s.label]
        comm = r["comm"]
        rows.append({
            "strategy": name, "label": s.label, "nproc": NPROC, "nodes": layout.nodes,
            "link": {"rate_mbit": layout.link.rate_mbit, "latency_ms": layout.link.latency_ms,
                     "tier": layout.tier},
            "measured_mbit": link["mbit"], "rtt_ms": link["rtt_ms"],
            **({"intra_measured_mbit": intra["mbit"], "intra_rtt_ms": intra["rtt_ms"]}
               if intra else {}),
            "recipe": RECIPE, "batch_size": BATCH, "seq_len": SEQ,
            "coverage": COVERAGE if s.is_sdp else None,
            "step_s_median": r["median_step_s"], "step_s_slowest_rank": r["slowest_rank_median_s"],
            "compute_s": r["compute_step_s"], "exposed_comm_s": r["exposed_comm_s"],
            "bytes_per_group": {g: v["payload"] for g, v in comm["by_group"].items()},
            "ring_bytes_per_group": {g: v["ring"] for g, v in comm["by_group"].items()},
            "collective": next(iter(comm["by_collective"]), None),
            "ring_bytes_per_rank": comm["comm/ring_bytes_per_step"],
            "payload_bytes_per_rank": comm["comm/bytes_per_step"],
            "per_rank_ring_bytes": [c["comm/ring_bytes_per_step"] for c in r["per_rank_comm"]],
            "steps": STEPS, "warmup": WARMUP,
            "run": {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    "elapsed_s": round(elapsed, 1), "torch": out["versions"]["torch"],
                    "cpus": os.cpu_count(), "machine": platform.machine(),
                    "load_before": load_before, "autogroup": _autogroup()},
        })
    return rows


def measure(layout: Layout, names: list[str]) -> list[dict[str, Any]]:
    """One benchmark run of ``names`` on ``layout``: their rows."""
    load_before = os.getloadavg()[0]
    t0 = time.perf_counter()
    out = run_step_bench([spec(s) for s in names], steps=STEPS, warmup=WARMUP, compute=True,
                         network=layout)
    return rows_of(layout, names, out, time.perf_counter() - t0, load_before)


def campaign() -> None:
    """Per layout, the strategies it has no row of, in one benchmark run (resumable)."""
    have = {_key(r["link"]["rate_mbit"], r["nodes"], r["strategy"]) for r in load()}
    for layout in LAYOUTS:
        names = [s for s in STRATEGIES
                 if _key(layout.link.rate_mbit, layout.nodes, s) not in have]
        if not names:
            print(f"skip {layout.link.label()} x {layout.nodes} node(s): measured", flush=True)
            continue
        print(f"run {layout.link.label()} x {layout.nodes} node(s): {', '.join(names)}",
              flush=True)
        new = measure(layout, names)
        save(load() + new)
        have |= {_key(layout.link.rate_mbit, layout.nodes, s) for s in names}
        print(f"  wrote {len(new)} rows in {new[0]['run']['elapsed_s']:.0f} s", flush=True)


# -- report ---------------------------------------------------------------------------------

def _speed(r: dict[str, Any]) -> str:
    rate = r["link"]["rate_mbit"]
    return "unthrottled" if rate is None else (f"{rate / 1000:g} Gbit/s" if rate >= 1000
                                               else f"{rate:g} Mbit/s")


def _layouts(rows: list[dict[str, Any]]) -> list[tuple[float | None, int]]:
    seen = dict.fromkeys((r["link"]["rate_mbit"], r["nodes"]) for r in rows)
    return sorted(seen, key=lambda k: (k[1], -(k[0] or 1e12)))


def table(rows: list[dict[str, Any]]) -> str:
    out = ["| link | nodes | measured Mbit/s | RTT ms | strategy | step s (median) | slowest "
           "rank s | compute s | exposed comm s | / ddp | ring MB/rank | ring / ddp | wire s "
           "| exposed / wire |", "|" + "---|" * 14]
    for rate, nodes in _layouts(rows):
        group = [r for r in rows if r["link"]["rate_mbit"] == rate and r["nodes"] == nodes]
        ddp = next((r for r in group if r["strategy"] == "ddp"), None)
        for r in sorted(group, key=lambda r: STRATEGIES.index(r["strategy"])):
            out.append(
                f"| {_speed(r)} | {nodes} | {r['measured_mbit']:,.0f} | {r['rtt_ms']:.2f} | "
                f"{r['strategy']} | {r['step_s_median']:.3f} | {r['step_s_slowest_rank']:.3f} | "
                f"{r['compute_s']:.3f} | {r['exposed_comm_s']:.3f} | "
                + (f"{r['step_s_median'] / ddp['step_s_median']:.2f} | " if ddp else "- | ")
                + f"{r['ring_bytes_per_rank'] / 1e6:.1f} | "
                + (f"{r['ring_bytes_per_rank'] / ddp['ring_bytes_per_rank']:.2f} | "
                   if ddp else "- | ") + _wire(r))
    return "\n".join(out)


def _wire(r: dict[str, Any]) -> str:
    """Shared link: every rank's counted ring bytes cross the one link at the measured rate."""
    if r["nodes"] != 1:
        return "- | - |"
    wire = r["nproc"] * r["ring_bytes_per_rank"] * 8 / (r["measured_mbit"] * 1e6)
    return f"{wire:.3f} | {r['exposed_comm_s'] / wire:.2f} |"


def pivot(rows: list[dict[str, Any]]) -> str:
    """Median step per layout and strategy, and the issue's ratios."""
    ratios = (("b-sdp", "ddp"), ("b-sdp+fsdp", "ddp"), ("b-sdp+fsdp", "fsdp"))
    out = ["| link | nodes | " + " | ".join(STRATEGIES) + " | "
           + " | ".join(f"{a} / {b}" for a, b in ratios) + " |",
           "|" + "---|" * (2 + len(STRATEGIES) + len(ratios))]
    for rate, nodes in _layouts(rows):
        step = {r["strategy"]: r["step_s_median"] for r in rows
                if r["link"]["rate_mbit"] == rate and r["nodes"] == nodes}
        first = next(r for r in rows if r["link"]["rate_mbit"] == rate and r["nodes"] == nodes)
        out.append(f"| {_speed(first)} | {nodes} | "
                   + " | ".join(f"{step[s]:.2f}" if s in step else "-" for s in STRATEGIES)
                   + " | " + " | ".join(f"{step[a] / step[b]:.2f}" if a in step and b in step
                                        else "-" for a, b in ratios) + " |")
    return "\n".join(out)


def plot(rows: list[dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for ax, nodes in zip(axes, (1, 2), strict=True):
        for i, name in enumerate(STRATEGIES):
            pts = sorted((r["measured_mbit"], r["step_s_median"]) for r in rows
                          if r["strategy"] == name and r["nodes"] == nodes)
            if pts:
                ax.plot(*zip(*pts, strict=True), "o-", color=f"C{i}", label=name)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("measured link bandwidth (Mbit/s)")
        ax.set_title("one shared link, 4 ranks" if nodes == 1
                     else "2 nodes x 2 ranks, inter-node link")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("median step (s)")
    axes[0].legend(fontsize=8)
    fig.suptitle("llama-tiny, 4 gloo workers, batch 4 x 128, C = 0.5: measured")
    fig.tight_layout()
    fig.savefig(PNG, dpi=110)
    plt.close(fig)


def _autogroup() -> bool | None:
    """Whether the kernel shares the CPU between sessions before nice counts (``nice`` then
    cannot keep other sessions' jobs off the campaign); None where unknown."""
    try:
        return Path("/proc/sys/kernel/sched_autogroup_enabled").read_text().strip() == "1"
    except OSError:
        return None


def _place(r: dict[str, Any]) -> str:
    return f"{_speed(r)} x {r['nodes']}"


def _conditions(rows: list[dict[str, Any]]) -> str:
    """How quiet the machine was, per layout, from what each row recorded."""
    seen: dict[str, str] = {}
    for r in rows:
        run = r["run"]
        if "load_before" not in run:
            seen.setdefault(_place(r), f"not recorded ({run.get('note', 'no note')})")
            continue
        auto = {True: "autogroup on", False: "autogroup off", None: "autogroup unknown"}
        seen.setdefault(_place(r), f"load average {run['load_before']:.1f}, "
                                   f"{auto[run['autogroup']]}")
    parts = "; ".join(f"{k}: {v}" for k, v in seen.items())
    return (f"The campaign runs under `nice -n -15`, which keeps other jobs off it only with the "
            f"kernel's `sched_autogroup` off (on, the CPU is shared between sessions first). "
            f"Load average (1 min, the campaign's previous layout included) before each layout: "
            f"{parts}.")


MEASURED_BEGIN = "<!-- measured: generated by benchmarks/network.py --report -->"
MEASURED_END = "<!-- end measured -->"


def report() -> None:
    """Rewrite the measured section of docs/results/network.md (the rest of the page, e.g.
    the model's section, is kept) and the plot."""
    rows = load()
    if not rows:
        raise SystemExit(f"no rows in {JSON}: run the campaign first")
    plot(rows)
    machine = rows[0]["run"]
    section = "\n".join([
        MEASURED_BEGIN, "", "## Measured", "",
        f"`python benchmarks/network.py` (`make bench-network`): {RECIPE}, {NPROC} gloo "
        f"workers, micro-batch {BATCH} x {SEQ}, C = {COVERAGE}, {WARMUP} warm-up and {STEPS} "
        "timed steps, the strategies interleaved step by step; torch "
        f"{machine['torch']}, {machine['cpus']} CPU cores. {_conditions(rows)} *Step* is "
        "the median over all ranks and timed steps; *compute* the same "
        "steps with communication off (torch's fake process group: the same kernels, no "
        "bytes sent), measured right after in the same workers; *exposed comm* = step - "
        "compute. *Measured Mbit/s* is a 32 MiB gloo send between rank 0 and rank 3 (across "
        "the throttled tier) with the round trip subtracted; *RTT* the median round trip of "
        "one float. A *shared* link (nodes 1) is the loopback of one namespace throttled with "
        "`tbf`: all ranks' traffic, both directions, shares the rate. With 2 nodes each node's "
        "veth is throttled at both ends (the rate per direction per node, full duplex); "
        "ranks of one node talk over their own loopback, unthrottled. Ring bytes are those "
        "the busiest rank sends per step (counted by the reducers).", "",
        "Median step (s) per layout, and the ratios the issue quotes:", "", pivot(rows), "",
        "Every row:", "", table(rows), "", "![step time vs link speed](network.png)", "",
        MEASURED_END])
    text = DOC.read_text() if DOC.exists() else (
        "# Step time on emulated networks\n\n" + MEASURED_BEGIN + "\n" + MEASURED_END + "\n\n"
        "## Model\n\n<!-- model section: estimate.steptime's predictions against the "
        "measured rows (kept by benchmarks/network.py --report) -->\n")
    head, _, rest = text.partition(MEASURED_BEGIN)
    _, _, tail = rest.partition(MEASURED_END)
    DOC.write_text(head + section + tail)
    print(f"wrote {DOC} and {PNG}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--report", action="store_true", help="only regenerate the doc and plot")
    args = ap.parse_args()
    if not args.report:
        campaign()
    report()


if __name__ == "__main__":
    main()
