"""Local steps (``--sync-every H``, SDP x DiLoCo) against DDP and DiLoCo (issue 46).

    python benchmarks/local_steps.py                 # run what is missing, then report
    python benchmarks/local_steps.py --quality-only  # only the training runs (no report)
    python benchmarks/local_steps.py --timing-only   # only the timing runs (root), then report
    python benchmarks/local_steps.py --report        # only regenerate docs/results/local_steps.*

Quality does not depend on the link, so it is trained unthrottled and timed apart:
- quality: ``TIERS`` of (strategy, H, steps), seeds 0-2: llama-tiny, 4 gloo workers,
  micro-batch 4 x 128, the assembled full model validated every 32 steps (a sync step: the
  holders' common model). Two budgets: per-step matched (``STEPS`` for all) and FLOP-matched
  (the paper's convention: SDP at coverage C gets round(STEPS / C) steps for DDP's STEPS, since
  each worker computes C of the model; DDP and DiLoCo compute all of it, so theirs is STEPS);
- timing: ``subnetdp bench step --sync-every H --link RATE [--nodes 2]`` (``bench.step`` on
  ``bench.netem``'s emulated links), the strategies of one H interleaved step by step, 3
  warm-up steps then one sync window (H = 1: ``TIMED_H1`` steps); a step is its window's mean,
  the sync amortised. Links: one shared 100 Mbit/s link; 2 x 2 nodes at 100 and 20 Mbit/s
  between the nodes. The load average before each run is recorded.
Convention for loss against wall-clock: a run's evaluation at step s is placed at s times its
configuration's timed step on that link (compute and communication; no start-up, no
evaluation). Runs are resumable: a quality run's folder ``benchmarks/out/local_steps/quality/
<name>`` with a ``summary.json``, or its record in ``JSON``'s ``runs`` (the campaign's record:
outputs are not committed), is done; so is a timing run with its file under ``.../timing``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from subnetdp.study.convergence_report import flattened

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "out" / "local_steps"
RESULTS = ROOT / "docs" / "results"
JSON, DOC, PNG = (RESULTS / f"local_steps.{ext}" for ext in ("json", "md", "png"))
NPROC, BATCH, SEQ, COVERAGE, STEPS, EVAL_EVERY, EVAL_BATCHES, WARMUP = (
    4, 4, 128, 0.5, 256, 32, 8, 16)
TOKENS_PER_STEP = NPROC * BATCH * SEQ  # every strategy trains on the same tokens per step
FLOP_STEPS = round(STEPS / COVERAGE)
# (strategy, H, steps), tier by tier in the campaign's order
TIERS = [
    [("ddp", 1, STEPS), ("b-sdp", 1, STEPS), ("ddp", 32, STEPS), ("b-sdp", 32, STEPS)],
    # DiLoCo gets b-sdp's longer budget too, so tokens to DDP's final loss compare alike
    [("b-sdp", 1, FLOP_STEPS), ("b-sdp", 32, FLOP_STEPS), ("ddp", 32, FLOP_STEPS)],
    # H = 32 at the FLOP-matched budget stays above DDP's final loss: a smaller H there
    [("b-sdp", 8, FLOP_STEPS), ("b-sdp", 8, STEPS), ("ddp", 8, STEPS)],
    [("n-sdp", 1, STEPS), ("n-sdp", 32, STEPS)],
    [("b-sdp", 128, STEPS), ("ddp", 128, STEPS)],
]
CONFIGS = [c for tier in TIERS for c in tier]
SEEDS = (0, 1, 2)
# (key, title, --link, --nodes)
LINKS = [("shared-100", "shared 100 Mbit/s", "100mbit", 1),
         ("2x2-100", "2 x 2 nodes, 100 Mbit/s", "100mbit", 2),
         ("2x2-20", "2 x 2 nodes, 20 Mbit/s", "20mbit", 2)]
# (H, strategies) per timing run, in the campaign's order
TIMINGS = [(1, "ddp,b-sdp"), (32, "ddp,b-sdp"), (8, "ddp,b-sdp"), (1, "n-sdp"),
           (32, "n-sdp"), (128, "ddp,b-sdp")]
TIMED_H1, TIMING_WARMUP = 8, 3
CLI = "import sys; from subnetdp.cli import main; sys.exit(main(sys.argv[1:]))"


def name(strategy: str, h: int, steps: int = STEPS) -> str:
    return f"{strategy} H={h}" + ("" if steps == STEPS else f", {steps} steps")


def run_dir(strategy: str, h: int, steps: int, seed: int) -> Path:
    return OUT / "quality" / (f"{strategy}-H{h}" + ("" if steps == STEPS else f"-S{steps}")
                              + f"-seed{seed}")


def train_args(strategy: str, h: int, out: Path, steps: int, seed: int) -> list[str]:
    args = ["train", "--recipe", "llama-tiny", "--strategy", strategy, "--nproc", str(NPROC),
            "--batch-size", str(BATCH), "--seq-len", str(SEQ), "--steps", str(steps),
            "--warmup", str(WARMUP), "--seed", str(seed), "--no-progress",
            "--no-final-ckpt", "--out", str(out), "--overwrite"]
    if strategy != "ddp":
        args += ["--coverage", str(COVERAGE)]
    if h > 1:
        args += ["--sync-every", str(h)]
    return args


def bench_args(h: int, strategies: str, link: str, nodes: int) -> list[str]:
    return ["bench", "step", "--recipe", "llama-tiny", "--nproc", str(NPROC), "--batch-size",
            str(BATCH), "--seq-len", str(SEQ), "--strategies", strategies, "--coverage",
            str(COVERAGE), "--sync-every", str(h), "--warmup", str(TIMING_WARMUP), "--steps",
            str(TIMED_H1 if h == 1 else h), "--link", link, "--nodes", str(nodes), "--json"]


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}


def _done(out: Path) -> bool:
    return (out / "summary.json").exists()


def _recorded() -> dict[str, Any]:
    return json.loads(JSON.read_text()) if JSON.exists() else {}


def quality() -> None:
    recorded = _recorded().get("runs", {})
    for tier in TIERS:  # tier by tier, seed by seed: a partial campaign has whole seeds
        for seed in SEEDS:
            for strategy, h, steps in tier:
                out = run_dir(strategy, h, steps, seed)
                if _done(out) or out.name in recorded:
                    continue
                shutil.rmtree(out, ignore_errors=True)
                print(f"{time.strftime('%H:%M:%S')} quality {name(strategy, h, steps)} "
                      f"seed {seed}", flush=True)
                subprocess.run([sys.executable, "-c", CLI,
                                *train_args(strategy, h, out, steps, seed), "--eval-every",
                                # evaluations at syncs: the holders' common model
                                str(math.lcm(EVAL_EVERY, h)), "--eval-batches",
                                str(EVAL_BATCHES)],
                               check=True, env=_env())


def timing() -> None:
    recorded = _recorded().get("timing", {})
    for h, strategies in TIMINGS:
        for key, title, link, nodes in LINKS:
            out = OUT / "timing" / f"{key}-H{h}-{strategies}.json"
            if out.exists() or out.stem in recorded:
                continue
            out.parent.mkdir(parents=True, exist_ok=True)
            print(f"{time.strftime('%H:%M:%S')} timing H={h} {strategies} on {title}",
                  flush=True)
            load = os.getloadavg()
            t0 = time.perf_counter()
            args = bench_args(h, strategies, link, nodes)
            res = subprocess.run([sys.executable, "-c", CLI, *args], check=True, env=_env(),
                                 stdout=subprocess.PIPE, text=True)
            bench = json.loads(res.stdout)
            out.write_text(json.dumps({
                "link": key, "h": h, "command": "subnetdp " + " ".join(args),
                "load_average_before": load, "elapsed_s": time.perf_counter() - t0,
                "network": bench["network"],
                "rows": {label: _timing_row(r) for label, r in bench["rows"].items()}},
                indent=1) + "\n")


def _timing_row(r: dict[str, Any]) -> dict[str, Any]:
    return {"strategy": r["spec"]["strategy"], "sync_every": r["spec"]["sync_every"],
            "step_s": r["median_step_s"], "slowest_rank_s": r["slowest_rank_median_s"],
            "peak_bytes": r["measured_peak_bytes"],
            "bytes_per_step": r["comm"]["comm/bytes_per_step"]}


# -- report ---------------------------------------------------------------------------------
def _run_record(out: Path, strategy: str, h: int, steps: int, seed: int) -> dict[str, Any]:
    summary = json.loads((out / "summary.json").read_text())
    val = [json.loads(line) for line in (out / "metrics" / "val.jsonl").read_text().split("\n")
           if line.strip()]
    return {"strategy": strategy, "sync_every": h, "steps": steps, "seed": seed,
            "val": [(v["step"], v["val_loss"]) for v in val], "val_loss": summary["val_loss"],
            "bytes_per_token": summary["comm"]["comm/bytes_per_step"] / (BATCH * SEQ),
            "peak_mem_gib": max(r["max_active"] or 0 for r in summary["per_rank"])}


def collect() -> dict[str, Any]:
    """The record: every quality run (its folder, else the last record's) and timing run,
    and per configuration the rows the report shows."""
    old = _recorded()
    runs = dict(old.get("runs", {}))
    for strategy, h, steps in CONFIGS:
        for seed in SEEDS:
            if _done(p := run_dir(strategy, h, steps, seed)):
                runs[p.name] = _run_record(p, strategy, h, steps, seed)
    timings = dict(old.get("timing", {}))
    for p in sorted((OUT / "timing").glob("*.json")):
        timings[p.stem] = json.loads(p.read_text())
    rows: dict[str, Any] = {}
    for strategy, h, steps in CONFIGS:
        mine = [runs[k] for seed in SEEDS
                if (k := run_dir(strategy, h, steps, seed).name) in runs]
        timed = {t["link"]: r for t in timings.values() for r in t["rows"].values()
                 if (r["strategy"], r["sync_every"]) == (strategy, h)}
        if mine or timed:
            rows[name(strategy, h, steps)] = {
                "strategy": strategy, "sync_every": h, "steps": steps, "seeds": len(mine),
                "val_loss": [r["val_loss"] for r in mine], "curves": [r["val"] for r in mine],
                "timed": timed}
    return {"settings": {"recipe": "llama-tiny", "nproc": NPROC, "batch": BATCH, "seq": SEQ,
                         "coverage": COVERAGE, "steps": STEPS, "flop_matched_steps": FLOP_STEPS,
                         "eval_every": EVAL_EVERY, "eval_batches": EVAL_BATCHES,
                         "warmup": WARMUP, "seeds": SEEDS, "links": LINKS},
            "runs": runs, "timing": timings, "rows": rows}


def _mean_curve(curves: list[list[tuple[int, float]]]) -> list[tuple[int, float, float]]:
    """(step, mean, half-range) at the evaluations every run has."""
    steps = sorted(set.intersection(*(set(s for s, _ in c) for c in curves)))
    at = [[dict(c)[s] for c in curves] for s in steps]
    return [(s, statistics.fmean(v), (max(v) - min(v)) / 2) for s, v in zip(steps, at,
                                                                            strict=True)]


def _half_range(values: list[float]) -> float:
    return (max(values) - min(values)) / 2


def reach(row: dict[str, Any], target: float, spread: float) -> int | None:
    """The first evaluated step whose seeds' mean is within the seeds' spread of ``target``
    (DDP's final mean): mean <= target + max(DDP's final half-range ``spread``, this row's
    half-range there). None: never."""
    if not row["curves"]:
        return None
    return next((s for s, m, hr in _mean_curve(row["curves"]) if m <= target + max(spread, hr)),
                None)


def _figures(r: dict[str, Any]) -> tuple[float | None, float | None]:
    """(bytes per token, peak MiB per worker): the timing runs' (any link: counted bytes and
    measured memory do not depend on it), else None."""
    t = next(iter(r["timed"].values()), None)
    if t is None:
        return None, None
    return t["bytes_per_step"] / (BATCH * SEQ), t["peak_bytes"] / 2**20


def _fallback_figures(runs: list[dict[str, Any]]) -> tuple[float | None, float | None]:
    """The quality runs' own (train's summary), where no timing run measured them."""
    r = next((r for r in runs if r.get("bytes_per_token") is not None), None)
    return (r["bytes_per_token"], r["peak_mem_gib"] * 1024) if r else (None, None)


def _compute(r: dict[str, Any]) -> float:
    """The run's compute in DDP runs (the FLOP-matching convention): steps x coverage."""
    return r["steps"] * (1.0 if r["strategy"] == "ddp" else COVERAGE) / STEPS


def report() -> None:
    data = collect()
    JSON.write_text(json.dumps(data, indent=1) + "\n")
    rows = data["rows"]
    for r in rows.values():
        r["bytes_per_token"], r["peak_mib"] = _figures(r)
        r["figures_from"] = "timing"
        if r["bytes_per_token"] is None:
            runs = [v for v in data["runs"].values()
                    if (v["strategy"], v["sync_every"]) == (r["strategy"], r["sync_every"])]
            r["bytes_per_token"], r["peak_mib"] = _fallback_figures(runs)
            r["figures_from"] = "train"
    ddp = rows.get(name("ddp", 1))
    target = statistics.fmean(ddp["val_loss"]) if ddp and ddp["val_loss"] else None
    spread = _half_range(ddp["val_loss"]) if target is not None else 0.0
    for r in rows.values():
        r["reach_step"] = reach(r, target, spread) if target is not None else None
    lines = [*_intro(ddp, target, spread), *_quality_table(rows), "", *_wall_table(rows, ddp),
             "", *_targets(rows, ddp), "", f"![loss against wall-clock]({PNG.name})", "",
             *_notes(data)]
    DOC.write_text("\n".join(lines) + "\n")
    _plot(rows, target)


def _intro(ddp: dict[str, Any] | None, target: float | None, spread: float) -> list[str]:
    lines = ["# Local steps (SDP x DiLoCo): measured", "",
             "`python benchmarks/local_steps.py` (root for the timing runs): llama-tiny, "
             f"{NPROC} CPU workers (gloo), micro-batch {BATCH} x {SEQ} ({TOKENS_PER_STEP:,} "
             f"tokens per step), SDP at C = {COVERAGE}, validation of the assembled model every "
             f"{EVAL_EVERY} steps ({EVAL_BATCHES} batches), seeds {', '.join(map(str, SEEDS))}."
             " Two budgets: **per-step matched**, every configuration "
             f"{STEPS} steps ({STEPS * TOKENS_PER_STEP:,} tokens); **FLOP-matched** (the "
             f"paper's convention), SDP at coverage C gets round({STEPS} / C) = {FLOP_STEPS} "
             "steps for DDP's "
             f"{STEPS}, since each worker computes C of the model; DDP and DiLoCo (ddp with H > "
             f"1) compute all of it every step, so their FLOP-matched budget is their {STEPS} "
             "steps: the DiLoCo rows serve both comparisons. The learning-rate schedule (warm-up "
             f"{WARMUP} steps, cosine to 10%) spans each run's own budget.", "",
             "Timing: `subnetdp bench step --sync-every H --link RATE [--nodes 2]` (the "
             "strategies of one H interleaved step by step, 3 warm-up steps, then one sync "
             f"window, H = 1: {TIMED_H1} steps; a step is its window's mean, the sync "
             "amortised). Loss against wall-clock: the evaluation at step s placed at s x the "
             "configuration's timed step on that link. Times come from a 2-core machine shared "
             "with other jobs (load averages in the JSON): indicative only.", ""]
    if ddp and ddp["curves"] and target is not None:
        flat, change = flattened([m for _, m, _ in _mean_curve(ddp["curves"])])
        lines += [f"Convergence criterion (docs/results/convergence.md): DDP's validation loss "
                  f"changed by {100 * change:.2f}% over the last 20% of training (criterion "
                  f"< 1%): "
                  f"**{'flattened' if flat else 'NOT flattened: the budget is too short'}**. "
                  "The cosine schedule decays to 10% of the peak by the last step, so a short "
                  "run flattens with its schedule: convergence.md's DDP, 800 steps of the same "
                  "micro-batch, reached a validation loss of 4.634.", "",
                  f"**Tokens to reach DDP's final loss**: DDP's final mean {target:.4f}, its "
                  f"seeds' half-range {spread:.4f}; a configuration reaches it at its first "
                  "evaluation whose seeds' mean is <= DDP's final mean + the larger of the two "
                  "half-ranges (DDP's final, the configuration's at that evaluation).", ""]
    return lines


def _loss(vals: list[float]) -> str:
    if len(vals) == 1:
        return f"{vals[0]:.4f} (1 seed)"
    return f"{statistics.fmean(vals):.4f} ± {_half_range(vals):.4f}" if vals else "-"


def _quality_table(rows: dict[str, Any]) -> list[str]:
    out = ["| configuration | steps (compute / DDP's) | seeds | val loss (mean ± half-range) | "
           "tokens to DDP's final | bytes / token | peak MiB / worker |",
           "|---|---|---|---|---|---|---|"]
    for label, r in rows.items():
        reached = ("not reached" if r["reach_step"] is None
                   else f"{r['reach_step'] * TOKENS_PER_STEP:,}") if r["curves"] else "-"
        mark = " †" if r["figures_from"] == "train" else ""
        per_token = (f"{r['bytes_per_token']:,.0f}{mark}" if r["bytes_per_token"] is not None
                     else "-")
        mem = f"{r['peak_mib']:.1f}{mark}" if r["peak_mib"] is not None else "-"
        out.append(f"| {label} | {r['steps']} ({_compute(r):.2f}) | {r['seeds']} | "
                   f"{_loss(r['val_loss'])} | {reached} | {per_token} | {mem} |")
    return out


def _wall_table(rows: dict[str, Any], ddp: dict[str, Any] | None) -> list[str]:
    """Per link: the timed step, wall-clock per token, to the budget and to DDP's final."""
    out = ["| configuration | link | s / step | µs / token | wall to the budget (s) | wall to "
           "DDP's final (s) | / DDP's wall |", "|---|---|---|---|---|---|---|"]
    for label, r in rows.items():
        for key, title, _, _ in LINKS:
            t = r["timed"].get(key)
            if t is None:
                continue
            base = ddp["timed"].get(key) if ddp else None
            ddp_wall = base["step_s"] * STEPS if base else None
            to_final = r["reach_step"] * t["step_s"] if r["reach_step"] is not None else None
            ratio = (f"{to_final / ddp_wall:.3f}" if to_final is not None and ddp_wall
                     else "-")
            out.append(f"| {label} | {title} | {t['step_s']:.3f} | "
                       f"{t['step_s'] / TOKENS_PER_STEP * 1e6:,.1f} | "
                       f"{t['step_s'] * r['steps']:,.0f} | "
                       f"{'-' if to_final is None else f'{to_final:,.0f}'} | {ratio} |")
    return out


def _targets(rows: dict[str, Any], ddp: dict[str, Any] | None) -> list[str]:
    """The issue's ratios: b-sdp with its best H against DDP, and against DiLoCo at the same H
    (per-step matched, and FLOP-matched: b-sdp's FLOP_STEPS against DiLoCo's STEPS)."""
    out = ["## The issue's targets", ""]
    key, title = LINKS[0][0], LINKS[0][1]
    best = [(r["reach_step"] * r["timed"][key]["step_s"], label, r) for label, r in rows.items()
            if r["strategy"] == "b-sdp" and r["reach_step"] is not None and key in r["timed"]]
    base = ddp["timed"].get(key) if ddp else None
    if best and base and ddp:
        wall, label, r = min(best)
        ratio, mem = wall / (base["step_s"] * STEPS), r["peak_mib"] / ddp["peak_mib"]
        out.append(f"- At {title}: the fastest b-sdp to DDP's final loss is {label}, at "
                   f"{ratio:.3f} of DDP's wall-clock (target <= 0.2: "
                   f"{'met' if ratio <= 0.2 else 'NOT met'}) and {mem:.2f} of DDP's memory per "
                   f"worker (target <= 0.75: {'met' if mem <= 0.75 else 'NOT met'}).")
    else:
        out.append(f"- At {title}: no b-sdp configuration reached DDP's final loss (or is not "
                   "timed): the wall-clock target is NOT met.")
    short = [f"{label}: {statistics.fmean(r['val_loss']):.3f} after "
             f"{r['timed'][key]['step_s'] * r['steps'] / (base['step_s'] * STEPS):.3f} of DDP's "
             f"wall-clock, {r['peak_mib'] / ddp['peak_mib']:.2f} of its memory, "
             f"{r['seeds']} seeds" for label, r in rows.items()
             if r["strategy"] == "b-sdp" and r["sync_every"] > 1 and r["steps"] == FLOP_STEPS
             and r["val_loss"] and r["reach_step"] is None and key in r["timed"] and base
             and ddp]
    if short:
        out.append(f"- Why not: with local steps, b-sdp runs its whole FLOP-matched budget "
                   f"fast but ends above DDP's final loss ({'; '.join(short)}). The loss "
                   "local steps cost per token is not recovered within this budget, with "
                   "DiLoCo's outer step (lr 0.7, momentum 0.9) untuned for this model and H.")
    for label, r in rows.items():
        if r["strategy"] != "b-sdp" or r["sync_every"] == 1:
            continue
        h = r["sync_every"]
        pairs = [(name("ddp", h), "FLOP-matched" if r["steps"] == FLOP_STEPS else
                  "per-step matched")]
        if r["steps"] != STEPS:
            pairs.append((name("ddp", h, r["steps"]), "the same steps and tokens"))
        out += [_against_diloco(label, r, rows[d], how) for d, how in pairs if d in rows]
    return out


def _against_diloco(label: str, r: dict[str, Any], d: dict[str, Any], how: str) -> str:
    """One b-sdp row against DiLoCo at its H: memory, bytes, loss, wall per token."""
    ratios = [f"memory / worker {r['peak_mib'] / d['peak_mib']:.2f}"
              if r["peak_mib"] and d["peak_mib"] else "memory -",
              f"bytes / token {r['bytes_per_token'] / d['bytes_per_token']:.3f}"
              if r["bytes_per_token"] and d["bytes_per_token"] else "bytes -"]
    ratios += [f"wall / token {r['timed'][k]['step_s'] / d['timed'][k]['step_s']:.2f} on {t}"
               for k, t, _, _ in LINKS if k in r["timed"] and k in d["timed"]]
    loss = "val loss -"
    if r["val_loss"] and d["val_loss"]:
        la, lb = statistics.fmean(r["val_loss"]), statistics.fmean(d["val_loss"])
        spread = max(_half_range(r["val_loss"]), _half_range(d["val_loss"]))
        loss = (f"val loss {la - lb:+.3f} ({'within' if abs(la - lb) <= spread else 'outside'}"
                f" the seeds' half-range {spread:.3f}; seeds {len(r['val_loss'])} and "
                f"{len(d['val_loss'])})")
    return f"- {label} against DiLoCo ({d['strategy']} H={d['sync_every']}, {d['steps']} " \
           f"steps; {how}): {', '.join(ratios)}; {loss}."


def _notes(data: dict[str, Any]) -> list[str]:
    rows = data["rows"]
    missing = [f"{name(s, h, n)} ({rows[name(s, h, n)]['seeds'] if name(s, h, n) in rows else 0}"
               " of 3 seeds)" for s, h, n in CONFIGS
               if name(s, h, n) not in rows or rows[name(s, h, n)]["seeds"] < len(SEEDS)]
    untimed = [f"H={h} {s} on {title}" for h, s in TIMINGS for key, title, _, _ in LINKS
               if f"{key}-H{h}-{s}" not in data["timing"]]
    loads = [t["load_average_before"][0] for t in data["timing"].values()]
    return ["- bytes / token: the busiest rank's counted bytes per step (a sync window's, "
            "amortised) over its tokens per step; peak memory: the largest rank's, measured by "
            "the timing run on its sync step (the outer state is optimizer state); † : no "
            "timing run yet, the quality run's own figures (train's summary, memory at step 3).",
            f"- Timing runs' 1-minute load average before each: "
            f"{min(loads):.1f}-{max(loads):.1f}." if loads else "- No timing run yet.",
            "- Not run (time): " + ("; ".join(missing + untimed) or "nothing") + ".", ""]


def _plot(rows: dict[str, Any], target: float | None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(LINKS), figsize=(6 * len(LINKS), 4.5), squeeze=False)
    for ax, (key, title, _, _) in zip(axes[0], LINKS, strict=True):
        for label, r in rows.items():
            t = r["timed"].get(key)
            if t is None or not r["curves"]:
                continue
            curve = _mean_curve(r["curves"])
            ax.plot([s * t["step_s"] for s, _, _ in curve], [m for _, m, _ in curve],
                    marker=".", label=label)
        if target is not None:
            ax.axhline(target, color="gray", linestyle=":", label="DDP's final loss")
        ax.set(xlabel="wall-clock (s, from the timed step)", ylabel="val loss", title=title,
               xscale="log")
        if ax.lines:
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(PNG, dpi=100)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    what = p.add_mutually_exclusive_group()
    what.add_argument("--report", action="store_true", help="only regenerate the report")
    what.add_argument("--quality-only", action="store_true",
                      help="only the training runs, and no report (beside a timing campaign)")
    what.add_argument("--timing-only", action="store_true", help="only the timing runs")
    args = p.parse_args()
    if args.quality_only:
        quality()
        return
    if not args.report:
        timing()  # minutes; the quality runs take hours
        if not args.timing_only:
            quality()
    report()


if __name__ == "__main__":
    main()
