"""``subnetdp bench``: estimated memory, analytic communication, measured step time.

    subnetdp bench memory --model llama-1b --world 8 --strategy b-sdp --coverage 0.69 \\
        --batch 1 --seq 2048 [--fsdp] [--ac] [--dtype fp32|bf16|bf16-mixed] [--json]
    subnetdp bench comm   --model llama-1b --world 8 --strategy b-sdp --coverage 0.69 [--json]
    subnetdp bench step   --model llama-tiny --world 4 --batch 8 --seq 128 \\
        [--strategies ddp,b-sdp,...] [--coverage 0.5] [--steps 10] [--warmup 2] [--json]
    subnetdp bench all    (memory and comm for every strategy, one table)

``memory`` runs one real step per distinct plan row under fake tensors and a fake process group
(no memory is allocated; minutes for llama-1b on 2 cores). ``step`` starts real workers.
``--fsdp``/``--ac`` compose the SDP strategies with FSDP2 (per holder group) and activation
checkpointing (``b-sdp+fsdp+ac``); baselines keep their own names (``ddp+ac``, ``fsdp+ac``).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("bench", help="memory estimate, communication, step time",
                              description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("what", choices=["memory", "comm", "step", "all"])
    p.add_argument("--model", default="llama-tiny", help="a language-model recipe")
    p.add_argument("--world", type=int, default=8, help="number of workers")
    p.add_argument("--strategy", default="b-sdp", help="memory/comm: one strategy")
    p.add_argument("--strategies", help="step/all: comma-separated (default: all of them)")
    p.add_argument("--coverage", type=float, default=0.5, help="SDP coverage (default 0.5)")
    p.add_argument("--batch", type=int, default=1, help="micro-batch per worker")
    p.add_argument("--seq", type=int, default=2048, help="sequence length")
    p.add_argument("--dtype", choices=["fp32", "bf16", "bf16-mixed"], default="fp32",
                   help="fp32; bf16 (pure: parameters, gradients, optimizer state in bf16); "
                        "bf16-mixed (bf16 compute, fp32 master state; = train's --dtype bf16)")
    p.add_argument("--fsdp", action="store_true",
                   help="SDP strategies: shard each held unit over its holders (FSDP2) and "
                        "shared parameters over all workers (b-sdp, bb-sdp)")
    p.add_argument("--ac", action="store_true",
                   help="SDP strategies: activation checkpointing per block")
    p.add_argument("--steps", type=int, default=10, help="step: timed steps after warm-up")
    p.add_argument("--warmup", type=int, default=2, help="step: warm-up steps (memory step)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="step: device")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def _spec(args: argparse.Namespace, strategy: str, *, only_sdp: bool = False) -> Any:
    """``only_sdp``: apply --fsdp/--ac to SDP strategies only (lists mixing baselines); one
    strategy asked for by name takes them as given (a baseline with them is an error)."""
    from subnetdp.bench.strategies import BenchSpec, sdp_strategies

    sdp = strategy in sdp_strategies()
    cov = args.coverage if sdp else 1.0
    compose = sdp or not only_sdp
    return BenchSpec(recipe=args.model, strategy=strategy, world=args.world, batch=args.batch,
                     seq=args.seq, coverage=cov, dtype=args.dtype,
                     fsdp=args.fsdp and compose, ac=args.ac and compose)


def _strategies(args: argparse.Namespace) -> list[str]:
    from subnetdp.bench.strategies import BASELINES, FSDP_COMPOSABLE, all_strategies

    if not args.strategies:
        if args.fsdp:  # those that compose with FSDP, and the baselines
            return [s for s in all_strategies() if s in BASELINES or s in FSDP_COMPOSABLE]
        return list(all_strategies())
    chosen = [s.strip() for s in args.strategies.split(",") if s.strip()]
    unknown = [s for s in chosen if s not in all_strategies()]
    if unknown:
        raise ValueError(f"unknown strategies {unknown}; choose from {all_strategies()}")
    return chosen


def _memory(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    from subnetdp.bench.estimate import estimate_memory

    est = estimate_memory(_spec(args, args.strategy)).to_dict()
    b = est["breakdown"]
    text = (f"{est['label']} on {args.model}, {args.world} workers, micro-batch {args.batch} x "
            f"{args.seq}, {args.dtype}: estimated peak {est['peak_bytes'] / 2**30:.3f} GiB "
            f"(worst rank {est['worst_rank']})\n" + "  ".join(
                f"{k} {v / 2**30:.3f}" for k, v in b.items() if k != "total"))
    return est, text


def _comm(args: argparse.Namespace, strategy: str) -> tuple[dict[str, Any], str]:
    from subnetdp.bench.comm import analytic_comm, worst_comm

    spec = _spec(args, strategy)
    per_rank = analytic_comm(spec)
    worst = worst_comm(per_rank)
    lines = [f"{spec.name}: payload {worst['comm/bytes_per_step'] / 1e6:,.1f} MB/step, ring "
             f"{worst['comm/ring_bytes_per_step'] / 1e6:,.1f} MB/step (busiest rank)"]
    for name, g in worst["by_group"].items():
        lines.append(f"  group [{name}]: payload {g['payload'] / 1e6:,.1f} MB, "
                     f"ring {g['ring'] / 1e6:,.1f} MB")
    return ({"strategy": strategy, "label": spec.label, "worst": worst, "per_rank": per_rank},
            "\n".join(lines))


def _step(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    from subnetdp.bench.report import step_table
    from subnetdp.bench.step import run_step_bench

    specs = [_spec(args, s, only_sdp=True) for s in _strategies(args)]
    out = run_step_bench(specs, steps=args.steps, warmup=args.warmup, device=args.device)
    return out, step_table(out)


def _all(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    from subnetdp.bench.comm import analytic_comm, worst_comm
    from subnetdp.bench.estimate import estimate_memory
    from subnetdp.bench.report import memory_table

    rows = []
    for s in _strategies(args):
        spec = _spec(args, s, only_sdp=True)
        est = estimate_memory(spec).to_dict()
        rows.append({"model": args.model, **est,
                     "comm": worst_comm(analytic_comm(spec))})
    return {"rows": rows}, memory_table(rows)


def run(args: argparse.Namespace) -> int:
    try:
        if args.what == "memory":
            data, text = _memory(args)
        elif args.what == "comm":
            data, text = _comm(args, args.strategy)
        elif args.what == "step":
            data, text = _step(args)
        else:
            data, text = _all(args)
    except (ValueError, KeyError, NotImplementedError) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
        print(f"subnetdp bench: error: {msg}", file=sys.stderr)
        return 2
    print(json.dumps(data, default=str) if args.json else text)
    return 0
