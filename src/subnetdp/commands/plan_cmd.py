"""``subnetdp plan``: build a plan and print its diagnostics and per-worker bytes.

    subnetdp plan --nproc 8 --units 12 --coverage 0.5 [--scheme spread|random] [--seed S] [--json]
    subnetdp plan --nproc 8 --recipe llama-tiny --coverage 0.5 --out plan.json
    subnetdp plan --nproc 4 --recipe llama-tiny --strategy n-sdp --coverage 0.5 [--rotate]
    subnetdp plan --plan-file matrix.json [--recipe NAME]
    subnetdp plan --nproc 8 --recipe llama-1b --memory-gb 40 [--strategies b-sdp,ddp]
    subnetdp plan --recipe llama-1b --memory-gb 80,40,40,40 --out plan.json
    subnetdp plan --nproc 4 --recipe resnet18-cifar10 --coverage 0.5 --scheme balanced
    subnetdp plan --nproc 4 --recipe swin-t-cifar10 --capacities 1,0.5,0.5,0.5 --out p.json
    subnetdp plan --recipe llama-1b --cluster "nodes=4,gpus-per-node=8,gpu=h100,inter=25gbit"

``--memory-gb`` runs fake-mode memory estimates, one real step each under fake tensors (one
line per estimate on stderr). Measured on a shared, loaded 2-core machine: llama-tiny at 4
workers, 12 estimates in about a minute; llama-1b at 8 workers, 1.5 to 3.5 minutes per
estimate, at most 20 for all strategies (about 45 minutes), 6 for ``--strategies b-sdp,ddp``
(14 minutes).

torch is imported only where a model is built (``--recipe``, ``--memory-gb``; on the meta
device: no memory); ``--units`` and ``--plan-file`` alone need only ``subnetdp.plan``.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
from collections.abc import Callable
from typing import Any

from subnetdp.commands.options import (
    HelpFormatter,
    add_batch_arguments,
    add_bucket_cap_argument,
    add_comm_mem_argument,
    add_composition_arguments,
    add_dtype_argument,
    add_min_nproc_argument,
    add_model_arg_argument,
    add_neuron_arguments,
    add_node_arguments,
    add_nproc_argument,
    add_plan_file_argument,
    add_recipe_argument,
    add_reduce_dtype_argument,
    add_scheme_arguments,
    add_strategy_argument,
    old_name,
    parse_model_arg,
    searched_strategy_list,
)
from subnetdp.estimate.cluster import DEVICES
from subnetdp.estimate.cluster import KEYS as CLUSTER_KEYS
from subnetdp.estimate.communicators import comm_mem_mb, split_shared
from subnetdp.plan import Plan, PlanError, make_plan
from subnetdp.plan.files import check_shape, read_plan_file
from subnetdp.plan.nodes import check_nnodes, node_report, spread_over_nodes
from subnetdp.plan.report import plan_report
from subnetdp.plan.schedule import ADJACENT, PREFETCH, ScheduleError, plan_schedules
from subnetdp.plan.schedule import check as check_schedule
from subnetdp.plan.schedule import summary as schedule_summary
from subnetdp.plan.shrink import replan_blocker, shrink_plans
from subnetdp.strategy import (
    MASTER_BYTES,
    Composition,
    PlanSpec,
    Strategy,
    composition_of,
    get_strategy,
)


def add_parser(subparsers: Any) -> None:
    """Add the ``plan`` subcommand to an argparse ``add_subparsers()`` object."""
    p = subparsers.add_parser(
        "plan",
        help="build a plan (who holds which unit) and show its coverage, diagnostics and bytes",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        formatter_class=HelpFormatter,
    )
    add_nproc_argument(p, default=None, help="number of workers")
    add_min_nproc_argument(p, help="an elastic run's fewest workers (train --min-nproc): the "
                                   "report says whether each loss is recoverable and how each "
                                   "smaller world re-plans (default: --nproc - 1, one loss)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--units", type=int, help="number of units U (each of size 1 by default)")
    add_recipe_argument(src, default=None,
                        help="use this recipe's blocks (or neuron groups) as units, e.g. "
                             "llama-tiny")
    p.add_argument("--coverage", type=float, help="fraction of units each worker holds, in (0, 1]")
    add_scheme_arguments(p, default=None)
    p.add_argument("--capacities", metavar="C0,C1,...",
                   help="heterogeneous workers: each rank's share of the units' cost, e.g. "
                        "1,0.5,0.5,0.5 (implies --scheme balanced; replaces --coverage)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the random and balanced schemes (default 0)")
    add_strategy_argument(p, default="b-sdp", sdp_only=True,
                          note="units are blocks (b-sdp, bb-sdp) or the neuron groups of "
                               "every layer pair (n-sdp, nb-sdp; needs --recipe); bb/nb: "
                               "backward masking's bytes")
    add_neuron_arguments(p)
    add_node_arguments(p)
    add_plan_file_argument(
        p, help="a JSON matrix [worker][unit] of 0/1, or a saved plan, instead of a scheme")
    p.add_argument(
        "--shared-size", type=int, default=0, help="shared parameter elements (with --units)"
    )
    add_dtype_argument(p)
    p.add_argument(
        "--optimizer-states", type=int, default=2, help="optimizer tensors per parameter (AdamW: 2)"
    )
    p.add_argument("--out", "--save", dest="save", metavar="FILE",
                   help="also write the plan as JSON to FILE (train reads it: --plan-file)"
                        + old_name("--save"))
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--check-schedule", action="store_true",
                   help="check that every rank's collectives (FSDP all-gathers and "
                        "reduce-scatters with prefetch under --fsdp, else the reducer's "
                        "buckets) admit one global order, i.e. cannot deadlock")
    p.add_argument("--prefetch", choices=PREFETCH, default=ADJACENT,
                   help="--check-schedule --fsdp: the prefetch to check: adjacent (what "
                        "subnetdp runs), off, or default (FSDP2's own, which can deadlock)")
    budget = p.add_argument_group(
        "memory budget (subnetdp.estimate.budget / .hetero; needs --recipe, and --nproc "
        "with one budget)",
        "--fsdp/--ac compose the SDP options; the baselines are listed by name (fsdp+ac, "
        "...). As train --memory-gb: --model-arg and --bucket-cap-mb (--cluster too), --zero "
        "and --reduce-dtype (one budget per worker, with --strategy)")
    budget.add_argument("--memory-gb", metavar="GB[,GB...]",
                        help="one value: search strategies and coverages that fit in this many "
                             "GB/worker; one per worker (e.g. 80,40,40,40): a balanced plan "
                             "in which every rank's estimated peak fits its budget; one "
                             "fake-mode estimate per configuration tried, a line each on "
                             "stderr (llama-1b at --nproc 8 on 2 CPU cores: about 2 min "
                             "each, at most 20 for all strategies)")
    budget.add_argument("--strategies", type=searched_strategy_list, metavar="S[,S...]",
                        help="one budget: search only these, e.g. b-sdp,ddp (baselines by "
                             "name: fsdp+ac; SDP composed by --fsdp/--ac; default: all)")
    add_comm_mem_argument(budget, default="{mb}: NCCL's buffers at their defaults, "
                                          "docs/plans.md")
    add_batch_arguments(budget, batch_size=None, seq_len=None,
                        default_note="--memory-gb: default 1 x 2048, not train's recipe "
                                     "default; unit costs: the recipe's")
    # what train --memory-gb estimates its run with, one definition each (commands.options)
    add_model_arg_argument(budget)
    add_composition_arguments(budget, zero=True)
    add_reduce_dtype_argument(budget)
    add_bucket_cap_argument(budget)
    adv = p.add_argument_group(
        "strategy advisor (subnetdp.estimate.advisor; needs --recipe, a language model)",
        "per strategy and coverage on a cluster: fits in --memory-gb (default: the device's), "
        "peak memory, bytes per step, predicted step time and tokens/s")
    adv.add_argument("--cluster", action="append", metavar="K=V,...",
                     help="e.g. nodes=4,gpus-per-node=8,gpu=h100,intra=900GB/s,inter=25gbit "
                          "(keys: " + ", ".join(CLUSTER_KEYS) + "; gpu: "
                          + ", ".join(DEVICES) + "); repeat for one table per cluster "
                          "of the same size")
    adv.add_argument("--mfu", type=float, help="model FLOP/s utilisation (default: the "
                                               "device table's)")
    adv.add_argument("--calibration", metavar="FILE",
                     help="gpu=cpu: the rate of a python -m subnetdp.estimate.calibrate --out "
                          "FILE record (default: calibrate now, a few seconds)")
    adv.add_argument("--peak-tflops", type=float,
                     help="device peak TFLOP/s at the compute dtype (default: the table's)")
    adv.add_argument("--coverages", default="0.5,0.75", metavar="C[,C...]",
                     help="SDP coverages to try (default %(default)s)")
    adv.add_argument("--no-overlap", action="store_true",
                     help="put every collective on the critical path (default: buckets "
                          "overlap backward, FSDP prefetches)")
    p.set_defaults(func=run)


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

    return recipe_plan(get_recipe(args.recipe), strategy, spec, world=args.world,
                       costs=lambda balance: costs().weights(balance))


def _plan_from_file(args: argparse.Namespace) -> Plan:
    """--plan-file: a bare matrix over --units/--recipe's units (default unit{i} of size 1),
    or a saved plan; torch only with --recipe (``subnet.planning.file_plan``)."""
    if args.coverage is not None or args.scheme is not None:
        raise PlanError("--coverage and --scheme do not apply with --plan-file; drop them")
    if args.recipe is None:
        plan = read_plan_file(args.plan_file, units=None, shared_size=args.shared_size)
        return check_shape(plan, units=args.units, world=args.world)
    from subnetdp.models import get_recipe
    from subnetdp.subnet.planning import file_plan

    return file_plan(args.plan_file, get_recipe(args.recipe), units=args.units,
                     world=args.world)


def plan_from_args(args: argparse.Namespace, strategy: Strategy,
                   costs: Callable[[], Any]) -> tuple[Plan, str | None]:
    """The plan the arguments describe, and the recipe name if one was used."""
    if strategy.neuron_level:
        if args.recipe is None or args.world is None or args.coverage is None:
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
    if args.world is None:
        raise PlanError("give --nproc N, the number of workers")
    capacities = _capacities(args.capacities, args.world)
    if capacities is not None:
        if args.scheme not in (None, "balanced"):
            raise PlanError("--capacities needs --scheme balanced (the default with it)")
    elif args.coverage is None:
        raise PlanError("give --coverage C in (0, 1], the fraction of units each worker holds")
    spec = _plan_spec(args, capacities)
    if args.recipe is not None:
        return _recipe_plan(args, strategy, spec, costs), args.recipe
    # --units: equal units of size 1, pure maths (no model, no torch)
    plan = make_plan(world=args.world, units=args.units, coverage=spec.plan_coverage,
                     scheme="balanced" if spec.balanced else spec.scheme, seed=spec.seed,
                     shared_size=args.shared_size, capacities=capacities,
                     min_holders=spec.min_holders, max_groups=spec.max_groups)
    nodes = min(spec.nnodes, plan.world)  # a smaller world the run may shrink to
    return (spread_over_nodes(plan, nodes) if spec.spreads_nodes else plan), None


def _capacities(text: str | None, world: int) -> list[float] | None:
    if text is None:
        return None
    try:
        caps = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise PlanError(f"--capacities takes numbers separated by commas, got {text!r}") from None
    if len(caps) != world:
        raise PlanError(f"--capacities has {len(caps)} values for --nproc {world}; give one "
                        "per worker")
    return caps


def _bar(x: float, width: int = 20) -> str:
    n = round(max(0.0, min(1.0, x)) * width)
    return "#" * n + "." * (width - n)


def format_costs(rep: dict) -> str:
    """The per-rank cost table with text bars (share of the full model's cost)."""
    rows = rep["per_rank_cost"]
    c = rep["unit_costs"]
    batch = f"batch {c['batch']}" + (f" x {c['seq']} tokens" if c["seq"] else "")
    kinds = list(rows[0])
    lines = [f"per-rank cost, share of the full model (measured on meta tensors, {batch}; "
             "memory = parameters, gradients, optimizer state and saved activations; time = "
             "compute + gradient all-reduce, subnet.costs' step-time model)"
             + (f"; the plan balances {rep['balance']}" if rep.get("balance") else "") + ":",
             f"{'worker':>6}  " + "  ".join(f"{k:>8} {'':12}" for k in kinds)]
    for i, r in enumerate(rows):
        lines.append(f"{i:>6}  " + "  ".join(f"{r[k]:>8.3f} {_bar(r[k], 12)}" for k in kinds))
    for k in kinds:
        vals = [r[k] for r in rows]
        lines.append(f"{k:>8}: max / mean = {max(vals) / (sum(vals) / len(vals)):.3f}")
    return "\n".join(lines)


def _ranges(units: list[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> "0-2,5,7-8" (keeps the table narrow for big plans)."""
    parts: list[str] = []
    i = 0
    while i < len(units):
        j = i
        while j + 1 < len(units) and units[j + 1] == units[j] + 1:
            j += 1
        parts.append(str(units[i]) if i == j else f"{units[i]}-{units[j]}")
        i = j + 1
    return ",".join(parts) or "-"


def format_table(rep: dict) -> str:
    title = f"plan: {rep['world']} workers, {rep['num_units']} units, scheme {rep['scheme']}"
    if rep.get("coverage") is not None:
        per = "" if rep["units_per_layer"] == rep["num_units"] else \
            f" per layer of {rep['units_per_layer']}"
        title += f", coverage {rep['coverage']:g} (k={rep['k']}{per})"
    if rep["model"] is not None:
        title += f", model {rep['model']} (shared {rep['shared_size']:,} elements)"
    lines = [
        title,
        f"mask error {rep['mask_error']:.4f}   spectral gap {rep['spectral_gap']:.4f}   "
        f"connected {'yes' if rep['connected'] else 'NO'}   holder sets {rep['holder_sets']}   "
        f"communicators per rank <= {max(rep['communicators'])}",
        f"{'worker':>6}  {'units held':<20}  {'unit cov':>8}  {'param cov':>9}  {'payload MB':>10}",
    ]
    for i, held in enumerate(rep["assignment"]):
        mb = rep["bytes_per_worker"][i]["allreduce_payload"] / 1e6
        lines.append(
            f"{i:>6}  {_ranges(held):<20}  {rep['unit_coverage'][i]:>8.3f}  "
            f"{rep['param_coverage'][i]:>9.3f}  {mb:>10.3f}"
        )
    lines.append(_rescue_line(rep))
    lines += [_node_line(n) for n in rep.get("nodes", [])]
    return "\n".join(lines)


def _node_line(n: dict[str, Any]) -> str:
    """One node's blast radius ([Note: holders across nodes] in plan/nodes.py)."""
    head = f"node {n['node']} (ranks {_ranges(n['ranks'])}): its loss takes "
    head += f"unit(s) {_ranges(n['lost_units'])}" if n["lost_units"] else "no unit"
    if n["rollback"] is None:
        return head + (f"; survives without rollback ({n['survivors']} workers go on from the "
                       "step in flight; not with --zero/--fsdp)")
    return head + f"; rollback to the newest checkpoint ({n['rollback']})"


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
        again = argparse.Namespace(**{**vars(args), "world": w, "min_holders": holders})
        return plan_from_args(again, strategy, costs)[0]

    try:
        steps = shrink_plans(make, nproc=world, min_nproc=min_nproc,
                             min_holders=args.min_holders)
    except PlanError as e:
        return {**out, "refused": str(e)}
    return {**out, "min_holders": {str(r.world): r.min_holders for r in steps}}


def _rescue_line(rep: dict) -> str:
    """Whether losing one worker costs a rollback to the newest checkpoint ([Note: rescue]),
    and how an elastic run of the plan shrinks (``_shrink``)."""
    ok, world, shrink = rep["rescuable_ranks"], rep["world"], rep["shrink"]
    line = f"single-holder units {rep['single_holder_units']}   "
    if "refused" in shrink:
        if not shrink["given"]:
            return line + ("a lost worker costs a rollback to the newest checkpoint "
                           f"(--max-restarts); an elastic run is refused: {shrink['refused']}")
        return line + f"an elastic run is refused at its start: {shrink['refused']}"
    kept = "".join(f"; at {w} workers it re-plans with --min-holders {h}"
                   for w, h in shrink["min_holders"].items() if h < rep["min_holders"])
    if world > 1 and shrink["min_nproc"] == world:
        return line + f"a lost worker is not rescued: --min-nproc {world} leaves no smaller world"
    if world > 1 and len(ok) == world:
        return line + ("a lost worker is recoverable without rollback (any one rank; "
                       f"--min-nproc {shrink['min_nproc']}, not with --zero/--fsdp){kept}")
    if not ok or world == 1:
        return line + "a lost worker costs a rollback to the newest checkpoint (--min-holders 2)"
    return line + (f"only the loss of rank(s) {_ranges(ok)} is recoverable without rollback "
                   f"(--min-holders 2 for any){kept}")


# the estimates' inputs a run gives train (--model-arg, the composition): plan takes them for
# --memory-gb and --cluster only, and the composition of one strategy only with one budget per
# worker (one budget and --cluster search the strategies and their compositions)
ESTIMATE_ONLY = ("--model-arg", "--zero", "--reduce-dtype", "--bucket-cap-mb")
ONE_STRATEGY = ("--zero", "--reduce-dtype")


def _given(args: argparse.Namespace, names: tuple[str, ...]) -> list[str]:
    """Those of ``names`` set to something other than their default (an inert default is
    accepted everywhere): no --model-arg, the composition options at Composition's defaults."""
    def default(dest: str) -> Any:
        return [] if dest == "model_arg" else getattr(Composition(), dest)

    return [n for n in names if getattr(args, d := n[2:].replace("-", "_")) != default(d)]


def _run_inputs(args: argparse.Namespace) -> tuple[dict[str, Any], Composition]:
    """--model-arg and the composition options, decoded once, as train decodes them
    (``train_cmd.config_from_args``): the model's overrides and the run's ``Composition``."""
    return dict(parse_model_arg(a) for a in args.model_arg), composition_of(args)


def _search_base(args: argparse.Namespace, world: int, comm_mb: float) -> Any:
    """The base of the searches (one budget, --cluster): the model, batch, precision and
    buckets; the strategies and their compositions are what they search."""
    from subnetdp.estimate.spec import BenchSpec, composition_fields

    if given := _given(args, ONE_STRATEGY):
        raise ValueError(f"{', '.join(given)} compose one strategy: give one --memory-gb per "
                         "worker with --strategy (one budget and --cluster search the "
                         "strategies and their compositions: --strategies, --fsdp/--ac)")
    model_args, comp = _run_inputs(args)
    return BenchSpec(recipe=args.recipe, strategy="ddp", world=world,
                     batch=args.batch_size or 1, seq=args.seq_len or 2048,
                     **composition_fields(comp.replace(fsdp=False, ac=False)),
                     model_args=tuple(sorted(model_args.items())), comm_mem_mb=comm_mb,
                     comm_split_shared=split_shared())


def _budget(args: argparse.Namespace) -> int:
    """``--memory-gb``: one budget, the strategies and coverages that fit
    (``estimate.budget.plan_budget``); one per worker, a balanced plan that fits them all
    (``estimate.hetero.plan_for_budgets``)."""
    try:
        try:
            budgets = [float(x) for x in args.memory_gb.split(",") if x.strip()]
        except ValueError:
            raise ValueError(f"--memory-gb takes numbers separated by commas, got "
                             f"{args.memory_gb!r}") from None
        if not all(math.isfinite(b) and b > 0 for b in budgets):
            raise ValueError(f"--memory-gb takes finite budgets > 0 GB, got {args.memory_gb}")
        world = args.world if len(budgets) == 1 else len(budgets)
        comm_mb = comm_mem_mb(args.comm_mem_mb, nccl=True)  # plan plans for NCCL GPUs
        if args.recipe is None or world is None:
            raise ValueError("--memory-gb needs --recipe NAME and --nproc N")
        if args.world is not None and world != args.world:
            raise ValueError(f"--memory-gb has {len(budgets)} budgets for --nproc "
                             f"{args.world}; give one per worker (or one for all)")
        if len(budgets) > 1:
            if args.strategies:
                raise ValueError("--strategies searches one budget; with one budget per "
                                 "worker, name the strategy with --strategy b-sdp or bb-sdp")
            return _per_rank_budgets(args, budgets, comm_mb)
        from subnetdp.estimate.budget import format_options, plan_budget

        base = _search_base(args, world, comm_mb)
        options = plan_budget(base, budgets[0], strategies=_searched(args.strategies),
                              fsdp=args.fsdp, ac=args.ac, log=_progress)
    except ValueError as e:
        print(f"subnetdp plan: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"memory_gb": budgets[0], "options": [o.to_dict() for o in options]}))
    else:
        print(format_options(options, base, budgets[0]))
    return 0


def _progress(line: str) -> None:
    # stderr: --json keeps stdout one JSON object
    print(f"subnetdp plan: {line}", file=sys.stderr, flush=True)


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


def _per_rank_budgets(args: argparse.Namespace, budgets: list[float], comm_mb: float) -> int:
    """A balanced plan whose every rank fits its budget (estimator-checked), or a refusal
    (``BudgetError``, a ValueError) with the smallest budgets that would work."""
    from subnetdp.estimate.budget import Estimates
    from subnetdp.estimate.hetero import budget_spec, format_budget_plan, plan_for_budgets
    from subnetdp.estimate.memory import estimate_memory

    model_args, comp = _run_inputs(args)
    # the one builder train --memory-gb uses too (train/hetero.py: budget_plan)
    spec = budget_spec(args.recipe, args.strategy, world=len(budgets),
                       batch=args.batch_size or 1, seq=args.seq_len or 2048, comp=comp,
                       model_args=model_args, seed=args.seed, min_holders=args.min_holders,
                       comm_mem_mb=comm_mb)
    bp = plan_for_budgets(spec, budgets, estimate=Estimates(estimate_memory, _progress))
    if args.save:
        with open(args.save, "w") as f:
            f.write(bp.plan().to_json() + "\n")
    if args.json:
        print(json.dumps({"memory_gb": budgets, "capacities": list(bp.spec.capacities or ()),
                          "estimate": bp.estimate.to_dict(), "rounds": bp.rounds}))
    else:
        print(format_budget_plan(bp))
    return 0


def _advise(args: argparse.Namespace) -> int:
    """``--cluster``: the advisor's table per cluster (``estimate.advisor``)."""
    from subnetdp.estimate.advisor import OPTIONS, advise, format_advice, left_out
    from subnetdp.estimate.cluster import parse_cluster
    from subnetdp.estimate.rates import advisor_rate

    try:
        clusters = [parse_cluster(text) for text in args.cluster]
        if args.recipe is None:
            raise ValueError("--cluster needs --recipe NAME")
        if args.world is not None and args.world != clusters[0].world:
            raise ValueError(f"--nproc {args.world} differs from the cluster's "
                             f"{clusters[0].world} ranks; drop --nproc")
        comm_mb = comm_mem_mb(args.comm_mem_mb, nccl=clusters[0].device.backend == "nccl")
        if args.mfu is not None and not 0 < args.mfu <= 1:
            raise ValueError(f"--mfu must be in (0, 1], got {args.mfu}")
        if args.peak_tflops is not None and args.peak_tflops <= 0:
            raise ValueError(f"--peak-tflops must be > 0, got {args.peak_tflops}")
        try:
            coverages = tuple(float(c) for c in args.coverages.split(",") if c.strip())
        except ValueError:
            raise ValueError(f"--coverages takes numbers separated by commas, got "
                             f"{args.coverages!r}") from None
        device = clusters[0].device
        try:
            memory_gb = float(args.memory_gb) if args.memory_gb else device.memory_gb
        except ValueError:
            raise ValueError(f"--cluster takes one --memory-gb for every rank, got "
                             f"{args.memory_gb!r}") from None
        base = _search_base(args, clusters[0].world, comm_mb)
        options = tuple(t for t, _ in args.strategies) if args.strategies else OPTIONS
        rate = advisor_rate(base, clusters[0], mfu=args.mfu, peak_tflops=args.peak_tflops,
                            calibration=args.calibration)
        tables = advise(base, clusters, memory_gb=memory_gb, rate=rate,
                        coverages=coverages, options=options, overlap=not args.no_overlap)
        skipped = left_out(base, clusters[0].world, coverages, options)
    except ValueError as e:
        print(f"subnetdp plan: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps([{"cluster": c.describe(), "rate_flops": rate.flops,
                           "rate_source": rate.source, "rate_assumed": rate.assumed,
                           "memory_gb": memory_gb, "not_estimated": skipped,
                           "rows": [a.to_dict() for a in rows]}
                          for c, rows in zip(clusters, tables, strict=True)]))
        return 0
    print("\n\n".join(format_advice(rows, c, base, memory_gb=memory_gb, rate=rate,
                                    overlap=not args.no_overlap, skipped=skipped,
                                    memory_given=bool(args.memory_gb))
                       for c, rows in zip(clusters, tables, strict=True)))
    return 0


def run(args: argparse.Namespace) -> int:
    """Run ``subnetdp plan``; 0 on success, 2 on a user error (message on stderr)."""
    if args.cluster:
        return _advise(args)
    if args.save:
        from subnetdp.checkpoint.rundir import check_output

        try:
            check_output(args.save, sources=(args.plan_file,) if args.plan_file else ())
        except ValueError as e:
            print(f"subnetdp plan: error: {e}", file=sys.stderr)
            return 2
    if args.memory_gb is not None:
        return _budget(args)
    if given := _given(args, ESTIMATE_ONLY):
        print(f"subnetdp plan: error: {', '.join(given)} appl{'y' if len(given) > 1 else 'ies'}"
              " to the estimates (--memory-gb, --cluster); drop "
              f"{'them' if len(given) > 1 else 'it'}", file=sys.stderr)
        return 2
    strategy = get_strategy(args.strategy)
    recipe_costs = _recipe_costs(args)
    try:
        plan, recipe = plan_from_args(args, strategy, recipe_costs)
        if args.save:
            with open(args.save, "w") as f:
                f.write(plan.to_json() + "\n")
    except (PlanError, KeyError, ValueError, OSError) as e:
        # KeyError's str() adds quotes; its first argument is the message.
        msg = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
        print(f"subnetdp plan: error: {msg}", file=sys.stderr)
        return 2
    costs = None
    if recipe is not None and not strategy.neuron_level:
        costs = recipe_costs()
    rep = plan_report(plan, recipe, param_bytes=MASTER_BYTES[args.dtype],
                 optimizer_states=args.optimizer_states,
                 masking=strategy.cost_masking, costs=costs,
                 balance=args.balance if plan.scheme == "balanced" else None)
    rep["shrink"] = _shrink(args, strategy, recipe_costs, plan.world)
    rep["min_holders"] = args.min_holders
    try:
        rep["nodes"] = _nodes(args, plan, rep["shrink"])
    except PlanError as e:
        print(f"subnetdp plan: error: {e}", file=sys.stderr)
        return 2
    if args.check_schedule:
        schedules = plan_schedules(plan, fsdp=args.fsdp, neuron_level=strategy.neuron_level,
                                   backward_masked=strategy.backward_masked,
                                   prefetch=args.prefetch)
        try:
            check_schedule(schedules)
        except ScheduleError as e:
            print(f"subnetdp plan: error: {e}", file=sys.stderr)
            return 2
        rep["schedule"] = schedule_summary(schedules)
    if args.json:
        print(json.dumps(rep))
    else:
        print(format_table(rep) + ("\n" + format_costs(rep) if costs is not None else "")
              + (f"\n{rep['schedule']}" if "schedule" in rep else ""))
    return 0
