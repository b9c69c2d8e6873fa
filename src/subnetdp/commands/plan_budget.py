"""``subnetdp plan budget`` and ``subnetdp plan fit``: plans for a memory budget.

    subnetdp plan budget --recipe llama-1b --nproc 8 --memory-gb 40 [--strategies b-sdp,ddp]
    subnetdp plan fit --recipe llama-1b --memory-gb 80,40,40,40 --out plan.json

``budget`` searches the strategies and coverages whose estimated peak fits one budget per
worker (``estimate.budget.plan_budget``); ``fit`` makes a balanced plan in which every rank's
estimated peak fits its own budget (``estimate.hetero.plan_for_budgets``, what ``train
--memory-gb`` runs). Each runs fake-mode memory estimates, one real step under fake tensors per
configuration tried, a line each on stderr. Measured on a shared, loaded 2-core machine:
llama-tiny at 4 workers, 12 estimates in about a minute; llama-1b at 8 workers, 1.5 to 3.5
minutes per estimate, at most 20 for all strategies (about 45 minutes), 6 for ``--strategies
b-sdp,ddp`` (14 minutes).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any

from subnetdp.commands.options import (
    add_alias,
    add_declared,
    parse_model_arg,
    searched_strategy_list,
)
from subnetdp.estimate.communicators import comm_mem_mb, split_shared
from subnetdp.strategy import SDP_NAMES, Composition, composition_of

# what an estimate is made of, as train --memory-gb estimates its run (train.options)
ESTIMATED = ("recipe", "nproc", "memory_gb", "comm_mem_mb", "batch_size", "seq_len",
             "model_args", "dtype", "bucket_cap_mb")
# one budget searches the SDP strategies composed with --fsdp/--ac; fit composes one
BUDGET = (*ESTIMATED, "fsdp", "ac")
FIT = (*ESTIMATED, "strategy", "fsdp", "ac", "zero", "reduce_dtype", "seed", "min_holders")
ONE = {"memory_gb": {"type": float, "metavar": "GB"}}


def add_budget_arguments(p: argparse.ArgumentParser) -> None:
    add_declared(p, "plan budget", BUDGET, narrow=ONE)
    p.add_argument("--strategies", type=searched_strategy_list, metavar="S[,S...]",
                   help="search only these, e.g. b-sdp,ddp (baselines by name: fsdp+ac; SDP "
                        "composed by --fsdp/--ac; default: all)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def add_fit_arguments(p: argparse.ArgumentParser) -> None:
    add_declared(p, "plan fit", FIT, narrow={"strategy": {"choices": SDP_NAMES}})
    add_alias(p, "--out", old=("--save",), dest="save", metavar="FILE",
              help="also write the plan as JSON to FILE (train reads it: --plan-file)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def progress(line: str) -> None:
    # stderr: --json keeps stdout one JSON object
    print(f"subnetdp plan: {line}", file=sys.stderr, flush=True)


def run_inputs(args: argparse.Namespace) -> tuple[dict[str, Any], Composition]:
    """--model-arg and the composition options, decoded once, as train decodes them
    (``train_cmd.config_from_args``): the model's overrides and the run's ``Composition``."""
    return dict(parse_model_arg(a) for a in args.model_args), composition_of(args)


def search_base(args: argparse.Namespace, world: int, comm_mb: float) -> Any:
    """The base of the searches (one budget, a cluster): the model, batch, precision and
    buckets; the strategies and their compositions are what they search."""
    from subnetdp.estimate.spec import BenchSpec

    model_args, comp = run_inputs(args)
    return BenchSpec.of("ddp", comp.replace(fsdp=False, ac=False), recipe=args.recipe,
                        world=world, batch=args.batch_size, seq=args.seq_len,
                        model_args=model_args, comm_mem_mb=comm_mb,
                        comm_split_shared=split_shared())


def _budgets(args: argparse.Namespace) -> list[float]:
    budgets = args.memory_gb if isinstance(args.memory_gb, list) else [args.memory_gb]
    if args.recipe is None or not budgets:
        raise ValueError("--memory-gb needs --recipe NAME")
    if not all(math.isfinite(b) and b > 0 for b in budgets):
        raise ValueError(f"--memory-gb takes finite budgets > 0 GB, got "
                         f"{','.join(f'{b:g}' for b in budgets)}")
    return budgets


def run_budget(args: argparse.Namespace) -> int:
    """One budget: the strategies and coverages that fit."""
    from subnetdp.estimate.budget import format_options, plan_budget

    try:
        (budget,) = _budgets(args)
        if args.nproc is None:
            raise ValueError("--memory-gb needs --recipe NAME and --nproc N")
        base = search_base(args, args.nproc, comm_mem_mb(args.comm_mem_mb, nccl=True))
        options = plan_budget(base, budget, strategies=_searched(args.strategies),
                              fsdp=args.fsdp, ac=args.ac, log=progress)
    except ValueError as e:
        print(f"subnetdp plan: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"memory_gb": budget, "options": [o.to_dict() for o in options]}))
    else:
        print(format_options(options, base, budget))
    return 0


def _searched(strategies: list[tuple[str, str | None]] | None) -> tuple[str, ...] | None:
    """``--strategies`` as ``plan_budget`` takes them: baselines by label, SDP strategies by
    name (their composition is --fsdp/--ac, the same for all of them)."""
    if not strategies:
        return None
    for text, sdp_name in strategies:
        if sdp_name is not None and text != sdp_name:
            raise ValueError(f"--strategies {text}: name SDP strategies plainly ({sdp_name}) "
                             "and compose them with --fsdp/--ac")
    return tuple(text for text, _ in strategies)


def run_fit(args: argparse.Namespace) -> int:
    """One budget per worker: a balanced plan whose every rank fits its budget
    (estimator-checked), or a refusal (``BudgetError``, a ValueError) with the smallest
    budgets that would work."""
    from subnetdp.estimate.budget import Estimates
    from subnetdp.estimate.hetero import budget_spec, format_budget_plan, plan_for_budgets
    from subnetdp.estimate.memory import estimate_memory

    try:
        budgets = _budgets(args)
        if args.nproc is not None and len(budgets) != args.nproc:
            raise ValueError(f"--memory-gb has {len(budgets)} budgets for --nproc "
                             f"{args.nproc}; give one per worker (or one for all)")
        if args.save:
            from subnetdp.checkpoint.rundir import check_output

            check_output(args.save, sources=())
        model_args, comp = run_inputs(args)
        # the one builder train --memory-gb uses too (train/hetero.py: budget_plan)
        spec = budget_spec(args.recipe, args.strategy, world=len(budgets),
                           batch=args.batch_size, seq=args.seq_len, comp=comp,
                           model_args=model_args, seed=args.seed,
                           min_holders=args.min_holders,
                           comm_mem_mb=comm_mem_mb(args.comm_mem_mb, nccl=True))
        bp = plan_for_budgets(spec, budgets, estimate=Estimates(estimate_memory, progress))
    except ValueError as e:
        print(f"subnetdp plan: error: {e}", file=sys.stderr)
        return 2
    if args.save:
        with open(args.save, "w") as f:
            f.write(bp.plan().to_json() + "\n")
    if args.json:
        print(json.dumps({"memory_gb": budgets, "capacities": list(bp.spec.capacities or ()),
                          "estimate": bp.estimate.to_dict(), "rounds": bp.rounds}))
    else:
        print(format_budget_plan(bp))
    return 0
