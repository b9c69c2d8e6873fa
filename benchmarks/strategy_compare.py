"""Train one recipe under several strategies with the same data, seed and steps; one table.

    python benchmarks/strategy_compare.py --recipe llama-tiny --steps 200 \\
        --variant ddp --variant b-sdp --variant n-sdp --variant n-sdp+keep:output_scaling=keep

A variant is ``LABEL[:key=value,...]``: the strategy is the label's part before ``+`` and the
key/values are TrainConfig fields. Writes ``<out>/<name>.md`` and ``.json`` (the summaries)
and prints the table. Runs are sequential on a shared machine, so step times carry noise
between runs; memory, parameters and bytes are exact.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path
from typing import Any

import torch

from subnetdp.metrics.report import comparison_table
from subnetdp.metrics.sinks import write_json_atomic
from subnetdp.train.config import TrainConfig
from subnetdp.train.run import run_training


def _parse_variant(text: str) -> tuple[str, dict[str, Any]]:
    label, _, rest = text.partition(":")
    fields: dict[str, Any] = {"strategy": label.split("+")[0]}
    for item in filter(None, rest.split(",")):
        key, _, raw = item.partition("=")
        try:
            fields[key] = json.loads(raw)
        except json.JSONDecodeError:
            fields[key] = raw
    return label, fields


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipe", required=True)
    ap.add_argument("--variant", action="append", required=True)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--coverage", type=float, default=0.5)
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--name", default=None, help="results file stem (default: recipe)")
    ap.add_argument("--runs", default="benchmarks/out/compare", help="run directories")
    ap.add_argument("--out", default="benchmarks/results", help="results directory")
    ap.add_argument("--reuse", action="store_true",
                    help="take a variant's summary.json from an earlier run in --runs when "
                         "it exists (same label, same settings: the caller's responsibility)")
    args = ap.parse_args(argv)

    summaries, labels = [], []
    for text in args.variant:
        label, fields = _parse_variant(text)
        base = {"recipe": args.recipe, "coverage": args.coverage, "nproc": args.nproc,
                "steps": args.steps, "seed": args.seed, "progress": False,
                "out": str(Path(args.runs) / args.recipe / label), "overwrite": True}
        cfg = TrainConfig(**(base | fields))
        done = Path(cfg.out) / "summary.json"
        if args.reuse and done.exists():
            print(f"== {label}: reusing {done} ==", flush=True)
            summaries.append(json.loads(done.read_text()))
        else:
            print(f"== {label}: {args.recipe}, {args.nproc} workers, {args.steps} steps ==",
                  flush=True)
            summaries.append(run_training(cfg))
        labels.append(label if label != cfg.strategy or not cfg.strategy_value.is_sdp
                      else f"{label} (C={cfg.coverage})")
    table = comparison_table(*summaries, labels=labels)
    print(table)
    name = args.name or args.recipe
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cmd = " ".join(["python", "benchmarks/strategy_compare.py", *(argv or sys.argv[1:])])
    (out / f"{name}.md").write_text(
        f"# {args.recipe}: {', '.join(labels)}\n\n`{cmd}`\n\n"
        f"{args.nproc} CPU workers (gloo), {args.steps} steps, seed {args.seed}; "
        f"torch {torch.__version__}, Python {platform.python_version()}.\n\n"
        f"```\n{table}\n```\n"
    )
    write_json_atomic(out / f"{name}.json", {"labels": labels, "summaries": summaries})
    return 0


if __name__ == "__main__":
    sys.exit(main())
