"""Are the neuron-level strategies at their compute bound? Step time of every strategy on the
same workers, synced and compute-only, interleaved so that machine noise hits all alike.

    python benchmarks/neuron_step.py [--nproc 4] [--coverage 0.5] [--steps 10] [--repeats 3]

*Compute-only* is the same step under ``no_sync()`` without clipping: forward, backward and
the optimizer step with no collective (no reduction, no bb/nb-sdp refresh), i.e. what the
step would cost with free communication. Every step, in both modes, starts on a barrier and
is timed to a closing barrier, so it lasts as long as the slowest rank's and a rank's wait for
another's previous step is charged to neither mode. Every repeat times each strategy in both
modes, round-robin with a rotating order; medians over all ranks' steps. Checks the targets
(n-sdp step <= compute-only + 5%, nb-sdp step <= bb-sdp's + 5%). Prints a table and writes
``benchmarks/results/neuron_step.{md,json,png}``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from subnetdp.distributed.launch import launch
from subnetdp.distributed.process_group import init_distributed, shutdown_distributed
from subnetdp.models import get_recipe
from subnetdp.parallelize import parallelize
from subnetdp.strategy import get_strategy
from subnetdp.subnet.planning import plan_for

RESULTS = Path(__file__).parent / "results"
STRATEGIES = ("ddp", "b-sdp", "n-sdp", "bb-sdp", "nb-sdp")
MODES = ("synced", "compute")


def _worker(recipe_name: str, coverage: float, batch: int, seq: int, steps: int,
            warmup: int, repeats: int, foreach: bool | None,
            overrides: dict[str, int]) -> dict[str, Any]:
    rank, world = init_distributed("gloo")
    try:
        recipe = get_recipe(recipe_name)
        ranks, opts = {}, {}
        for name in STRATEGIES:
            with torch.device("meta"):
                meta = recipe.build_model(**overrides)
            plan = None if name == "ddp" else plan_for(
                meta, recipe.adapter, get_strategy(name), world=world, coverage=coverage)
            ranks[name] = parallelize(meta, adapter=recipe.adapter, strategy=name, plan=plan)
            opts[name] = torch.optim.AdamW(ranks[name].parameters(), lr=1e-4, foreach=foreach)
        vocab = get_recipe(recipe_name).defaults["vocab_size"]
        g = torch.Generator().manual_seed(rank)
        flops = {}  # this rank's forward + backward FLOPs (GEMMs, attention), one step each
        x = torch.randint(0, vocab, (batch, seq + 1), generator=g)
        for name, r in ranks.items():
            with r.model.no_sync(), FlopCounterMode(display=False) as counter:
                logits = r.model(x[:, :-1])
                F.cross_entropy(logits.reshape(-1, vocab), x[:, 1:].reshape(-1)).backward()
            flops[name] = counter.get_total_flops()
            opts[name].zero_grad(set_to_none=True)
        times: dict[str, dict[str, list[float]]] = {n: {m: [] for m in MODES} for n in STRATEGIES}
        collectives: dict[str, int] = {}
        jobs = [(n, m) for n in STRATEGIES for m in MODES]
        for step in range(repeats * (warmup + steps)):
            x = torch.randint(0, vocab, (batch, seq + 1), generator=g)
            k = step % len(jobs)
            for name, mode in jobs[k:] + jobs[:k]:
                r, opt = ranks[name], opts[name]
                ctx = r.model.no_sync() if mode == "compute" else nullcontext()
                dist.barrier()  # every rank starts together (lateness is not charged below)
                t0 = time.perf_counter()
                with ctx:
                    logits = r.model(x[:, :-1])
                    F.cross_entropy(logits.reshape(-1, vocab), x[:, 1:].reshape(-1)).backward()
                if mode == "synced":
                    r.clip_grad_norm_(1.0)
                opt.step()
                opt.zero_grad(set_to_none=True)
                dist.barrier()  # a step ends when every rank's has: the slowest rank's time
                if step % (warmup + steps) >= warmup:
                    times[name][mode].append(time.perf_counter() - t0)
                if mode == "synced" and name != "ddp":  # torch DDP's hook counts bytes only
                    collectives[name] = r.comm_stats.last_step_collectives
        return {"rank": rank, "times": times, "collectives": collectives, "flops": flops}
    finally:
        shutdown_distributed()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", default="llama-tiny")
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--coverage", type=float, default=0.5)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--foreach", action="store_true",
                    help="AdamW(foreach=True), as torch picks on GPUs (its CPU default is a loop "
                         "over tensors, which charges nb-sdp's many slices)")
    ap.add_argument("--dim", type=int, help="model width (default: the recipe's)")
    ap.add_argument("--ffn-hidden", type=int, help="FFN width (default: the recipe's)")
    ap.add_argument("--name", default="neuron_step", help="output file stem")
    a = ap.parse_args()
    overrides = {k: v for k, v in (("dim", a.dim), ("ffn_hidden", a.ffn_hidden)) if v}
    load_before = os.getloadavg()[0]
    results = launch(_worker, (a.recipe, a.coverage, a.batch, a.seq, a.steps, a.warmup,
                               a.repeats, a.foreach or None, overrides), nproc=a.nproc,
                     run_id="neuron-step")
    per_rank = [results[r] for r in sorted(results)]
    med = {n: {m: statistics.median(t for r in per_rank for t in r["times"][n][m])
               for m in MODES} for n in STRATEGIES}
    ddp = med["ddp"]["synced"]
    # a synced step waits for the slowest rank: the most FLOPs of any rank
    top = {n: max(r["flops"][n] for r in per_rank) for n in STRATEGIES}
    # ranks that share cores (more workers than cores) wait for all ranks' FLOPs: the mean
    mean = {n: statistics.mean(r["flops"][n] for r in per_rank) for n in STRATEGIES}
    rows = [{"strategy": n, "step_s": med[n]["synced"], "compute_s": med[n]["compute"],
             "step_over_ddp": med[n]["synced"] / ddp, "compute_over_ddp": med[n]["compute"] / ddp,
             "step_over_compute": med[n]["synced"] / med[n]["compute"],
             "flops_over_ddp": top[n] / top["ddp"], "mean_flops_over_ddp": mean[n] / top["ddp"],
             "collectives_per_step": per_rank[0]["collectives"].get(n)} for n in STRATEGIES]
    by = {r["strategy"]: r for r in rows}
    targets = [
        {"target": "n-sdp step / its compute-only step", "value": by["n-sdp"]["step_over_compute"],
         "limit": 1.05},
        {"target": "nb-sdp step / bb-sdp step",
         "value": by["nb-sdp"]["step_s"] / by["bb-sdp"]["step_s"], "limit": 1.05},
    ]
    for t in targets:
        t["met"] = t["value"] <= t["limit"]
    record = {"benchmark": "neuron_step", "recipe": a.recipe, "overrides": overrides,
              "world": a.nproc,
              "coverage": a.coverage, "batch": a.batch, "seq": a.seq, "steps": a.steps,
              "warmup": a.warmup, "repeats": a.repeats, "adamw_foreach": a.foreach,
              "rows": rows, "targets": targets,
              # other work on the machine skews synced steps (ranks wait for the slowest)
              "load_average": [load_before, os.getloadavg()[0]],
              "versions": {"torch": torch.__version__, "python": platform.python_version()}}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{a.name}.json").write_text(json.dumps(record, indent=1))
    lines = [
        f"{a.recipe}{''.join(f' {k}={v}' for k, v in overrides.items())}, {a.nproc} gloo "
        f"workers, C = {a.coverage:g} (SDP), batch {a.batch}x{a.seq}, "
        f"{a.repeats} x {a.steps} steps per mode (after {a.warmup} warm-up each), AdamW"
        f"{'(foreach=True)' if a.foreach else ' (torch default: a loop on CPU)'}, medians over "
        "all ranks; compute = the same step under no_sync() without clipping; FLOPs counted by "
        "torch's FlopCounterMode over one step; load average "
        f"{load_before:.1f} before, {os.getloadavg()[0]:.1f} after",
        "",
        "| strategy | step (s) | compute-only (s) | step / ddp | compute / ddp | "
        "step / compute | FLOPs / ddp: busiest rank | mean over ranks | "
        "collectives / step (rank 0) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        *(f"| {r['strategy']} | {r['step_s']:.4f} | {r['compute_s']:.4f} | "
          f"{r['step_over_ddp']:.3f} | {r['compute_over_ddp']:.3f} | "
          f"{r['step_over_compute']:.3f} | {r['flops_over_ddp']:.3f} | "
          f"{r['mean_flops_over_ddp']:.3f} | "
          f"{r['collectives_per_step'] or '-'} |" for r in rows),
        "",
        "| target | measured | limit | met |",
        "|---|---:|---:|---|",
        *(f"| {t['target']} | {t['value']:.3f} | {t['limit']:.2f} | "
          f"{'yes' if t['met'] else 'no'} |" for t in targets),
    ]
    table = "\n".join(lines)
    (RESULTS / f"{a.name}.md").write_text(table + "\n")
    print(table)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(5, 3))
        xs = range(len(rows))
        ax.bar([x - 0.2 for x in xs], [r["step_over_ddp"] for r in rows], 0.4, label="synced")
        ax.bar([x + 0.2 for x in xs], [r["compute_over_ddp"] for r in rows], 0.4,
               label="compute-only")
        ax.set_xticks(list(xs), [r["strategy"] for r in rows])
        ax.set_ylabel("step time / DDP")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.legend()
        fig.tight_layout()
        fig.savefig(RESULTS / f"{a.name}.png", dpi=120)
    except ImportError:
        print("(matplotlib not installed: no plot)")


if __name__ == "__main__":
    main()
