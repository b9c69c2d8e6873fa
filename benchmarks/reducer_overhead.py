"""Is subnetdp's reducer as fast as PyTorch's own? DDP vs b-sdp with every worker holding
every block: same model, same batches, same process, steps interleaved so that machine noise
hits both alike. Prints a table, writes JSON and a PNG plot to benchmarks/results/.

    python benchmarks/reducer_overhead.py [--nproc 4] [--steps 30] [--warmup 5]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from subnetdp.distributed.launch import launch
from subnetdp.distributed.process_group import init_distributed, shutdown_distributed
from subnetdp.models import get_recipe
from subnetdp.parallelize import parallelize
from subnetdp.plan import make_plan
from subnetdp.subnet.units import describe_units

RESULTS = Path(__file__).parent / "results"


def _worker(recipe_name: str, batch: int, seq: int, steps: int, warmup: int) -> dict[str, Any]:
    rank, world = init_distributed("gloo")
    try:
        recipe = get_recipe(recipe_name)
        with torch.device("meta"):
            meta_a, meta_b = recipe.build_model(), recipe.build_model()
        units, shared = describe_units(meta_a, recipe.adapter)
        plan = make_plan(world=world, units=units, coverage=1.0, shared_size=shared)
        # both from the one builder: torch DDP with bucket views, like the reducer
        ranks = {"ddp": parallelize(meta_a, adapter=recipe.adapter, strategy="ddp"),
                 "b-sdp": parallelize(meta_b, adapter=recipe.adapter, strategy="b-sdp",
                                      plan=plan)}
        opts = {k: torch.optim.AdamW(r.parameters(), lr=1e-3) for k, r in ranks.items()}
        models: dict[str, nn.Module] = {k: r.model for k, r in ranks.items()}
        vocab = ranks["b-sdp"].module.output.out_features
        g = torch.Generator().manual_seed(rank)
        times: dict[str, list[float]] = {"ddp": [], "b-sdp": []}
        for step in range(warmup + steps):
            x = torch.randint(0, vocab, (batch, seq + 1), generator=g)
            # alternate which goes first so neither always runs on a "warm" cache
            order = ["ddp", "b-sdp"] if step % 2 == 0 else ["b-sdp", "ddp"]
            for name in order:
                model, opt = models[name], opts[name]
                t0 = time.perf_counter()
                logits = model(x[:, :-1])
                F.cross_entropy(logits.reshape(-1, vocab), x[:, 1:].reshape(-1)).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                if step >= warmup:
                    times[name].append(time.perf_counter() - t0)
        # same data, same init, everyone holds everything: the two must agree
        diff = max((a - b).abs().max().item() for a, b in
                   zip(ranks["ddp"].module.parameters(), ranks["b-sdp"].module.parameters(),
                       strict=True))
        return {"rank": rank, "times": times, "max_param_diff": diff,
                "params": ranks["b-sdp"].params_trained}
    finally:
        shutdown_distributed()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", default="llama-tiny")
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    args = ap.parse_args()
    results = launch(_worker, (args.recipe, args.batch, args.seq, args.steps, args.warmup),
                     nproc=args.nproc, run_id="reducer-overhead")
    per_rank = [results[r] for r in sorted(results)]
    med = {name: statistics.median(t for r in per_rank for t in r["times"][name])
           for name in ("ddp", "b-sdp")}
    rank_ratios = [statistics.median(r["times"]["b-sdp"]) / statistics.median(r["times"]["ddp"])
                   for r in per_rank]
    ratio = med["b-sdp"] / med["ddp"]
    record = {
        "benchmark": "reducer_overhead", "recipe": args.recipe, "world": args.nproc,
        "batch": args.batch, "seq": args.seq, "steps": args.steps, "warmup": args.warmup,
        "params": per_rank[0]["params"], "median_step_s": med, "ratio_bsdp_over_ddp": ratio,
        "ratio_per_rank": rank_ratios,
        "max_param_diff": max(r["max_param_diff"] for r in per_rank),
        "versions": {"torch": torch.__version__, "python": platform.python_version()},
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "reducer_overhead.json").write_text(json.dumps(record, indent=1))
    table = "\n".join([
        f"reducer overhead: {args.recipe}, {args.nproc} gloo workers, batch {args.batch}x"
        f"{args.seq}, median of {args.steps} steps after {args.warmup} warm-up (all ranks)",
        "| strategy | median step (s) | ratio to DDP |",
        "|---|---|---|",
        f"| torch DDP | {med['ddp']:.4f} | 1.000 |",
        f"| b-sdp, C = 1 | {med['b-sdp']:.4f} | {ratio:.3f} |",
        "",
        f"per-rank ratios: {', '.join(f'{r:.3f}' for r in rank_ratios)}; "
        f"max |param diff| after training: {record['max_param_diff']:.2e}",
    ])
    (RESULTS / "reducer_overhead.md").write_text(table + "\n")
    print(table)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(4, 3))
        ax.bar(["torch DDP", "b-sdp (C=1)"], [med["ddp"], med["b-sdp"]], color=["grey", "C0"])
        ax.set_ylabel("median step time (s)")
        ax.set_title(f"reducer overhead, ratio {ratio:.3f}")
        fig.tight_layout()
        fig.savefig(RESULTS / "reducer_overhead.png", dpi=120)
    except ImportError:
        print("(matplotlib not installed: no plot)")


if __name__ == "__main__":
    main()
