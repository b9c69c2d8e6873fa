"""Issue 29, part 5: where b-sdp+fsdp's time goes on slow links, with and without the gloo
ring reduce-scatter (``runtime.ring``).

    python benchmarks/network_part5.py [--links 300mbit 100mbit] [--steps 8]

Root and iproute2 (``bench.netem``); 4 gloo workers on one shared throttled link. Per link:

1. *Collectives alone*: all-reduce, all-gather, gloo's reduce-scatter and the ring's, at the
   payloads of FSDP's per-block traffic, each timed against its ring wire time (every rank's
   ring bytes cross the one link: n x (h-1)/h x P, all-reduce twice that, / the measured rate).
2. *Steps*: ``bench step --compute`` of network.py's grid (llama-tiny, batch 4 x 128,
   C = 0.5, 3 warm-up and ``--steps`` timed steps) for ddp, fsdp and b-sdp+fsdp as they run
   now (``runtime.ring.GlooComms``: ring reduce-scatter, async all-gathers), b-sdp+fsdp with
   the ring only (``async_unshard=False``: ``(sync unshard)``) and both FSDP rows with FSDP2's
   gloo defaults (also ``ring_reduce_scatter=False``: ``(gloo rs) (sync unshard)``), all
   interleaved step by step in one run, with a trace of every FSDP collective: seconds per
   step inside all-gather calls (issue, and the wait when blocking) and reduce-scatters
   (always blocking: FSDP2 calls them synchronously).

Writes benchmarks/results/network_part5.{json,md} (links measured earlier and not named by
``--links`` are kept).
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
from subnetdp.estimate.spec import BenchSpec
from subnetdp.filemode import write_atomic

OUT = Path(__file__).parent / "results"
RECIPE, NPROC, BATCH, SEQ, COVERAGE, WARMUP = "llama-tiny", 4, 4, 128, 0.5, 3
SIZES_MB = (0.5, 2.0, 8.0)
REPEATS = 3


def specs() -> list[BenchSpec]:
    base = BenchSpec(RECIPE, "ddp", NPROC, BATCH, SEQ)
    sdp = base.replace(strategy="b-sdp", coverage=COVERAGE, fsdp=True)
    fsdp = base.replace(strategy="fsdp")
    main = {"ring_reduce_scatter": False, "async_unshard": False}  # FSDP2's gloo defaults
    return [base, fsdp, fsdp.replace(**main), sdp, sdp.replace(async_unshard=False),
            sdp.replace(**main)]


# -- 1. collectives alone ---------------------------------------------------------------------

def _collectives_worker() -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from subnetdp import torch_compat
    from subnetdp.bench.netem import probe_link
    from subnetdp.distributed.process_group import init_distributed, shutdown_distributed
    from subnetdp.runtime.ring import ring_reduce_scatter

    _, n = init_distributed("gloo")
    try:
        group = dist.group.WORLD
        assert group is not None
        link = probe_link(0, n - 1, nbytes=8 * 2**20)
        rows = []
        for mb in SIZES_MB:
            numel = int(mb * 1e6 / 4) // n * n
            full, shard = torch.ones(numel), torch.ones(numel // n)
            calls: dict[str, Any] = {
                "all_reduce": lambda full=full: dist.all_reduce(full),
                "all_gather": lambda full=full, shard=shard: torch_compat.all_gather_single(
                    full, shard),
                "reduce_scatter (gloo)": lambda full=full, shard=shard:
                    torch_compat.reduce_scatter_single(output=shard, input=full),
                "reduce_scatter (ring)": lambda full=full, shard=shard:
                    ring_reduce_scatter(shard, full, group),
            }
            for name, call in calls.items():
                times = []
                for i in range(REPEATS + 1):
                    dist.barrier()
                    t0 = time.perf_counter()
                    call()
                    if i:
                        times.append(time.perf_counter() - t0)
                rows.append({"collective": name, "payload_mb": numel * 4 / 1e6,
                             "median_s": statistics.median(times)})
        return {"link": link, "rows": rows}
    finally:
        shutdown_distributed()


def _launch_collectives(placement: Placement) -> dict[str, Any]:
    from subnetdp.distributed.launch import launch

    return launch(placement.wrap(_collectives_worker), (), nproc=NPROC,
                  run_id="part5-coll")[0]


# -- 2. steps with a trace of FSDP's collectives ----------------------------------------------

def _traced(*args: Any) -> dict[str, Any]:
    """``bench.step._launched`` with every FSDP all-gather and reduce-scatter timed, per spec
    label and ``lm_step`` call (warm-up and compute-only steps included; sliced later)."""
    import torch.distributed as dist
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    import subnetdp.bench.step as step
    from subnetdp.runtime import ring

    trace: dict[str, list[dict[str, float]]] = {}
    labels: dict[int, str] = {}
    now: dict[str, float] = {}

    def timed(kind: str, fn: Any) -> Any:
        def call(*a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                now[kind] = now.get(kind, 0.0) + time.perf_counter() - t0
                now[f"n_{kind}"] = now.get(f"n_{kind}", 0) + 1
        return call

    build, lm_step = step.build_rank, step.lm_step

    def build_rank(spec: BenchSpec, **kw: Any) -> Any:
        built = build(spec, **kw)
        labels[id(built)] = spec.label
        return built

    def traced_step(built: Any, tokens: Any, **kw: Any) -> float:
        now.clear()
        t0 = time.perf_counter()
        loss = lm_step(built, tokens, **kw)
        trace.setdefault(labels[id(built)], []).append(
            {"step_s": time.perf_counter() - t0, **now})
        return loss

    step.build_rank, step.lm_step = build_rank, traced_step  # type: ignore[assignment]
    dist.all_gather_single = timed("all_gather", dist.all_gather_single)  # type: ignore
    dist.reduce_scatter_single = timed("reduce_scatter", dist.reduce_scatter_single)  # type: ignore
    ring.ring_reduce_scatter = timed("reduce_scatter", ring.ring_reduce_scatter)
    group = FSDPParamGroup  # waits for an async all-gather (and copies it out)
    group.wait_for_unshard = timed("gather_wait", group.wait_for_unshard)  # type: ignore
    out = step._launched(*args)
    out["trace"] = trace
    return out


def _launch_steps(specs_: list[BenchSpec], steps: int, placement: Placement) -> list[Any]:
    from subnetdp.distributed.launch import launch

    args = (specs_, steps, WARMUP, "cpu", True, placement.probe_pairs(NPROC),
            placement.probe_bytes)
    res = launch(placement.wrap(_traced), args, nproc=NPROC, run_id="part5-steps")
    return [res[r] for r in sorted(res)]


def _trace_summary(per_rank: list[dict[str, Any]], label: str, steps: int) -> dict[str, float]:
    """Median over ranks and timed steps of the seconds inside each kind of collective."""
    timed = [t for r in per_rank for t in r["trace"][label][WARMUP:WARMUP + steps]]
    return {k: statistics.median(t.get(k, 0.0) for t in timed)
            for k in ("all_gather", "gather_wait", "reduce_scatter", "n_all_gather",
                      "n_reduce_scatter")}


# -- the run ----------------------------------------------------------------------------------

def measure(link_text: str, steps: int) -> dict[str, Any]:
    from network_part5 import _launch_collectives as coll_here
    from network_part5 import _launch_steps as steps_here

    from subnetdp.bench.step import summarise

    layout = Layout(parse_link(link_text))
    coll = run_emulated(layout, NPROC, coll_here, ())
    rate = coll["link"]["mbit"] * 1e6
    for r in coll["rows"]:
        share = 2 * (NPROC - 1) / NPROC if r["collective"] == "all_reduce" else (
            (NPROC - 1) / NPROC)
        r["wire_s"] = NPROC * share * r["payload_mb"] * 1e6 * 8 / rate
        r["time_over_wire"] = r["median_s"] / r["wire_s"]
    ss = specs()
    t0 = time.perf_counter()
    per_rank = run_emulated(layout, NPROC, steps_here, (ss, steps))
    summary = summarise(ss, per_rank)
    link = per_rank[0]["links"]["link"]
    rows = []
    for s in ss:
        r = summary["rows"][s.label]
        ring_mb = r["comm"]["comm/ring_bytes_per_step"] / 1e6
        wire = NPROC * ring_mb * 1e6 * 8 / (link["mbit"] * 1e6)
        rows.append({"label": s.label, "step_s": r["median_step_s"],
                     "slowest_rank_s": r["slowest_rank_median_s"],
                     "compute_s": r["compute_step_s"], "exposed_s": r["exposed_comm_s"],
                     "ring_mb_per_rank": ring_mb, "counted_wire_s": wire,
                     "trace": _trace_summary(per_rank, s.label, steps) if s.uses_fsdp else None})
    ddp = rows[0]["step_s"]
    for row in rows:
        row["over_ddp"] = row["step_s"] / ddp
    return {"link_arg": link_text, "collectives": coll, "link": link, "rows": rows,
            "steps": steps, "warmup": WARMUP, "elapsed_s": round(time.perf_counter() - t0, 1),
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "torch": summary["versions"]["torch"]}


def markdown(results: list[dict[str, Any]]) -> str:
    lines = ["Issue 29 part 5: `python benchmarks/network_part5.py` (root; 4 gloo workers on one "
             f"shared throttled link, {RECIPE}, micro-batch {BATCH} x {SEQ}, C = {COVERAGE}, "
             f"{WARMUP} warm-up steps; every row of one link measured in one run, interleaved "
             "step by step).", ""]
    for res in results:
        link = res["link"]
        lines += [f"## {res['link_arg']}: measured {link['mbit']:.0f} Mbit/s, RTT "
                  f"{link['rtt_ms']:.2f} ms, {res['steps']} timed steps ({res['date']})", "",
                  "Collectives alone (4 ranks, median of 3):", "",
                  "| collective | payload MB | median s | ring wire s | time / wire |",
                  "|---|---:|---:|---:|---:|"]
        lines += [f"| {r['collective']} | {r['payload_mb']:.2f} | {r['median_s']:.3f} | "
                  f"{r['wire_s']:.3f} | {r['time_over_wire']:.2f} |"
                  for r in res["collectives"]["rows"]]
        lines += ["", "Steps (medians over ranks and timed steps; *counted wire* = 4 ranks' "
                  "counted ring bytes / measured rate; seconds per step, rank median, inside "
                  "FSDP's all-gather calls (*gather call*: the whole gather when blocking, the "
                  "issue when async), its waits for them (*gather wait*, with the copy-out) "
                  "and its reduce-scatters):", "",
                  "| strategy | step s | / ddp | compute s | exposed s | ring MB/rank | "
                  "counted wire s | gather call s (calls) | gather wait s | reduce-scatter s "
                  "(calls) |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in res["rows"]:
            t = r["trace"]
            tr = (f"{t['all_gather']:.3f} ({t['n_all_gather']:.0f}) | {t['gather_wait']:.3f} | "
                  f"{t['reduce_scatter']:.3f} ({t['n_reduce_scatter']:.0f})") if t else (
                "- | - | -")
            lines.append(f"| {r['label']} | {r['step_s']:.3f} | {r['over_ddp']:.2f} | "
                         f"{r['compute_s']:.3f} | {r['exposed_s']:.3f} | "
                         f"{r['ring_mb_per_rank']:.1f} | {r['counted_wire_s']:.3f} | {tr} |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--links", nargs="+", default=["300mbit", "100mbit"])
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args()
    # the child and its workers unpickle this module's functions by its name, not __main__
    here = str(Path(__file__).resolve().parent)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (here, os.environ.get("PYTHONPATH")) if p)
    path = OUT / "network_part5.json"
    # links measured before and not asked for now are kept
    results = [r for r in (json.loads(path.read_text()) if path.exists() else [])
               if r["link_arg"] not in args.links]
    for text in args.links:
        print(f"run {text}", flush=True)
        results.append(measure(text, args.steps))
        write_atomic(path, json.dumps(results, indent=1) + "\n")
        write_atomic(OUT / "network_part5.md", markdown(results))
    print(markdown(results))


if __name__ == "__main__":
    main()
