"""``subnetdp bench``: estimated memory, analytic communication, measured step time.

    subnetdp bench memory --recipe llama-1b --nproc 8 --strategy b-sdp --coverage 0.69 \\
        --batch-size 1 --seq-len 2048 [--fsdp] [--ac] [--zero 1|2]
        [--dtype fp32|bf16-mixed|bf16] [--json]
    subnetdp bench comm   --recipe llama-1b --nproc 8 --strategy b-sdp --coverage 0.69 [--json]
    subnetdp bench step   --recipe llama-tiny --nproc 4 --batch-size 8 --seq-len 128 \\
        [--strategies ddp,b-sdp,...] [--coverage 0.5] [--steps 10] [--warmup 3] [--json]
        [--compute] [--link 300mbit[,latency=1ms] [--nodes 2]]
        [--sync-every H [--sync-fragments F] [--outer-dtype bf16]]
    subnetdp bench all    (memory and comm for every strategy, one table)

``memory`` runs one real step per distinct plan row under fake tensors and a fake process group
(no memory is allocated; minutes for llama-1b on 2 cores). ``step`` starts real workers;
``--compute`` also times each strategy with communication off (the exposed communication is
the difference); ``--link`` runs them on an emulated network (root and iproute2: private
network namespaces throttled with ``tc``, ``bench.netem``), one shared link, or with ``--nodes
K`` K nodes whose ranks share a fast local link and reach the others through the ``--link``.
``--sync-every H`` times local steps (``train --sync-every``): ``--steps`` whole windows'
worth of steps, each step its window's mean (the sync amortised).
``--strategy`` takes a strategy or a composed name (``fsdp+ac``, ``b-sdp+fsdp``); ``--fsdp``/
``--ac``/``--zero`` compose it as in ``train`` (``--strategy ddp --fsdp --ac`` is ``fsdp+ac``,
``--strategy ddp --zero 1`` is ``ddp+zero1``, torch's ZeroRedundancyOptimizer). In lists
(``step``, ``all``) they compose the SDP strategies only: the baselines are listed by name.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from subnetdp.commands.options import (
    HelpFormatter,
    add_declared,
    parse_model_arg,
    strategy_label,
    strategy_list,
)

# the run options a benchmark is made of (train.options), each as train spells it
OPTIONS = ("recipe", "model_args", "nproc", "strategy", "coverage", "batch_size", "seq_len",
           "dtype", "fsdp", "ac", "zero", "device", "sync_every", "sync_fragments",
           "outer_dtype")
# a strategy or a composed name (fsdp+ac, b-sdp+fsdp)
LABELS = {"strategy": {"type": strategy_label, "choices": None, "metavar": "STRATEGY"}}


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("bench", help="memory estimate, communication, step time",
                              description=__doc__.split("\n\n")[0] if __doc__ else None,
                              formatter_class=HelpFormatter)
    p.add_argument("what", choices=["memory", "comm", "step", "all"],
                   help="memory: the fake-mode peak estimate; comm: bytes per step "
                        "(analytic); step: measured step time with real workers; all: memory "
                        "and comm of every strategy")
    add_declared(p, "bench", OPTIONS, narrow=LABELS)
    own = p.add_argument_group("bench's own (--steps, --warmup: the benchmark's, not a run's)")
    own.add_argument("--strategies", type=strategy_list,
                     help="step/all: comma-separated, as --strategy (default: all of them)")
    own.add_argument("--steps", dest="timed_steps", type=int, default=10,
                     help="step: timed steps after warm-up (with --sync-every H: a multiple "
                          "of H)")
    own.add_argument("--warmup", dest="warmup_steps", type=int, default=3,
                     help="step: warm-up steps (>= 3; the last one is the memory step)")
    own.add_argument("--compute", action="store_true",
                     help="step: also time each strategy with communication off (a fake "
                          "process group) and report the exposed communication, step minus "
                          "that")
    own.add_argument("--link", metavar="RATE[,latency=Xms]",
                     help="step: run the workers on an emulated network (root and iproute2 "
                          "needed) whose link is throttled to RATE (tc units: 100mbit, 1gbit; "
                          "or unthrottled); its bandwidth and round trip are measured first")
    own.add_argument("--nodes", type=int, default=1,
                     help="step with --link: split the workers over this many emulated "
                          "nodes; ranks of a node share an unthrottled local link, --link is "
                          "each node's link to the others (default 1: one shared link)")
    own.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def _spec(args: argparse.Namespace, text: str, *, in_list: bool = False) -> Any:
    """The BenchSpec of a ``--strategy`` label with ``--fsdp``/``--ac``/``--zero`` composed
    onto it; ``in_list`` (step/all): onto SDP strategies only, baselines keep their own names."""
    from subnetdp.estimate.spec import BenchSpec
    from subnetdp.strategy import RankSpec

    spec = BenchSpec(recipe=args.recipe, strategy=text, world=args.nproc,
                     batch=args.batch_size, seq=args.seq_len, dtype=args.dtype,
                     model_args=tuple(parse_model_arg(a) for a in args.model_args),
                     sync_every=args.sync_every, sync_fragments=args.sync_fragments,
                     outer_dtype=args.outer_dtype)
    if not spec.is_sdp and in_list:
        return spec
    comp = spec.composition()
    comp = comp.replace(fsdp=comp.fsdp or args.fsdp, ac=comp.ac or args.ac,
                        zero=comp.zero or args.zero)
    if not spec.is_sdp:  # a baseline is named by its label: ddp with --fsdp is fsdp
        return spec.replace(strategy=RankSpec(spec.strategy_value, comp).label())
    # an SDP strategy by its name, composed through the flags
    return spec.replace(strategy=spec.strategy_value.name, coverage=args.coverage,
                        fsdp=comp.fsdp, ac=comp.ac, zero=comp.zero)


def _strategies(args: argparse.Namespace) -> list[str]:
    from subnetdp.strategy import BASELINES, SDP_NAMES

    if args.strategies:
        return list(args.strategies)
    return [*BASELINES, *SDP_NAMES]


def _memory(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    from subnetdp.estimate.memory import estimate_memory

    est = estimate_memory(_spec(args, args.strategy)).to_dict()
    b = est["breakdown"]
    text = (f"{est['label']} on {args.recipe}, {args.nproc} workers, micro-batch "
            f"{args.batch_size} x {args.seq_len}, {args.dtype}: estimated peak "
            f"{est['peak_bytes'] / 2**30:.3f} GiB (worst rank {est['worst_rank']})\n" + "  ".join(
                f"{k} {v / 2**30:.3f}" for k, v in b.items() if k != "total"))
    return est, text


def _comm(args: argparse.Namespace, strategy: str) -> tuple[dict[str, Any], str]:
    from subnetdp.estimate.comm import analytic_comm, worst_comm

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

    specs = [_spec(args, s, in_list=True) for s in _strategies(args)]
    device = args.device
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    network = None
    if args.link is not None:
        from subnetdp.bench.netem import Layout, check_available, parse_link

        network = Layout(parse_link(args.link), nodes=args.nodes)
        check_available(network)
        if args.nproc % args.nodes:
            raise ValueError(f"--nodes {args.nodes} must divide --nproc {args.nproc}")
        if device != "cpu":
            raise ValueError("--link emulates the links of gloo workers; use --device cpu")
    elif args.nodes != 1:
        raise ValueError("--nodes needs --link (the emulated network it splits)")
    out = run_step_bench(specs, steps=args.timed_steps, warmup=args.warmup_steps,
                         device=device, compute=args.compute, network=network)
    return out, step_table(out)


def _all(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    from subnetdp.bench.report import memory_table
    from subnetdp.estimate.comm import analytic_comm, worst_comm
    from subnetdp.estimate.memory import estimate_memory

    rows = []
    for s in _strategies(args):
        spec = _spec(args, s, in_list=True)
        est = estimate_memory(spec).to_dict()
        rows.append({"model": args.recipe, **est,
                     "comm": worst_comm(analytic_comm(spec))})
    return {"rows": rows}, memory_table(rows)


def run(args: argparse.Namespace) -> int:
    from subnetdp.distributed.launch import WorkerFailedError

    try:
        if args.what != "step" and (args.sync_every, args.sync_fragments,
                                    args.outer_dtype) != (1, 1, None):
            raise ValueError(f"bench {args.what} does not model local steps; --sync-every, "
                             "--sync-fragments and --outer-dtype are bench step's (plan "
                             "cluster predicts their step time)")
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
    except WorkerFailedError as e:  # bench step's workers: one line, not every traceback
        print(f"subnetdp bench: error: {e.summary}", file=sys.stderr)
        return 1
    print(json.dumps(data, default=str) if args.json else text)
    return 0
