"""Spread vs balanced plans: per-rank cost at paper scale and short CPU training runs.

    OMP_NUM_THREADS=1 python benchmarks/balanced.py [--steps 30] [--skip-runs] [--no-estimate]

Paper scale (8 workers, C = 0.5 and 0.69, and a 2:1:1:1 heterogeneous example on 4): each
rank's parameters, FLOPs and memory (parameters, gradients, AdamW state, saved activations)
from the unit costs measured on meta tensors (``subnet.costs``), max / mean over ranks, and
each rank's peak from the fake-tensor estimator (``bench.estimate``; image batch 128, llama-1b
1 x 2048, fp32, AdamW). Heterogeneous: budgets in ratio 2:1:1:1 of the full model's estimated
peak turned into a plan by ``bench.hetero.plan_for_budgets`` (every rank estimator-checked).
CPU runs: resnet18-fmnist (width 8) and swin-t-fmnist (embed_dim 24), 4 gloo workers, same
seed, spread vs balanced: (a) ``subnetdp train`` runs: synced step time per rank and validation
loss; (b) per-rank *compute* time, forward + backward of the rank's own subnetwork with gradient
sync off (``no_sync``), so no rank waits for another: straggler = slowest rank's median compute /
mean of the ranks' medians; (c) a 2:1:1:1 plan trained on resnet18-fmnist.
Writes benchmarks/results/balanced.{md,json} and balanced.png.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from subnetdp.bench.estimate import estimate_memory
from subnetdp.bench.hetero import plan_for_budgets
from subnetdp.bench.strategies import BenchSpec
from subnetdp.models import get_recipe
from subnetdp.plan import Unit, diagnostics, make_plan
from subnetdp.subnet.costs import ModelCosts, recipe_costs

OUT = Path(__file__).parent / "results"
PAPER = [("resnet18-cifar10", None), ("wrn18-cifar10", None), ("swin-t-cifar10", None),
         ("llama-1b", 2048)]
RUNS = [("resnet18-fmnist", {"width": 8}), ("swin-t-fmnist", {"embed_dim": 24})]
# (scheme, what balanced balances) compared in every case
SCHEMES = [("spread", "params"), ("balanced", "params"), ("balanced", "flops")]
GB = 1e9
WARMUP = 3  # compute-time steps not timed (allocation, first-step reducer set-up)


def _shares(plan: Any, costs: ModelCosts) -> dict[str, list[float]]:
    kinds = {"params": lambda c: c.params, "flops": lambda c: c.flops,
             "memory": lambda c: c.memory_bytes()}
    return {k: [f(costs.shared) + sum(f(costs.units[u]) for u in plan.held_units(i))
                for i in range(plan.world)] for k, f in kinds.items()}


def _spec(name: str, seq: int | None, world: int, **kw: Any) -> BenchSpec:
    return BenchSpec(recipe=name, strategy="b-sdp", world=world, batch=1 if seq else 128,
                     seq=seq or 2, **kw)


def paper_scale(estimate: bool) -> list[dict[str, Any]]:
    rows = []
    for name, seq in PAPER:
        costs = recipe_costs(get_recipe(name), batch=1 if seq else 128, seq=seq)
        units = [Unit(u.name, u.params) for u in costs.units]
        full = costs.shared.params + sum(u.size for u in units)
        done: dict[Any, list[int]] = {}  # plan matrix -> per-rank estimated peaks
        for cov in (0.5, 0.69):
            for scheme, balance in SCHEMES:
                t0 = time.perf_counter()
                plan = make_plan(world=8, units=units, coverage=cov, scheme=scheme,
                                 shared_size=costs.shared.params,
                                 costs=costs.weights(balance))
                sh = _shares(plan, costs)
                d = diagnostics(plan)
                row = {"model": name, "case": f"C={cov}", "world": 8, "scheme": scheme,
                       "balance": balance if scheme == "balanced" else None,
                       "used": plan.scheme, "worst_params_share": max(sh["params"]) / full,
                       **{f"{k}_max_over_mean": max(v) / statistics.fmean(v)
                          for k, v in sh.items()},
                       "per_rank_params_share": [p / full for p in sh["params"]],
                       "mask_error": d["mask_error"], "spectral_gap": d["spectral_gap"]}
                if estimate:
                    # a plan equal to one already estimated (balanced kept spread) is not
                    # estimated again: the estimate depends on the plan only
                    if plan.matrix not in done:
                        done[plan.matrix] = [r.peak_bytes for r in estimate_memory(_spec(
                            name, seq, 8, coverage=cov, scheme=scheme, balance=balance)
                        ).per_rank]
                    peaks = done[plan.matrix]
                    row |= {"est_peak_per_rank_GB": [x / GB for x in peaks],
                            "est_peak_max_GB": max(peaks) / GB,
                            "est_peak_max_over_mean": max(peaks) / statistics.fmean(peaks)}
                row["wall_s"] = time.perf_counter() - t0
                print(f"{name} C={cov} {scheme}/{balance}: {row['wall_s']:.0f} s", flush=True)
                rows.append(row)
    return rows


def hetero_paper() -> list[dict[str, Any]]:
    """Budgets 2:1:1:1 of the full model's estimated peak (b-sdp, every unit held)."""
    rows = []
    for name, seq in (("llama-1b", 2048), ("resnet18-cifar10", None)):
        t0 = time.perf_counter()
        base = _spec(name, seq, 4)
        full = estimate_memory(base.replace(coverage=1.0)).peak_bytes / GB
        budgets = [full, full / 2, full / 2, full / 2]
        bp = plan_for_budgets(base, budgets)
        plan_rows = bp.estimate.per_rank
        rows.append({"model": name, "full_peak_GB": full, "budgets_GB": budgets,
                     "capacities": list(bp.spec.capacities or ()), "rounds": bp.rounds,
                     "est_peak_per_rank_GB": [r.peak_bytes / GB for r in plan_rows],
                     "params_bytes_per_rank": [r.state["params"] for r in plan_rows],
                     "wall_s": time.perf_counter() - t0})
    return rows


def _train(tmp: str, name: str, args: dict[str, Any], steps: int, **kw: Any) -> dict[str, Any]:
    from subnetdp.train.config import TrainConfig
    from subnetdp.train.run import run_training

    tag = "-".join(str(v) for v in kw.values()).replace("/", "_")
    cfg = TrainConfig(recipe=name, strategy="b-sdp", nproc=4, steps=steps, batch_size=32,
                      eval_batches=5, model_args=args, progress=False, seed=0,
                      out=f"{tmp}/{name}-{tag}", **kw)
    t0 = time.perf_counter()
    s = run_training(cfg)
    times = [r["step_time_s"] for r in s["per_rank"]]
    return {"recipe": name, "model_args": args, "plan_scheme": s["config"]["scheme"],
            "param_coverage": s["plan"]["param_coverage"], "step_time_per_rank_s": times,
            "val_loss": s.get("val_loss"), "val_accuracy": s.get("val_accuracy"),
            "wall_s": time.perf_counter() - t0}


def cpu_runs(steps: int) -> list[dict[str, Any]]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, args in RUNS:
            specs = [BenchSpec(recipe=name, strategy="b-sdp", world=4, batch=32, seq=2,
                               coverage=0.5, scheme=sc, balance=b,
                               model_args=tuple(sorted(args.items()))) for sc, b in SCHEMES]
            t0 = time.perf_counter()
            compute = compute_times(specs, steps)
            wall = time.perf_counter() - t0
            for spec, (scheme, balance) in zip(specs, SCHEMES, strict=True):
                row = _train(tmp, name, args, steps, coverage=0.5, scheme=scheme,
                             balance=balance)
                c = compute[_key(spec)]
                row |= {"scheme": scheme, "balance": balance if scheme == "balanced" else None,
                        "compute_per_rank_s": c["compute"], "synced_per_rank_s": c["synced"],
                        "straggler_ratio": max(c["compute"]) / statistics.fmean(c["compute"]),
                        "compute_wall_s": wall}
                rows.append(row)
    return rows


def hetero_cpu(steps: int) -> dict[str, Any]:
    """resnet18-fmnist (width 8) trained on the 2:1:1:1 balanced plan (params)."""
    name, args = RUNS[0]
    with tempfile.TemporaryDirectory() as tmp:
        units, shared = _units(name, args)
        plan = make_plan(world=4, units=units, coverage=1.0, scheme="balanced",
                         capacities=[1.0, 0.5, 0.5, 0.5], shared_size=shared)
        path = Path(tmp) / "plan.json"
        path.write_text(plan.to_json())
        row = _train(tmp, name, args, steps, plan_file=str(path))
    row["held_units"] = [plan.held_units(r) for r in range(4)]
    row["holder_counts"] = plan.holder_counts()
    return row


def _units(name: str, args: dict[str, Any]) -> tuple[list[Unit], int]:
    import torch

    from subnetdp.subnet.units import describe_units

    recipe = get_recipe(name)
    with torch.device("meta"):
        model = recipe.build_model(**args)
    units, shared = describe_units(model, recipe.adapter)
    return list(units), shared


def _key(spec: BenchSpec) -> str:
    return f"{spec.scheme}/{spec.balance}"


def compute_times(specs: list[BenchSpec], steps: int) -> dict[str, dict[str, list[float]]]:
    """Per spec and rank: median compute (forward + backward, gradient sync off) and synced
    step times, from 4 gloo workers that build every spec and interleave them."""
    from subnetdp.train.launch import launch

    res = launch(_compute_worker, (specs, steps), nproc=specs[0].world,
                 run_id="subnetdp-bench-balanced")
    return {k: {kind: [res[r][k][kind] for r in sorted(res)] for kind in ("compute", "synced")}
            for k in res[0]}


def _compute_worker(specs: list[BenchSpec], steps: int) -> dict[str, dict[str, float]]:
    import torch

    from subnetdp.bench.strategies import build_rank, example_batch, train_step
    from subnetdp.train.launch import init_distributed, shutdown_distributed

    rank, _ = init_distributed("gloo")
    try:
        built = {_key(s): build_rank(s) for s in specs}
        spec_of = {_key(s): s for s in specs}
        g = torch.Generator().manual_seed(rank)
        times: dict[str, dict[str, list[float]]] = {
            k: {"compute": [], "synced": []} for k in built}
        for step in range(WARMUP + steps):
            for k, b in built.items():
                x, y = example_batch(spec_of[k], g)
                t0 = time.perf_counter()
                train_step(b, x, y)  # synced: includes waiting for the slowest holder
                t1 = time.perf_counter()
                # Compute alone: the same forward + backward with no reduction, so a rank's
                # time is its own subnetwork's, not the pace of the slowest rank it syncs with.
                with b.rank.model.no_sync():
                    loss = torch.nn.functional.cross_entropy(b.rank.model(x), y)
                    loss.backward()
                t2 = time.perf_counter()
                b.optimizer.zero_grad(set_to_none=True)
                if step >= WARMUP:
                    times[k]["synced"].append(t1 - t0)
                    times[k]["compute"].append(t2 - t1)
        return {k: {kind: statistics.median(v) for kind, v in t.items()}
                for k, t in times.items()}
    finally:
        shutdown_distributed()


def _scheme(r: dict[str, Any]) -> str:
    return f"balanced ({r['balance']})" if r["scheme"] == "balanced" else r["scheme"]


def _f(xs: list[float], fmt: str = ".3f") -> str:
    return ", ".join(f"{x:{fmt}}" for x in xs)


def write(res: dict[str, Any]) -> None:
    OUT.mkdir(exist_ok=True)
    (OUT / "balanced.json").write_text(json.dumps(res, indent=1))
    paper, steps = res["paper_scale"], res["steps"]
    est = any("est_peak_max_GB" in r for r in paper)
    md = ["# Spread vs balanced plans", "",
          "Paper scale, 8 workers, b-sdp: shares from unit costs measured on meta tensors "
          "(batch 128 for images, 1 x 2048 for llama-1b); `memory` = the cost model's "
          "parameters, gradients, AdamW state and saved activations; `est. peak` = the "
          "fake-tensor estimator's per-rank peak of a real training step (fp32, AdamW for "
          "every model, as the LM benchmarks; the image recipes train with SGD, which keeps "
          "less optimizer state). `used` = the scheme kept (balanced falls back to spread when "
          "not strictly better or when its spectral gap would fall below half of spread's).",
          "",
          "| model | case | scheme | used | worst rank params | params max/mean | "
          "FLOPs max/mean | memory max/mean | est. peak max GB | est. peak max/mean | "
          "mask error | spectral gap |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in paper:
        e = (f"{r['est_peak_max_GB']:.2f} | {r['est_peak_max_over_mean']:.3f}" if est
             else "- | -")
        md.append(f"| {r['model']} | {r['case']} | {_scheme(r)} | {r['used']} | "
                  f"{r['worst_params_share']:.3f} | {r['params_max_over_mean']:.3f} | "
                  f"{r['flops_max_over_mean']:.3f} | {r['memory_max_over_mean']:.3f} | {e} | "
                  f"{r['mask_error']:.3f} | {r['spectral_gap']:.3f} |")
    if res.get("hetero_paper"):
        md += ["", "Heterogeneous, paper scale (estimator): 4 workers with budgets 2:1:1:1 of "
               "the full model's estimated peak (b-sdp, batch as above), turned into "
               "capacities by `bench.hetero.plan_for_budgets` and checked rank by rank.", "",
               "| model | full model peak GB | budgets GB | capacities | est. peak per rank "
               "GB | params held per rank (GB, fp32) | rounds |",
               "|---|---|---|---|---|---|---|"]
        for r in res["hetero_paper"]:
            md.append(f"| {r['model']} | {r['full_peak_GB']:.2f} | {_f(r['budgets_GB'], '.2f')}"
                      f" | {_f(r['capacities'])} | {_f(r['est_peak_per_rank_GB'], '.2f')} | "
                      f"{_f([x / GB for x in r['params_bytes_per_rank']], '.2f')} | "
                      f"{r['rounds']} |")
    if res.get("cpu_runs"):
        md += ["", f"CPU runs: b-sdp C = 0.5, 4 gloo workers, {steps} steps, batch 32, seed 0, "
               "on a shared 2-core machine (4 processes on 2 cores: times include "
               "time-sharing). `compute` = the median forward + backward of the rank's own "
               "subnetwork with gradient sync off (`no_sync`); `synced` = the median full step "
               "(reduction and optimizer included) in the same workers; straggler = slowest "
               "rank's compute / mean rank's compute. `step` and val loss: `subnetdp train` "
               "runs with the same seed.", "",
               "| recipe | scheme | worst param cov | compute per rank (s) | straggler ratio | "
               "synced per rank (s) | train step per rank (s) | val loss | val acc |",
               "|---|---|---|---|---|---|---|---|---|"]
        for r in res["cpu_runs"]:
            md.append(f"| {r['recipe']} {r['model_args']} | {_scheme(r)} | "
                      f"{max(r['param_coverage']):.3f} | {_f(r['compute_per_rank_s'])} | "
                      f"{r['straggler_ratio']:.3f} | {_f(r['synced_per_rank_s'])} | "
                      f"{_f(r['step_time_per_rank_s'])} | {r['val_loss']:.4f} | "
                      f"{r['val_accuracy']} |")
    if res.get("hetero_cpu"):
        h = res["hetero_cpu"]
        md += ["", f"Heterogeneous on CPU: {h['recipe']} {h['model_args']}, balanced plan for "
               f"capacities 1 : 0.5 : 0.5 : 0.5, 4 gloo workers, {steps} steps, trained with "
               "`subnetdp train --plan-file`.", "",
               "| rank | units held | param cov | train step (s) |", "|---|---|---|---|"]
        for i, held in enumerate(h["held_units"]):
            md.append(f"| {i} | {held} | {h['param_coverage'][i]:.3f} | "
                      f"{h['step_time_per_rank_s'][i]:.3f} |")
        md += ["", f"Holders per unit {h['holder_counts']}; val loss {h['val_loss']:.4f}, "
               f"val accuracy {h['val_accuracy']}."]
    (OUT / "balanced.md").write_text("\n".join(md) + "\n")
    _plot(paper)


def _plot(paper: list[dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in paper if r["case"] == "C=0.5" and r["balance"] in (None, "params")]
    labels = sorted({r["model"] for r in rows}, key=[m for m, _ in PAPER].index)
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for k, scheme in enumerate(("spread", "balanced")):
        vals = [next(r["worst_params_share"] for r in rows
                     if r["model"] == m and r["scheme"] == scheme) for m in labels]
        ax.bar([i + 0.38 * k for i in range(len(labels))], vals, 0.38, label=scheme)
    ax.axhline(0.5, color="grey", ls="--", lw=1, label="C = 0.5")
    ax.set_xticks([i + 0.19 for i in range(len(labels))], labels)
    ax.set_ylabel("worst rank's share of parameters")
    ax.set_title("8 workers, C = 0.5")
    ax.legend()
    fig.tight_layout()
    fig.savefig(OUT / "balanced.png", dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--skip-runs", action="store_true", help="paper-scale tables only")
    ap.add_argument("--no-estimate", action="store_true",
                    help="cost model only (no fake-tensor estimates, no heterogeneous budgets)")
    a = ap.parse_args()
    t0 = time.perf_counter()
    res: dict[str, Any] = {"steps": a.steps, "paper_scale": paper_scale(not a.no_estimate)}
    if not a.no_estimate:
        res["hetero_paper"] = hetero_paper()
    if not a.skip_runs:
        res["cpu_runs"] = cpu_runs(a.steps)
        res["hetero_cpu"] = hetero_cpu(a.steps)
    res["wall_s"] = time.perf_counter() - t0
    write(res)
    print((OUT / "balanced.md").read_text())


if __name__ == "__main__":
    main()
