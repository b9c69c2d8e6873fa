"""What bounding the number of process groups costs and what creating them costs (docs/plans.md,
"Communicators and --max-groups").

1. Plan diversity per ``--max-groups K`` (pure maths, llama-1b's 24 blocks, C = 0.69):
   distinct holder sets, communicators per rank (max), the coverage each worker gets, mask
   error and spectral gap (``plan.diagnostics``).
2. gloo group creation time: ``dist.new_group`` for 1..64 distinct subsets at world 4 on this
   machine's CPUs (every rank calls it for every group, as ``runtime.groups`` does).

    python benchmarks/comm_groups.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

from subnetdp.plan import make_plan
from subnetdp.plan.communicators import communicators_per_rank
from subnetdp.plan.diagnostics import diagnostics

UNITS = 24  # llama-1b's blocks


def diversity(worlds: tuple[int, ...], ks: tuple[int | None, ...]) -> list[dict[str, Any]]:
    rows = []
    for world in worlds:
        for k in ks:
            plan = make_plan(world=world, units=UNITS, coverage=0.69, max_groups=k)
            d = diagnostics(plan)
            rows.append({"world": world, "max_groups": k, "holder_sets": d["holder_sets"],
                         "communicators_max": max(communicators_per_rank(plan)),
                         "coverage": statistics.fmean(d["unit_coverage"]),
                         "mask_error": d["mask_error"], "spectral_gap": d["spectral_gap"]})
    return rows


def _create(rank: int, world: int, counts: tuple[int, ...]) -> dict[int, float]:
    subsets = [s for n in (2, 3) for s in itertools.combinations(range(world), n)]
    out = {}
    for n in counts:
        dist.barrier()
        t0 = time.perf_counter()
        for i in range(n):
            dist.new_group(list(subsets[i % len(subsets)]))
        dist.barrier()
        out[n] = time.perf_counter() - t0
    return out


def creation_times(counts: tuple[int, ...], world: int = 4) -> list[dict[str, Any]]:
    from tests.dist.harness import run_workers

    times = run_workers(_create, world, counts)
    return [{"groups": n, "world": world, "seconds": max(t[n] for t in times)} for n in counts]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("benchmarks/out"))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    div = diversity((8, 16, 64), (None, 16, 8, 4, 2))
    made = creation_times((1, 2, 4, 8, 16, 32, 64))
    (args.out / "comm_groups.json").write_text(json.dumps({"diversity": div,
                                                           "gloo_creation": made}, indent=1))
    lines = ["| world | --max-groups | holder sets | communicators/rank (max) | coverage | "
             "mask error | spectral gap |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['world']} | {r['max_groups'] or '-'} | {r['holder_sets']} | "
              f"{r['communicators_max']} | {r['coverage']:.3f} | {r['mask_error']:.4f} | "
              f"{r['spectral_gap']:.4f} |" for r in div]
    lines += ["", "| groups created | world | seconds (gloo, CPU) |", "|---|---|---|"]
    lines += [f"| {r['groups']} | {r['world']} | {r['seconds']:.3f} |" for r in made]
    (args.out / "comm_groups.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
