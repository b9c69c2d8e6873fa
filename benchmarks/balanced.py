"""Spread vs balanced plans: per-rank cost at paper scale and short CPU training runs.

    OMP_NUM_THREADS=1 python benchmarks/balanced.py [--steps 30] [--skip-runs] [--no-estimate]

Paper scale (8 workers, C = 0.5 and 0.69, and a 2:1:1:1 heterogeneous example on 4): each
rank's parameters, FLOPs, memory (parameters, gradients, the recipe's optimizer state, saved
activations) and modelled step time from the unit costs measured on meta tensors
(``subnet.costs``), max / mean over ranks, and for spread and the default objective each rank's
peak from the fake-tensor estimator (``estimate.memory``; image batch 128, llama-1b 1 x 2048,
fp32, the recipe's optimizer). Heterogeneous: budgets 2:1:1:1 of the full model's estimated
peak turned into a plan by ``estimate.hetero.plan_for_budgets`` (every rank estimator-checked).
CPU (resnet18-fmnist width 8, swin-t-fmnist embed_dim 24, batch 32, 4 workers, C = 0.5):
(a) the CPU step-time model's rates fitted to measured forward + backward times of every unit;
(b) straggler ratio: every rank's own training step (forward, backward, optimizer; its
collectives on torch's fake process group, which returns at once, so no rank waits for
another) timed in one single-threaded process, ranks interleaved, median per rank; ratio =
slowest rank / mean rank, repeated REPEATS times; (c) ``subnetdp train`` runs with the same
seed (4 gloo workers): validation loss; (d) a 2:1:1:1 run (``train --capacities``).
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

from subnetdp.estimate.hetero import plan_for_budgets
from subnetdp.estimate.memory import estimate_memory
from subnetdp.estimate.spec import BenchSpec
from subnetdp.models import get_recipe
from subnetdp.plan import Unit, diagnostics, make_plan
from subnetdp.plan.objectives import DEFAULT_BALANCE
from subnetdp.subnet.costs import CPU_FLOPS, CPU_MEMORY, ModelCosts, recipe_costs

OUT = Path(__file__).parent / "results"
PAPER = [("resnet18-cifar10", None), ("wrn18-cifar10", None), ("swin-t-cifar10", None),
         ("llama-1b", 2048)]
RUNS = [("resnet18-fmnist", {"width": 8}), ("swin-t-fmnist", {"embed_dim": 24})]
# (scheme, what balanced balances) compared in every case
SCHEMES = [("spread", "params"), ("balanced", "params"), ("balanced", "flops"),
           ("balanced", "time"), ("balanced", DEFAULT_BALANCE)]
ESTIMATED = {("spread", "params"), ("balanced", DEFAULT_BALANCE)}  # estimator runs (slow)
# CPU runs: the default objective with CPU rates instead of an accelerator's
CPU_BALANCE = "params+cpu-time"
CPU_SCHEMES = [("spread", "params"), ("balanced", "params"), ("balanced", CPU_BALANCE)]
GB = 1e9
WARMUP = 2  # steps per rank not timed (allocation, first-step optimizer state)
TIMED = 8  # timed steps per rank and round
ROUNDS = 3  # rounds per measurement, ranks interleaved
REPEATS = 3  # whole measurements, for the spread of the ratio


def _shares(plan: Any, costs: ModelCosts) -> dict[str, list[float]]:
    return {k: [costs.cost(costs.shared, k) + sum(costs.cost(costs.units[u], k)
                                                  for u in plan.held_units(i))
                for i in range(plan.world)] for k in ("params", "flops", "memory", "time")}


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
                if estimate and (scheme, balance) in ESTIMATED:
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

    tag = "-".join(str(v) for v in kw.values()).replace("/", "_").replace(" ", "")
    cfg = TrainConfig(recipe=name, strategy="b-sdp", nproc=4, steps=steps, batch_size=32,
                      eval_batches=5, model_args=args, progress=False, seed=0,
                      out=f"{tmp}/{name}-{tag}", **kw)
    t0 = time.perf_counter()
    s = run_training(cfg)
    return {"recipe": name, "model_args": args, "plan_scheme": s["config"]["scheme"],
            "param_coverage": s["plan"]["param_coverage"],
            "train_step_per_rank_s": [r["step_time_s"] for r in s["per_rank"]],
            "final_train_loss": s.get("final_train_loss"),
            "val_loss": s.get("val_loss"), "val_accuracy": s.get("val_accuracy"),
            "wall_s": time.perf_counter() - t0}


def _cpu_spec(name: str, args: dict[str, Any], scheme: str, balance: str,
              coverage: float = 0.5, **kw: Any) -> BenchSpec:
    return BenchSpec(recipe=name, strategy="b-sdp", world=4, batch=32, seq=2, coverage=coverage,
                     scheme=scheme, balance=balance, model_args=tuple(sorted(args.items())),
                     **kw)


def cpu_time_model() -> dict[str, Any]:
    """Fit cpu-time's rates: unit time = flops / F + act_bytes / M, least squares on relative
    error over every unit of both CPU models (each unit's forward + backward timed alone, on
    the inputs it sees in a full forward, median of 10)."""

    rows = []
    for name, args in RUNS:
        costs = recipe_costs(get_recipe(name), batch=32, model_args=args)
        for u, t in zip(costs.units, _unit_seconds(name, args), strict=True):
            rows.append({"recipe": name, "unit": u.name, "flops": u.flops,
                         "act_bytes": u.act_bytes, "measured_s": t})
    return _fit(rows)


def _fit(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The least-squares rates, and how well the rates in use and FLOPs alone predict each
    unit's share of the measured time (both scaled to the measured total: balancing reads
    shares, and a loaded machine slows every unit alike)."""
    import numpy as np

    a = np.array([[r["flops"], r["act_bytes"]] for r in rows], dtype=float)
    y = np.array([r["measured_s"] for r in rows])
    coef = np.linalg.lstsq(a / y[:, None], np.ones_like(y), rcond=None)[0]
    used = a @ np.array([1 / CPU_FLOPS, 1 / CPU_MEMORY])
    err = {}
    for key, pred in (("model", used), ("flops_only", a[:, 0])):
        scaled = np.concatenate([pred[m] * (y[m].sum() / pred[m].sum()) for m in
                                 [np.array([r["recipe"] == n for r in rows]) for n, _ in RUNS]])
        err[f"median_rel_err_{key}"] = float(np.median(np.abs(scaled - y) / y))
    return {"fit_flops_per_s": float(1 / coef[0]), "fit_bytes_per_s": float(1 / coef[1]),
            "used_flops_per_s": CPU_FLOPS, "used_bytes_per_s": CPU_MEMORY, **err,
            "units": rows}


def _unit_seconds(name: str, args: dict[str, Any], reps: int = 10) -> list[float]:
    import torch

    from subnetdp.subnet.units import unit_modules

    recipe = get_recipe(name)
    torch.manual_seed(0)
    model = recipe.build_model(**args)
    units = unit_modules(model, recipe.adapter)
    seen: dict[str, torch.Tensor] = {}
    hooks = [m.register_forward_pre_hook(lambda _, a, n=n: seen.__setitem__(n, a[0].detach()))
             for n, m in units]
    d = recipe.defaults
    model(torch.randn(32, d["in_channels"], d["image_size"], d["image_size"]))
    for h in hooks:
        h.remove()
    out = []
    for n, m in units:
        x = seen[n].clone().requires_grad_(True)
        times = []
        for _ in range(reps + 2):
            t0 = time.perf_counter()
            y = m(x)
            y.backward(torch.ones_like(y))
            times.append(time.perf_counter() - t0)
        out.append(statistics.median(times[2:]))
    return out


def rank_step_times(specs: list[BenchSpec]) -> list[list[float]]:
    """Per spec, each rank's median own step (module docstring, (b)): one process, one
    thread, torch's fake process group (collectives return at once); ROUNDS rounds, every
    spec and rank in turn, WARMUP + TIMED steps each."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from subnetdp.estimate.spec import build_rank, example_batch, train_step

    x, y = example_batch(specs[0], torch.Generator().manual_seed(0))
    times = [[[] for _ in range(s.world)] for s in specs]
    for _ in range(ROUNDS):
        for k, spec in enumerate(specs):
            for r in range(spec.world):
                dist.init_process_group("fake", rank=r, world_size=spec.world,
                                        store=FakeStore())
                try:
                    built = build_rank(spec)
                    for step in range(WARMUP + TIMED):
                        t0 = time.perf_counter()
                        train_step(built, x, y)
                        if step >= WARMUP:
                            times[k][r].append(time.perf_counter() - t0)
                finally:
                    dist.destroy_process_group()
    return [[statistics.median(t) for t in per_rank] for per_rank in times]


def cpu_runs(steps: int) -> list[dict[str, Any]]:
    import torch

    torch.set_num_threads(1)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, args in RUNS:
            specs = [_cpu_spec(name, args, sc, b) for sc, b in CPU_SCHEMES]
            repeats = [rank_step_times(specs) for _ in range(REPEATS)]
            for k, (scheme, balance) in enumerate(CPU_SCHEMES):
                per = [rep[k] for rep in repeats]
                ratios = [max(m) / statistics.fmean(m) for m in per]
                row = _train(tmp, name, args, steps, coverage=0.5, scheme=scheme,
                             balance=balance)
                row |= {"scheme": scheme, "balance": balance if scheme == "balanced" else None,
                        "own_step_per_rank_s": [statistics.median(x) for x in zip(*per,
                                                                                  strict=True)],
                        "straggler_ratios": ratios,
                        "straggler_ratio": statistics.median(ratios)}
                rows.append(row)
    return rows


def hetero_cpu(steps: int) -> dict[str, Any]:
    """resnet18-fmnist (width 8) trained with ``train --capacities 1,0.5,0.5,0.5``."""
    name, args = RUNS[0]
    caps = [1.0, 0.5, 0.5, 0.5]
    with tempfile.TemporaryDirectory() as tmp:
        row = _train(tmp, name, args, steps, capacities=caps, balance=CPU_BALANCE)
        plan = json.loads(next(Path(tmp).glob("*/plan.json")).read_text())
    spec = _cpu_spec(name, args, "balanced", CPU_BALANCE, capacities=tuple(caps),
                     coverage=1.0)
    own = rank_step_times([spec])[0]
    held = [[u for u, x in enumerate(r) if x] for r in plan["matrix"]]
    row |= {"capacities": caps, "held_units": held,
            "holder_counts": [sum(col) for col in zip(*plan["matrix"], strict=True)],
            "own_step_per_rank_s": own}
    return row


def _scheme(r: dict[str, Any]) -> str:
    return f"balanced ({r['balance']})" if r["scheme"] == "balanced" else r["scheme"]


def _f(xs: list[float], fmt: str = ".3f") -> str:
    return ", ".join(f"{x:{fmt}}" for x in xs)


def write(res: dict[str, Any]) -> None:
    OUT.mkdir(exist_ok=True)
    (OUT / "balanced.json").write_text(json.dumps(res, indent=1))
    paper, steps = res["paper_scale"], res["steps"]
    md = ["# Spread vs balanced plans", "",
          "Generated by `make bench-balanced` (benchmarks/balanced.py; method in its docstring).",
          "", "## Paper scale, 8 workers, b-sdp", "",
          "Per-rank shares from unit costs measured on meta tensors (batch 128 for images, "
          "1 x 2048 for llama-1b): `memory` = parameters, gradients, the recipe's optimizer "
          "state (SGD with momentum for ResNet/WRN, AdamW for Swin and LLaMA) and saved "
          "activations; `time` = the accelerator step-time model (subnet.costs: FLOPs at 100 "
          "TFLOP/s + activation traffic at 2 TB/s + ring all-reduce of the gradient at 50 GB/s). "
          "`est. peak` = the fake-tensor estimator's per-rank peak of a real training step "
          "(fp32, the recipe's optimizer), run for spread and the default objective "
          f"({DEFAULT_BALANCE}). `used` = the scheme kept (balanced falls back to spread when not "
          "strictly better in its own objective, or when its spectral gap would fall below "
          "half of spread's).", "",
          "| model | case | scheme | used | worst rank params | params max/mean | "
          "FLOPs max/mean | memory max/mean | time max/mean | est. peak max GB | "
          "est. peak max/mean | spectral gap |", "|" + "---|" * 12]
    for r in paper:
        e = (f"{r['est_peak_max_GB']:.2f} | {r['est_peak_max_over_mean']:.3f}"
             if "est_peak_max_GB" in r else "- | -")
        md.append(f"| {r['model']} | {r['case']} | {_scheme(r)} | {r['used']} | "
                  f"{r['worst_params_share']:.3f} | {r['params_max_over_mean']:.3f} | "
                  f"{r['flops_max_over_mean']:.3f} | {r['memory_max_over_mean']:.3f} | "
                  f"{r['time_max_over_mean']:.3f} | {e} | {r['spectral_gap']:.3f} |")
    if res.get("hetero_paper"):
        md += ["", "## Heterogeneous, paper scale (estimator)", "",
               "4 workers with budgets 2:1:1:1 of the full model's estimated peak (b-sdp, batch "
               "as above), turned into capacities by `estimate.hetero.plan_for_budgets` and "
               "checked rank by rank.", "",
               "| model | full model peak GB | budgets GB | capacities | est. peak per rank "
               "GB | params held per rank (GB, fp32) | rounds |",
               "|---|---|---|---|---|---|---|"]
        for r in res["hetero_paper"]:
            md.append(f"| {r['model']} | {r['full_peak_GB']:.2f} | {_f(r['budgets_GB'], '.2f')}"
                      f" | {_f(r['capacities'])} | {_f(r['est_peak_per_rank_GB'], '.2f')} | "
                      f"{_f([x / GB for x in r['params_bytes_per_rank']], '.2f')} | "
                      f"{r['rounds']} |")
    if res.get("cpu_time_model"):
        m = res["cpu_time_model"]
        md += ["", "## CPU step-time model (`cpu-time`)", "",
               "Every unit's forward + backward timed alone on one core (batch 32, the input "
               "it sees in a full forward, median of 10), fitted as flops / F + act_bytes / M "
               f"(least squares on relative error): this run's fit F = "
               f"{m['fit_flops_per_s']:.3g} FLOP/s, M = {m['fit_bytes_per_s']:.3g} B/s; the "
               f"constants in subnet/costs.py (F = {m['used_flops_per_s']:.3g}, M = "
               f"{m['used_bytes_per_s']:.3g}, from an earlier fit) predict each unit's share "
               f"of its model's measured time within a median {m['median_rel_err_model']:.0%}"
               f", FLOPs alone within {m['median_rel_err_flops_only']:.0%} (both scaled to "
               "the measured total per model): on these small "
               "models the high-resolution early blocks cost far more time than their FLOPs "
               "say."]
    if res.get("cpu_runs"):
        md += ["", "## CPU: straggler ratio and quality", "",
               f"b-sdp C = 0.5, 4 workers, batch 32. Own step = one rank's forward, backward "
               "and optimizer step, with its collectives on torch's fake process group (they "
               "return at once, so the time is the rank's own work, no waiting for others), "
               "all ranks timed in one single-threaded process, interleaved "
               f"({ROUNDS} rounds x {TIMED} steps after {WARMUP} warm-up, median per rank). "
               f"Straggler = slowest rank / mean rank; median of {REPEATS} repeats [range]. "
               "The machine had 2 cores shared with other jobs, so absolute times are noisy. "
               f"Quality: `subnetdp train` with 4 gloo workers, {steps} steps, seed 0, same "
               "data order; val loss over 5 batches.", "",
               "| recipe | scheme | used | worst param cov | own step per rank (s) | "
               "straggler ratio | final train loss | val loss | val acc |",
               "|---|---|---|---|---|---|---|---|---|"]
        for r in res["cpu_runs"]:
            md.append(f"| {r['recipe']} {r['model_args']} | {_scheme(r)} | {r['plan_scheme']} | "
                      f"{max(r['param_coverage']):.3f} | {_f(r['own_step_per_rank_s'], '.4f')} |"
                      f" {r['straggler_ratio']:.3f} [{min(r['straggler_ratios']):.3f}-"
                      f"{max(r['straggler_ratios']):.3f}] | {r['final_train_loss']:.4f} | "
                      f"{r['val_loss']:.4f} | {r['val_accuracy']:.3f} |")
    if res.get("hetero_cpu"):
        h = res["hetero_cpu"]
        md += ["", "## Heterogeneous on CPU", "",
               f"{h['recipe']} {h['model_args']}, `subnetdp train --capacities 1,0.5,0.5,0.5 "
               f"--balance {CPU_BALANCE}`, 4 gloo workers, {steps} steps, batch 32.", "",
               "| rank | units held | param cov | own step (s) | train step (s) |",
               "|---|---|---|---|---|"]
        for i, held in enumerate(h["held_units"]):
            md.append(f"| {i} | {held} | {h['param_coverage'][i]:.3f} | "
                      f"{h['own_step_per_rank_s'][i]:.4f} | "
                      f"{h['train_step_per_rank_s'][i]:.3f} |")
        md += ["", f"Holders per unit {h['holder_counts']}; final train loss "
               f"{h['final_train_loss']:.4f}, val loss {h['val_loss']:.4f}, val accuracy "
               f"{h['val_accuracy']:.3f}."]
    (OUT / "balanced.md").write_text("\n".join(md) + "\n")
    _plot(paper)


def _plot(paper: list[dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in paper if r["case"] == "C=0.5"]
    labels = sorted({r["model"] for r in rows}, key=[m for m, _ in PAPER].index)
    kinds = [("spread", None), ("balanced", "params"), ("balanced", DEFAULT_BALANCE)]
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.6))
    for ax, key, ylabel in ((axes[0], "worst_params_share", "worst rank's share of params"),
                            (axes[1], "flops_max_over_mean", "FLOPs max / mean over ranks")):
        for k, (scheme, balance) in enumerate(kinds):
            vals = [next(r[key] for r in rows if r["model"] == m and r["scheme"] == scheme
                         and r["balance"] == balance) for m in labels]
            name = scheme if balance is None else f"balanced ({balance})"
            ax.bar([i + 0.27 * k for i in range(len(labels))], vals, 0.27, label=name)
        ax.set_xticks([i + 0.27 for i in range(len(labels))], labels, fontsize=8)
        ax.set_ylabel(ylabel)
    axes[0].axhline(0.5, color="grey", ls="--", lw=1, label="C = 0.5")
    axes[1].axhline(1.0, color="grey", ls="--", lw=1)
    axes[0].legend(fontsize=8)
    fig.suptitle("8 workers, C = 0.5")
    fig.tight_layout()
    fig.savefig(OUT / "balanced.png", dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--skip-runs", action="store_true", help="paper-scale tables only")
    ap.add_argument("--no-estimate", action="store_true",
                    help="cost model only (no fake-tensor estimates, no heterogeneous budgets)")
    ap.add_argument("--hetero-only", action="store_true",
                    help="rerun the heterogeneous parts into the existing balanced.json")
    a = ap.parse_args()
    t0 = time.perf_counter()
    if a.hetero_only:
        res = json.loads((OUT / "balanced.json").read_text())
        res["cpu_time_model"] = _fit(res["cpu_time_model"]["units"])
        res["hetero_cpu"] = hetero_cpu(res["steps"])
        write(res)
        res["hetero_paper"] = hetero_paper()
        write(res)
        return
    res: dict[str, Any] = {"steps": a.steps, "paper_scale": paper_scale(not a.no_estimate)}
    write(res)  # after every part, so a long run keeps what it measured
    if not a.skip_runs:
        res["cpu_time_model"] = cpu_time_model()
        res["cpu_runs"] = cpu_runs(a.steps)
        write(res)
        res["hetero_cpu"] = hetero_cpu(a.steps)
        write(res)
    if not a.no_estimate:
        res["hetero_paper"] = hetero_paper()
    res["wall_s"] = time.perf_counter() - t0
    write(res)
    print((OUT / "balanced.md").read_text())


if __name__ == "__main__":
    main()
