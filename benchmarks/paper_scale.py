"""The paper's memory/communication table at paper scale, and a measured run at CPU scale.

1. Estimated (fake tensors + fake process group, ``subnetdp.estimate.memory``): llama-134m,
   llama-500m and llama-1b at 8 workers, one micro-batch of ``--batch`` x ``--seq`` tokens, fp32,
   AdamW: ddp, ddp (torch's default buckets), ddp+ac, fsdp, fsdp+ac and every SDP strategy at
   C = 0.5 and 0.69, with the analytic bytes per step; each ratio to ddp.
2. Measured (real gloo workers, ``subnetdp.bench.step``): every strategy side by side on a small
   model, steps interleaved: median step time and its ratio to ddp, measured peak memory next to
   the estimate of the same configuration, and the bytes the reducers counted.
3. Composition (docs/method.md §7, estimated): llama-1b at 8 workers, ddp / ddp+ac / fsdp / fsdp+ac
   against b-sdp, b-sdp+ac, b-sdp+fsdp and b-sdp+fsdp+ac, at the recipe's micro-batch (1 x 2048)
   and at one whose DDP peak is near the paper's 70.9 GB (6 x 2048), fp32 AdamW, and the key rows
   in bf16-mixed; next to the paper's 70.9 / 11.0 / 9.7 GB, with the ordering check
   b-sdp+fsdp+ac < fsdp+ac < ddp.

Writes benchmarks/results/paper_scale.{md,json}, memory_breakdown.png, comm_bytes.png and
composition.{md,json}, composition_memory_breakdown.png, composition_comm_bytes.png
(``--only composition``: the composition part alone, a few minutes per row pair on 2 cores;
paper_scale.md keeps its rows and gets a link to composition.md).

    python benchmarks/paper_scale.py [--models llama-134m,llama-500m,llama-1b] [--batch 1]
        [--seq 2048] [--jobs 2] [--step-recipe llama-tiny --step-world 4 --step-steps 6]
        [--only composition|paper] [--composition-batches 1,6]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import platform
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from subnetdp.bench.report import memory_table, plot_rows, step_table
from subnetdp.bench.step import run_step_bench
from subnetdp.estimate.comm import analytic_comm, worst_comm
from subnetdp.estimate.memory import GiB, ddp_default_bucket_bytes, estimate_memory, heaviest_rank
from subnetdp.estimate.spec import BenchSpec
from subnetdp.strategy import BASELINES, SDP_NAMES, ZERO_BASELINES

RESULTS = Path(__file__).parent / "results"
COVERAGES = (0.5, 0.69)
# The paper's per-device peaks for 1B LLaMA at 8 workers (docs/method.md §7), in its "GB"; its
# B-SDP row is matched to our C = 0.69 (the paper's coverage for the 1B model's memory target).
PAPER_GB = {"ddp": 70.9, "fsdp+ac": 11.0, "b-sdp+fsdp+ac (C=0.69)": 9.7}
COMPOSITION_LINK = ("Composition (SDP + FSDP2 per holder group + activation checkpointing, "
                    "mixed precision) on llama-1b, next to the paper's figures: "
                    "[composition.md](composition.md).")
WHY = ("Micro-batch and sequence: the llama recipes' training defaults (batch_size 1, seq_len "
       "2048); the paper does not state its micro-batch. ddp = torch DDP with "
       "gradient_as_bucket_view=True (one gradient copy, like subnetdp's reducer); 'ddp (default "
       "buckets)' adds torch's default second gradient copy (in 'other', not a column here). "
       "Comm: ring = 2(c-1)/c x payload per all-reduce group; FSDP: all-gather + reduce-scatter. "
       "+zero1/+zero2: ZeRO inside holder groups (runtime/zero.py: optimizer state, and for "
       "zero2 the reduced gradients, sharded over each unit's holders; reduce-scatter + "
       "all-gather, the all-reduce's ring bytes). ddp+zero1 = torch DDP + "
       "ZeroRedundancyOptimizer (its comm adds the parameters' broadcast; its memory is "
       "estimated as the holder reducer at full coverage with zero=1: the same full gradients "
       "and sharded state); ddp+zero2 = the holder reducer at full coverage with zero=2 (torch "
       "DDP cannot shard gradients; one gradient copy, as the fair DDP).")


def paper_specs(model: str, world: int, batch: int, seq: int) -> list[BenchSpec]:
    base = BenchSpec(recipe=model, strategy="ddp", world=world, batch=batch, seq=seq)
    specs = [base.replace(strategy=s) for s in BASELINES]
    for s in SDP_NAMES:
        specs += [base.replace(strategy=s, coverage=c) for c in COVERAGES]
    return specs + zero_specs(model, world, batch, seq)


def zero_specs(model: str, world: int, batch: int, seq: int) -> list[BenchSpec]:
    """ZeRO rows (runtime.zero): ddp+zero1 (torch DDP + ZeroRedundancyOptimizer; estimated as
    the holder reducer at full coverage with zero=1, the same state, see ``parallelize``),
    ddp+zero2 (the holder reducer at full coverage, zero=2), b-sdp+zero1/2 at each coverage."""
    base = BenchSpec(recipe=model, strategy="ddp", world=world, batch=batch, seq=seq)
    specs = [base.replace(strategy=s) for s in ZERO_BASELINES]
    return specs + [base.replace(strategy="b-sdp", coverage=c, zero=z)
                    for c in COVERAGES for z in (1, 2)]


def _estimate_row(spec: BenchSpec) -> dict[str, Any]:
    """One table row (run in a worker process: each estimate owns the fake process group)."""
    t0 = time.perf_counter()
    # b-sdp rows are identical for LLaMA (equal blocks); n-sdp rows differ by a slot or two:
    # the rank holding the most parameters is the worst one in both cases.
    est = estimate_memory(spec, ranks=[heaviest_rank(spec)]).to_dict()
    row = {"model": spec.recipe, **est, "comm": worst_comm(analytic_comm(spec)),
           "estimate_s": time.perf_counter() - t0}
    print(f"  estimated {spec.recipe} {spec.label}: {row['peak_bytes'] / 2**30:.2f} GiB "
          f"({row['estimate_s']:.0f} s)", flush=True)
    return row


def _default_buckets_row(ddp_row: dict[str, Any], spec: BenchSpec) -> dict[str, Any]:
    """torch DDP's default (gradient_as_bucket_view=False): the same step plus one flat copy
    of every gradient, alive all run (reported under 'other')."""
    extra = ddp_default_bucket_bytes(spec)
    breakdown = dict(ddp_row["breakdown"])
    breakdown["other"] = breakdown.get("other", 0) + extra
    breakdown["total"] += extra
    return {**ddp_row, "label": "ddp (default buckets)",
            "peak_bytes": ddp_row["peak_bytes"] + extra, "breakdown": breakdown}


def estimate_table(models: list[str], world: int, batch: int, seq: int, jobs: int,
                   only_zero: bool = False) -> list[dict[str, Any]]:
    make = zero_specs if only_zero else paper_specs
    specs = [s for m in models for s in make(m, world, batch, seq)]
    with mp.get_context("fork").Pool(jobs, maxtasksperchild=1) as pool:
        rows = pool.map(_estimate_row, specs, chunksize=1)
    out: list[dict[str, Any]] = []
    for spec, row in zip(specs, rows, strict=True):
        out.append(row)
        if spec.strategy == "ddp":
            out.append(_default_buckets_row(row, spec))
    return out


def composition_specs(model: str, world: int, batch: int, seq: int,
                      dtype: str = "fp32", key_only: bool = False) -> list[BenchSpec]:
    """The composition rows of one setting; ``key_only``: the paper's three, b-sdp+fsdp+ac at
    C = 0.5 and the C = 1 control. b-sdp+fsdp+ac at C = 1 (everyone holds everything) is FSDP+AC
    built by the SDP runtime, which turns FSDP's backward prefetch off (runtime.fsdp, [Note: one
    global order]): comparing it with C < 1 isolates what the subnetworks themselves save."""
    base = BenchSpec(recipe=model, strategy="ddp", world=world, batch=batch, seq=seq, dtype=dtype)
    sdp = base.replace(strategy="b-sdp")
    full = [base.replace(strategy=s) for s in BASELINES]
    full += [sdp.replace(coverage=c) for c in (0.69, 0.5)]
    full += [sdp.replace(coverage=0.69, ac=True), sdp.replace(coverage=0.69, fsdp=True)]
    full += [sdp.replace(coverage=c, fsdp=True, ac=True) for c in (0.69, 0.5, 1.0)]
    if key_only:
        return [s for s in full if s.label in PAPER_GB or s.name == "b-sdp+fsdp+ac"]
    return full


def _setting(spec: BenchSpec) -> str:
    return f"{spec.recipe} {spec.batch}x{spec.seq} {spec.dtype}"


def _spec_key(spec: dict[str, Any]) -> str:
    """A spec (as saved in JSON: tuples become lists) as a comparable string."""
    return json.dumps(json.loads(json.dumps(spec, default=str)), sort_keys=True)


def composition_table_rows(model: str, world: int, batches: list[int], seq: int,
                           jobs: int, reuse: bool = False) -> tuple[list[dict[str, Any]], int]:
    """Estimate every composition row; ``reuse``: take the rows of an existing composition.json
    whose spec is unchanged (estimates are deterministic for the same code) and estimate only
    the others. Returns the rows and how many were reused."""
    specs = [s for b in batches for s in composition_specs(model, world, b, seq)]
    specs += composition_specs(model, world, max(batches), seq, "bf16-mixed", key_only=True)
    old: dict[str, dict[str, Any]] = {}
    if reuse and (RESULTS / "composition.json").exists():
        saved = json.loads((RESULTS / "composition.json").read_text())["rows"]
        old = {_spec_key(r["spec"]): r for r in saved}
    todo = [s for s in specs if _spec_key(asdict(s)) not in old]
    with mp.get_context("fork").Pool(jobs, maxtasksperchild=1) as pool:
        new = dict(zip(map(id, todo), pool.map(_estimate_row, todo, chunksize=1), strict=True))
    rows = [new[id(s)] if id(s) in new else old[_spec_key(asdict(s))] for s in specs]
    for spec, row in zip(specs, rows, strict=True):
        row.update(recipe=spec.recipe, model=_setting(spec), batch=spec.batch, seq=spec.seq,
                   dtype=spec.dtype)
    return rows, len(specs) - len(todo)


def ordering_checks(rows: list[dict[str, Any]]) -> list[str]:
    """Per setting: b-sdp+fsdp+ac (each coverage) < fsdp+ac < ddp, and the ratios to ddp next
    to the paper's."""
    lines = []
    for setting in dict.fromkeys(r["model"] for r in rows):
        peak = {r["label"]: r["peak_bytes"] for r in rows if r["model"] == setting}
        for label in ("b-sdp+fsdp+ac (C=0.69)", "b-sdp+fsdp+ac (C=0.5)"):
            if not {label, "fsdp+ac", "ddp"} <= peak.keys():
                continue
            ok = peak[label] < peak["fsdp+ac"] < peak["ddp"]
            ratios = (f"{label} / ddp = {peak[label] / peak['ddp']:.3f}, fsdp+ac / ddp = "
                      f"{peak['fsdp+ac'] / peak['ddp']:.3f}")
            paper = ""
            if label in PAPER_GB:
                paper = (f" (paper: {PAPER_GB[label] / PAPER_GB['ddp']:.3f}, "
                         f"{PAPER_GB['fsdp+ac'] / PAPER_GB['ddp']:.3f})")
            lines.append(f"- {setting}: {label} < fsdp+ac < ddp: "
                         f"{'MET' if ok else 'NOT MET'}; {ratios}{paper}")
        control = peak.get("b-sdp+fsdp+ac (C=1)")
        if control is not None and "fsdp+ac" in peak:
            saved = ", ".join(f"{(control - peak[lbl]) / GiB:.2f} GiB at {lbl.split()[-1][1:-1]}"
                              for lbl in ("b-sdp+fsdp+ac (C=0.69)", "b-sdp+fsdp+ac (C=0.5)")
                              if lbl in peak)
            lines.append(f"  - same runtime at C=1 (no subnetworks): {control / GiB:.2f} GiB "
                         f"(fsdp+ac {peak['fsdp+ac'] / GiB:.2f}); subnetworks save {saved}")
    return lines


def composition_why(args: Any) -> str:
    batches = " and ".join(f"{b} x {args.seq}" for b in args.composition_batches)
    return (
        "Estimated peak per rank (fake tensors; the worst rank: every rank holds the same "
        "number of blocks, and under FSDP ranks differ only by FSDP's ceil chunks, so the one "
        f"with the largest shards is estimated), AdamW (2 states), {args.world} workers. "
        f"Settings (micro-batch x sequence, dtype): {batches}. 1 x 2048 is the llama recipes' "
        "default; 6 x 2048 is the micro-batch whose DDP peak is nearest the paper's 70.9 (as "
        "GiB; the paper states neither its micro-batch nor whether its GB are 10^9 or 2^30 "
        "bytes). bf16-mixed (the paper's three rows and b-sdp+fsdp+ac at C=0.5, largest "
        "micro-batch): bf16 compute, fp32 master parameters, gradients and optimizer state "
        "(FSDP: bf16 all-gather, fp32 reduce-scatter; DDP: autocast). +fsdp: each held block "
        f"sharded over its holders, the shared parameters over all {args.world} workers; +ac: "
        "every block recomputed in backward. Paper column: docs/method.md §7 (its B-SDP+FSDP+AC "
        "row placed at C = 0.69, the paper's 1B coverage); it is the same for every setting, "
        "compare the ratios. Control: b-sdp+fsdp+ac at C = 1 is FSDP+AC built by the SDP "
        "runtime, which turns FSDP's backward prefetch off (one global order of collectives "
        "over holder groups); the fsdp+ac baseline keeps FSDP2's default prefetch. At 1 x 2048 "
        "the peak comes at the end of backward, where the gathered shared parameters (embedding "
        "and output layer) dominate and the checkpointed activations are mostly freed: there "
        "the whole gap to fsdp+ac is the missing prefetch, not the subnetworks. At 6 x 2048 "
        "the peak is in backward while the checkpointed block inputs are alive, and holding "
        "fewer blocks is what saves memory.")


def write_composition(rows: list[dict[str, Any]], args: Any, wall_s: float,
                      reused: int = 0) -> list[str]:
    from subnetdp.bench.report import composition_table

    checks = ordering_checks(rows)
    record = {"benchmark": "composition", "model": args.composition_model, "world": args.world,
              "seq": args.seq, "batches": args.composition_batches,
              "optimizer": "AdamW (2 states)", "paper_GB": PAPER_GB, "rows": rows,
              "checks": checks, "wall_s": wall_s, "reused_rows": reused,
              "versions": {"torch": torch.__version__, "python": platform.python_version()}}
    (RESULTS / "composition.json").write_text(json.dumps(record, indent=1, default=str))
    md = [f"# Composition: {args.composition_model}, {args.world} workers, estimated per-rank "
          "peak (docs/method.md §7)", "", composition_why(args), "",
          composition_table(rows, PAPER_GB), "", "Ordering check (and ratios to DDP):", *checks]
    (RESULTS / "composition.md").write_text("\n".join(md) + "\n")
    plot_rows(rows, RESULTS, prefix="composition_")
    return md


def link_composition() -> None:
    """paper_scale.{md,json} point at composition.{md,json} (idempotent; rows untouched)."""
    md, js = RESULTS / "paper_scale.md", RESULTS / "paper_scale.json"
    if md.exists() and COMPOSITION_LINK not in md.read_text():
        md.write_text(md.read_text().rstrip("\n") + "\n\n" + COMPOSITION_LINK + "\n")
    if js.exists():
        record = json.loads(js.read_text())
        if record.get("composition") != "composition.json":
            record["composition"] = "composition.json"
            js.write_text(json.dumps(record, indent=1, default=str))


def measured_run(recipe: str, world: int, batch: int, seq: int, steps: int,
                 jobs: int) -> dict[str, Any]:
    base = BenchSpec(recipe=recipe, strategy="ddp", world=world, batch=batch, seq=seq)
    specs = [base.replace(strategy=s) for s in BASELINES]
    specs += [base.replace(strategy=s, coverage=0.5) for s in SDP_NAMES]
    specs.append(base.replace(strategy="b-sdp", coverage=0.5, fsdp=True, ac=True))
    summary = run_step_bench(specs, steps=steps, warmup=3)
    with mp.get_context("fork").Pool(jobs, maxtasksperchild=1) as pool:
        ests = pool.map(_worst_peak, specs, chunksize=1)
    for spec, est in zip(specs, ests, strict=True):
        summary["rows"][spec.label]["estimated_peak_bytes"] = est
    return summary


def _worst_peak(spec: BenchSpec) -> int:
    return estimate_memory(spec).peak_bytes


def targets(rows: list[dict[str, Any]]) -> list[str]:
    """The paper's two headline ratios, checked against our estimates."""
    def ratio(model: str, label: str) -> float | None:
        ddp = next((r for r in rows if r["model"] == model and r["label"] == "ddp"), None)
        row = next((r for r in rows if r["model"] == model and r["label"] == label), None)
        return row["peak_bytes"] / ddp["peak_bytes"] if row and ddp else None

    lines = []
    for model, label, goal in (("llama-1b", "b-sdp (C=0.69)", 0.72),
                               ("llama-500m", "b-sdp (C=0.5)", 0.60)):
        r = ratio(model, label)
        if r is not None:
            lines.append(f"- {model} {label}: peak / ddp = {r:.3f} (paper: <= {goal:.2f}) "
                         f"{'MET' if r <= goal else 'NOT MET'}")
    r = ratio("llama-1b", "b-sdp+zero2 (C=0.69)")
    zero = next((x for x in rows if x["model"] == "llama-1b"
                 and x["label"] == "b-sdp+zero2 (C=0.69)"), None)
    plain = next((x for x in rows if x["model"] == "llama-1b"
                  and x["label"] == "b-sdp (C=0.69)"), None)
    if r is not None and zero is not None and plain is not None:
        comm = (zero["comm"]["comm/ring_bytes_per_step"]
                / plain["comm"]["comm/ring_bytes_per_step"])
        lines.append(f"- llama-1b b-sdp+zero2 (C=0.69): peak / ddp = {r:.3f} (target <= 0.45), "
                     f"ring bytes / b-sdp's = {comm:.3f} (target <= 1.0) "
                     f"{'MET' if r <= 0.45 and comm <= 1.0 else 'NOT MET'}")
    return lines


def merge_rows(old: list[dict[str, Any]], new: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``old`` with ``new`` rows in place of those of the same model and label, the others
    appended after their model's last row (``--only zero``)."""
    key = {(r["model"], r["label"]): r for r in new}
    out = [key.pop((r["model"], r["label"]), r) for r in old]
    for r in key.values():
        last = max((i for i, x in enumerate(out) if x["model"] == r["model"]), default=len(out))
        out.insert(last + 1, r)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="llama-134m,llama-500m,llama-1b")
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--jobs", type=int, default=2, help="estimates run in this many processes")
    ap.add_argument("--step-recipe", default="llama-tiny")
    ap.add_argument("--step-world", type=int, default=4)
    ap.add_argument("--step-batch", type=int, default=8)
    ap.add_argument("--step-seq", type=int, default=128)
    ap.add_argument("--step-steps", type=int, default=6)
    ap.add_argument("--skip-step", action="store_true", help="estimates only")
    ap.add_argument("--only", choices=["composition", "paper", "zero"],
                    help="composition: only the composition table (composition.{md,json}); "
                         "paper: everything but it; zero: only the ZeRO rows of --models, "
                         "merged into paper_scale.{md,json} (the other rows and the measured "
                         "run are kept)")
    ap.add_argument("--composition-model", default="llama-1b")
    ap.add_argument("--composition-batches", default="1,6",
                    help="micro-batches of the composition table (bf16-mixed rows: the largest)")
    ap.add_argument("--reuse-composition", action="store_true",
                    help="keep rows of composition.json whose spec is unchanged (same code only)")
    args = ap.parse_args()
    args.composition_batches = [int(b) for b in args.composition_batches.split(",")]
    RESULTS.mkdir(parents=True, exist_ok=True)
    composition_md: list[str] = []
    if args.only == "zero":
        return write_zero_rows(args)
    if args.only != "paper":
        t0 = time.perf_counter()
        crows, reused = composition_table_rows(args.composition_model, args.world,
                                               args.composition_batches, args.seq, args.jobs,
                                               reuse=args.reuse_composition)
        composition_md = write_composition(crows, args, time.perf_counter() - t0, reused)
        link_composition()
        print("\n".join(composition_md))
        print(f"\n(composition wall {time.perf_counter() - t0:.0f} s)")
    if args.only == "composition":
        return
    t0 = time.perf_counter()
    rows = estimate_table(args.models.split(","), args.world, args.batch, args.seq, args.jobs)
    step = None if args.skip_step else measured_run(
        args.step_recipe, args.step_world, args.step_batch, args.step_seq, args.step_steps,
        args.jobs)
    write_paper(args, rows, step, bool(composition_md), time.perf_counter() - t0)


def write_zero_rows(args: Any) -> None:
    """``--only zero``: estimate the ZeRO rows and merge them into paper_scale.{md,json}."""
    t0 = time.perf_counter()
    new = estimate_table(args.models.split(","), args.world, args.batch, args.seq, args.jobs,
                         only_zero=True)
    old = json.loads((RESULTS / "paper_scale.json").read_text())
    if (old["world"], old["batch"], old["seq"]) != (args.world, args.batch, args.seq):
        raise SystemExit("--only zero: paper_scale.json was written for another --world/"
                         "--batch/--seq; regenerate it whole")
    rows = merge_rows(old["rows"], new)
    write_paper(args, rows, old.get("step"), False, old["wall_s"],
                zero_wall=time.perf_counter() - t0)


def write_paper(args: Any, rows: list[dict[str, Any]], step: dict[str, Any] | None,
                composed: bool, wall_s: float, zero_wall: float | None = None) -> None:
    linked = composed or (RESULTS / "composition.md").exists()
    record = {"benchmark": "paper_scale", "world": args.world, "batch": args.batch,
              "seq": args.seq, "dtype": "fp32", "optimizer": "AdamW (2 states)",
              "rows": rows, "targets": targets(rows), "step": step, "wall_s": wall_s,
              **({"zero_rows_wall_s": zero_wall} if zero_wall is not None else {}),
              "versions": {"torch": torch.__version__, "python": platform.python_version()},
              **({"composition": "composition.json"} if linked else {})}
    (RESULTS / "paper_scale.json").write_text(json.dumps(record, indent=1, default=str))
    md = [f"# Paper-scale memory and communication ({args.world} workers, micro-batch "
          f"{args.batch} x {args.seq} tokens, fp32, AdamW; estimated with fake tensors)", "",
          WHY, "", memory_table(rows), "", "Paper targets:", *targets(rows)]
    if step is not None:
        md += ["", f"# Measured: {args.step_recipe}, {args.step_world} gloo workers, "
               f"micro-batch {args.step_batch} x {args.step_seq}, median of "
               f"{args.step_steps} interleaved steps per strategy after 2 warm-up", "",
               step_table(step)]
    if linked:
        md += ["", COMPOSITION_LINK]
    (RESULTS / "paper_scale.md").write_text("\n".join(md) + "\n")
    plot_rows(rows, RESULTS)
    print("\n".join(md))
    print(f"\n(wall {record['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
