"""``subnetdp plan``: build a plan and print its diagnostics and per-worker bytes.

    subnetdp plan --nproc 8 --units 12 --coverage 0.5 [--scheme spread|random] [--seed S] [--json]
    subnetdp plan --nproc 8 --recipe llama-tiny --coverage 0.5 --out plan.json
    subnetdp plan --nproc 4 --recipe llama-tiny --strategy n-sdp --coverage 0.5 [--rotate]
    subnetdp plan --plan-file matrix.json [--recipe NAME]
    subnetdp plan --nproc 4 --recipe resnet18-cifar10 --coverage 0.5 --scheme balanced
    subnetdp plan --nproc 4 --recipe swin-t-cifar10 --capacities 1,0.5,0.5,0.5 --out p.json

torch is imported only where a model is built (``--recipe``; on the meta device: no memory);
``--units`` and ``--plan-file`` alone need only ``subnetdp.plan``.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from collections.abc import Callable
from typing import Any

from subnetdp.commands.options import Container, add_alias, add_declared
from subnetdp.commands.plan_format import format_costs, format_table
from subnetdp.plan import Plan, PlanError, make_plan
from subnetdp.plan.files import check_shape, read_plan_file
from subnetdp.plan.nodes import check_nnodes, node_report, spread_over_nodes
from subnetdp.plan.report import plan_report
from subnetdp.plan.schedule import ADJACENT, PREFETCH, ScheduleError, plan_schedules
from subnetdp.plan.schedule import check as check_schedule
from subnetdp.plan.schedule import summary as schedule_summary
from subnetdp.plan.shrink import replan_blocker, shrink_plans
from subnetdp.strategy import MASTER_BYTES, SDP_NAMES, PlanSpec, Strategy, get_strategy

# the run options a plan is made from (train.options), each as train spells it
OPTIONS = ("nproc", "min_nproc", "recipe", "coverage", "scheme", "balance", "min_holders",
           "max_groups", "capacities", "seed", "strategy", "neuron_groups", "neuron_kinds",
           "rotate", "plan_file", "dtype", "fsdp", "batch_size", "seq_len", "nnodes",
           "spread_nodes")
# plan takes SDP strategies only (ddp has no plan)
SDP_ONLY = {"strategy": {"choices": SDP_NAMES, "default": "b-sdp"}}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of showing a plan: the run's that make it, and the plan's own."""
    groups = add_declared(p, "plan", OPTIONS, narrow=SDP_ONLY)
    own: Container = p.add_argument_group("plan's own")
    own.add_argument("--units", type=int, help="number of units U (each of size 1 by default; "
                                               "instead of --recipe)")
    own.add_argument("--shared-size", type=int, default=0,
                     help="shared parameter elements (with --units)")
    own.add_argument("--optimizer-states", type=int, default=2,
                     help="optimizer tensors per parameter (AdamW: 2)")
    add_alias(own, "--out", old=("--save",), dest="save", metavar="FILE",
              help="also write the plan as JSON to FILE (train reads it: --plan-file)")
    own.add_argument("--json", action="store_true", help="print one JSON object instead of a "
                                                         "table")
    own.add_argument("--check-schedule", action="store_true",
                     help="check that every rank's collectives (FSDP all-gathers and "
                          "reduce-scatters with prefetch under --fsdp, else the reducer's "
                          "buckets) admit one global order, i.e. cannot deadlock")
    own.add_argument("--prefetch", choices=PREFETCH, default=ADJACENT,
                     help="--check-schedule --fsdp: the prefetch to check: adjacent (what "
                          "subnetdp runs), off, or default (FSDP2's own, which can deadlock)")
    del groups


def _recipe_costs(args: argparse.Namespace) -> Callable[[], Any]:
    """The recipe's measured unit costs (``subnet.costs``) at --batch-size/--seq-len,
    measured once, when first asked for (a balanced plan, the report's per-rank costs)."""
    @functools.cache
    def costs() -> Any:
        from subnetdp.models import get_recipe
        from subnetdp.subnet.costs import recipe_costs

        return recipe_costs(get_recipe(args.recipe), batch=args.batch_size, seq=args.seq_len)
    return costs


def _plan_spec(args: argparse.Namespace, capacities: list[float] | None) -> PlanSpec:
    return PlanSpec(coverage=args.coverage if args.coverage is not None else 1.0,
                    scheme=args.scheme or "spread", balance=args.balance,
                    capacities=None if capacities is None else tuple(capacities),
                    min_holders=args.min_holders, max_groups=args.max_groups,
                    neuron_groups=args.neuron_groups,
                    neuron_kinds=args.neuron_kinds, rotate=args.rotate, seed=args.seed,
                    nnodes=args.nnodes or 1, spread_nodes=args.spread_nodes is not False)


def _recipe_plan(args: argparse.Namespace, strategy: Strategy, spec: PlanSpec,
                 costs: Callable[[], Any]) -> Plan:
    """The recipe's plan, by the one builder (``subnet.planning``; torch, on the meta
    device)."""
    from subnetdp.models import get_recipe
    from subnetdp.subnet.planning import recipe_plan

    return recipe_plan(get_recipe(args.recipe), strategy, spec, world=args.nproc,
                       costs=lambda balance: costs().weights(balance))


def _plan_from_file(args: argparse.Namespace) -> Plan:
    """--plan-file: a bare matrix over --units/--recipe's units (default unit{i} of size 1),
    or a saved plan; torch only with --recipe (``subnet.planning.file_plan``)."""
    if args.coverage is not None or args.scheme is not None:
        raise PlanError("--coverage and --scheme do not apply with --plan-file; drop them")
    if args.recipe is None:
        plan = read_plan_file(args.plan_file, units=None, shared_size=args.shared_size)
        return check_shape(plan, units=args.units, world=args.nproc)
    from subnetdp.models import get_recipe
    from subnetdp.subnet.planning import file_plan

    return file_plan(args.plan_file, get_recipe(args.recipe), units=args.units,
                     world=args.nproc)


def plan_from_args(args: argparse.Namespace, strategy: Strategy,
                   costs: Callable[[], Any]) -> tuple[Plan, str | None]:
    """The plan the arguments describe, and the recipe name if one was used."""
    if args.units is not None and args.recipe is not None:
        raise PlanError("--units and --recipe are not allowed together: give one of them")
    if strategy.splits_layers:  # its units are the model's groups, one set per world
        if args.recipe is None or args.nproc is None or args.coverage is None:
            raise PlanError(f"--strategy {strategy.name} needs --recipe NAME, --nproc N and "
                            "--coverage C")
        if args.plan_file is not None:
            raise PlanError(f"--plan-file does not combine with --strategy {strategy.name} "
                            "(its units are the recipe's neuron groups); give the saved plan "
                            "to `train --plan-file` instead")
        return _recipe_plan(args, strategy, _plan_spec(args, None), costs), args.recipe
    if args.plan_file is not None:
        return _plan_from_file(args), args.recipe
    if args.units is None and args.recipe is None:
        raise PlanError("give --units N or --recipe NAME (or --plan-file FILE)")
    if args.nproc is None:
        raise PlanError("give --nproc N, the number of workers")
    capacities = _capacities(args.capacities, args.nproc)
    if capacities is not None:
        if args.scheme not in (None, "balanced"):
            raise PlanError("--capacities needs --scheme balanced (the default with it)")
    elif args.coverage is None:
        raise PlanError("give --coverage C in (0, 1], the fraction of units each worker holds")
    spec = _plan_spec(args, capacities)
    if args.recipe is not None:
        return _recipe_plan(args, strategy, spec, costs), args.recipe
    # --units: equal units of size 1, pure maths (no model, no torch)
    plan = make_plan(world=args.nproc, units=args.units, coverage=spec.plan_coverage,
                     scheme="balanced" if spec.balanced else spec.scheme, seed=spec.seed,
                     shared_size=args.shared_size, capacities=capacities,
                     min_holders=spec.min_holders, max_groups=spec.max_groups)
    nodes = min(spec.nnodes, plan.world)  # a smaller world the run may shrink to
    return (spread_over_nodes(plan, nodes) if spec.spreads_nodes else plan), None


def _capacities(caps: list[float] | None, world: int) -> list[float] | None:
    if caps is not None and len(caps) != world:
        raise PlanError(f"--capacities has {len(caps)} values for --nproc {world}; give one "
                        "per worker")
    return caps


def _shrink(args: argparse.Namespace, strategy: Strategy, costs: Callable[[], Any],
            world: int) -> dict[str, Any]:
    """How an elastic run of this plan shrinks, decided as train's launcher decides it
    ([Note: shrinking plans] in plan/shrink.py): the --min-holders each smaller world keeps,
    or the one line that refuses the run at its start."""
    min_nproc = args.min_nproc if args.min_nproc is not None else max(1, world - 1)
    out: dict[str, Any] = {"min_nproc": min_nproc, "given": args.min_nproc is not None}
    blocker = replan_blocker(nproc=world, min_nproc=min_nproc,
                             plan_file=args.plan_file is not None,
                             capacities=args.capacities is not None, memory_gb=False)
    if blocker is not None:
        return {**out, "refused": blocker}

    def make(w: int, holders: int) -> Plan:
        again = argparse.Namespace(**{**vars(args), "nproc": w, "min_holders": holders})
        return plan_from_args(again, strategy, costs)[0]

    try:
        steps = shrink_plans(make, nproc=world, min_nproc=min_nproc,
                             min_holders=args.min_holders)
    except PlanError as e:
        return {**out, "refused": str(e)}
    return {**out, "min_holders": {str(r.world): r.min_holders for r in steps}}


def _nodes(args: argparse.Namespace, plan: Plan, shrink: dict[str, Any]) -> list[dict[str, Any]]:
    """The per-node blast radius of ``plan`` on --nnodes nodes (none on one node)."""
    if not args.nnodes or args.nnodes == 1:
        return []
    check_nnodes(args.nnodes, plan.world)
    refused = "refused" in shrink
    nodes = node_report(plan, args.nnodes, shrink["min_nproc"] if shrink["given"] else None)
    for n in nodes:
        if refused and not n["lost_units"]:
            n["rollback"] = "an elastic run is refused at its start, above"
    return nodes


def _error(message: str) -> int:
    print(f"subnetdp plan: error: {message}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    """Show the plan the options describe; 0 on success, 2 on a user error."""
    if args.save:
        from subnetdp.checkpoint.rundir import check_output

        try:
            check_output(args.save, sources=(args.plan_file,) if args.plan_file else ())
        except ValueError as e:
            return _error(str(e))
    strategy = get_strategy(args.strategy)
    recipe_costs = _recipe_costs(args)
    try:
        plan, recipe = plan_from_args(args, strategy, recipe_costs)
        if args.save:
            with open(args.save, "w") as f:
                f.write(plan.to_json() + "\n")
    except (PlanError, KeyError, ValueError, OSError) as e:
        # KeyError's str() adds quotes; its first argument is the message.
        return _error(e.args[0] if isinstance(e, KeyError) and e.args else str(e))
    costs = recipe_costs() if recipe is not None and strategy.balanceable else None
    rep = plan_report(plan, recipe, param_bytes=MASTER_BYTES[args.dtype],
                      optimizer_states=args.optimizer_states,
                      masking=strategy.cost_masking, costs=costs,
                      balance=args.balance if plan.scheme == "balanced" else None)
    rep["shrink"] = _shrink(args, strategy, recipe_costs, plan.world)
    rep["min_holders"] = args.min_holders
    try:
        rep["nodes"] = _nodes(args, plan, rep["shrink"])
    except PlanError as e:
        return _error(str(e))
    if args.check_schedule:
        schedules = plan_schedules(plan, fsdp=args.fsdp,
                                   keep_gathered=strategy.fsdp_keeps_gathered,
                                   backward_masked=strategy.backward_masked,
                                   prefetch=args.prefetch)
        try:
            check_schedule(schedules)
        except ScheduleError as e:
            return _error(str(e))
        rep["schedule"] = schedule_summary(schedules)
    if args.json:
        print(json.dumps(rep))
    else:
        print(format_table(rep) + ("\n" + format_costs(rep) if costs is not None else "")
              + (f"\n{rep['schedule']}" if "schedule" in rep else ""))
    return 0
