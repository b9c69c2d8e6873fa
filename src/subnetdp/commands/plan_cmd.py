"""``subnetdp plan``: build a plan and print its diagnostics and per-worker bytes.

    subnetdp plan --world 8 --units 12 --coverage 0.5 [--scheme spread|random] [--seed S] [--json]
    subnetdp plan --world 8 --recipe llama-tiny --coverage 0.5 --save plan.json
    subnetdp plan --world 4 --recipe llama-tiny --strategy n-sdp --coverage 0.5 [--rotate]
    subnetdp plan --plan-file matrix.json [--recipe NAME]
    subnetdp plan --world 8 --recipe llama-1b --memory-gb 40 [--batch-size 1 --seq-len 2048]

torch is imported only where a model is built (``--recipe``, ``--memory-gb``; on the meta
device: no memory); ``--units`` and ``--plan-file`` alone need only ``subnetdp.plan``.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from subnetdp.commands.options import (
    add_batch_arguments,
    add_composition_arguments,
    add_dtype_argument,
    add_neuron_arguments,
    add_plan_file_argument,
    add_recipe_argument,
    add_strategy_argument,
)
from subnetdp.plan import (
    Plan,
    PlanError,
    Unit,
    diagnostics,
    explicit_plan,
    make_plan,
    units_for_coverage,
    worker_bytes,
)
from subnetdp.strategy import MASTER_BYTES, get_strategy


def add_parser(subparsers: Any) -> None:
    """Add the ``plan`` subcommand to an argparse ``add_subparsers()`` object."""
    p = subparsers.add_parser(
        "plan",
        help="build a plan (who holds which unit) and show its coverage, diagnostics and bytes",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    p.add_argument("--world", type=int, help="number of workers N")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--units", type=int, help="number of units U (each of size 1 by default)")
    add_recipe_argument(src, default=None,
                        help="use this recipe's blocks (or neuron groups) as units, e.g. "
                             "llama-tiny")
    p.add_argument("--coverage", type=float, help="fraction of units each worker holds, in (0, 1]")
    p.add_argument("--scheme", choices=["spread", "random"], help="default: spread")
    p.add_argument("--seed", type=int, default=0, help="seed of the random scheme (default 0)")
    add_strategy_argument(p, default="b-sdp", sdp_only=True,
                          note="units are blocks (b-sdp, bb-sdp) or the neuron groups of "
                               "every layer pair (n-sdp, nb-sdp; needs --recipe); bb/nb: "
                               "backward masking's bytes")
    add_neuron_arguments(p)
    add_plan_file_argument(
        p, help="a JSON matrix [worker][unit] of 0/1, or a saved plan, instead of a scheme")
    p.add_argument(
        "--shared-size", type=int, default=0, help="shared parameter elements (with --units)"
    )
    add_dtype_argument(p)
    p.add_argument(
        "--optimizer-states", type=int, default=2, help="optimizer tensors per parameter (AdamW: 2)"
    )
    p.add_argument("--save", metavar="FILE", help="also write the plan as JSON to FILE")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    budget = p.add_argument_group(
        "memory budget (subnetdp.bench.budget; needs --recipe, --world)",
        "--fsdp/--ac compose the SDP options; the baselines are listed by name (fsdp+ac, ...)")
    budget.add_argument("--memory-gb", type=float,
                        help="search strategies and coverages that fit in this many GB/worker")
    add_batch_arguments(budget, batch_size=1, seq_len=2048, default_note="default %(default)s")
    add_composition_arguments(budget)
    p.set_defaults(func=run)


def _model_units(name: str) -> tuple[list[Unit], int]:
    # Lazy: only a recipe needs torch; --units and --plan-file stay fast without it.
    import torch

    from subnetdp.models import get_recipe
    from subnetdp.subnet.units import describe_units

    recipe = get_recipe(name)
    with torch.device("meta"):
        model = recipe.build_model()
    return describe_units(model, recipe.adapter)


def _load_explicit(path: str) -> tuple[list[list[Any]], list[Unit] | None, int | None]:
    """(matrix, units, shared_size) from a bare matrix or a plan file; units None if absent."""
    try:
        with open(path) as f:
            data = json.load(f)
    except OSError as e:
        raise PlanError(f"cannot read --plan-file {path}: {e.strerror}") from e
    except json.JSONDecodeError as e:
        raise PlanError(f"--plan-file {path} is not valid JSON: {e}") from e
    if isinstance(data, dict):
        if "matrix" not in data:
            raise PlanError(
                f"--plan-file {path}: expected a list of rows or an object with 'matrix'"
            )
        units = None
        if "units" in data:
            units = [Unit(str(u["name"]), int(u["size"])) for u in data["units"]]
        return data["matrix"], units, data.get("shared_size")
    return data, None, None


def _neuron_plan(args: argparse.Namespace) -> Plan:
    import torch

    from subnetdp.models import get_recipe
    from subnetdp.subnet.neurons import make_neuron_plan

    if args.recipe is None or args.world is None or args.coverage is None:
        raise PlanError(f"--strategy {args.strategy} needs --recipe NAME, --world N and "
                        "--coverage C")
    if args.plan_file is not None:
        raise PlanError(f"--plan-file does not combine with --strategy {args.strategy} (its "
                        "units are the recipe's neuron groups); give the saved plan to "
                        "`train --plan-file` instead")
    recipe = get_recipe(args.recipe)
    with torch.device("meta"):
        model = recipe.build_model()
    return make_neuron_plan(model, recipe.adapter, world=args.world, coverage=args.coverage,
                            scheme=args.scheme or "spread", seed=args.seed,
                            groups=args.neuron_groups, kinds=args.neuron_kinds,
                            rotate=args.rotate)


def build_plan(args: argparse.Namespace) -> tuple[Plan, str | None]:
    """The plan the arguments describe, and the recipe name if one was used."""
    if get_strategy(args.strategy).neuron_level:
        return _neuron_plan(args), args.recipe
    units: int | list[Unit] | None = args.units
    shared = args.shared_size
    if args.recipe is not None:
        units, shared = _model_units(args.recipe)
    if args.plan_file is not None:
        if args.coverage is not None or args.scheme is not None:
            raise PlanError("--coverage and --scheme do not apply with --plan-file; drop them")
        matrix, file_units, file_shared = _load_explicit(args.plan_file)
        width = len(matrix[0]) if matrix and isinstance(matrix[0], list) else 0
        if isinstance(units, int):
            if units != width:
                raise PlanError(f"--units {units} but the explicit matrix has {width} columns")
            units = None
        if units is None and file_units is not None:
            units, shared = file_units, file_shared or 0
        plan = explicit_plan(matrix, units, shared_size=shared)
        if args.world is not None and args.world != plan.world:
            raise PlanError(
                f"--world {args.world} but the explicit matrix has {plan.world} rows (one per "
                "worker); drop --world or fix the matrix"
            )
        return plan, args.recipe
    if units is None:
        raise PlanError("give --units N or --recipe NAME (or --plan-file FILE)")
    if args.world is None:
        raise PlanError("give --world N, the number of workers")
    if args.coverage is None:
        raise PlanError("give --coverage C in (0, 1], the fraction of units each worker holds")
    plan = make_plan(
        world=args.world,
        units=units,
        coverage=args.coverage,
        scheme=args.scheme or "spread",
        seed=args.seed,
        shared_size=shared,
    )
    return plan, args.recipe


def report(
    plan: Plan, model: str | None, *, param_bytes: int, optimizer_states: int,
    masking: str = "forward",
) -> dict:
    """Everything ``subnetdp plan`` prints, JSON-ready."""
    out = diagnostics(plan)
    if plan.coverage is not None:
        # Neuron-level units are named "pair[g]" and k applies per layer pair.
        first = plan.units[0].name.partition("[")[0]
        per_layer = [u for u in plan.units if u.name.partition("[")[0] == first]
        n = len(per_layer) if plan.units[0].name.endswith("]") else plan.num_units
        out["k"] = n if plan.coverage >= 1 else units_for_coverage(plan.coverage, n)
        out["units_per_layer"] = n
    out["model"] = model
    out["shared_size"] = plan.shared_size
    out["unit_names"] = [u.name for u in plan.units]
    out["unit_sizes"] = plan.unit_sizes
    out["bytes_per_worker"] = [
        worker_bytes(
            plan, i, param_bytes=param_bytes, optimizer_states=optimizer_states, masking=masking
        ).to_dict()
        for i in range(plan.world)
    ]
    return out


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
        f"connected {'yes' if rep['connected'] else 'NO'}   holder sets {rep['holder_sets']}",
        f"{'worker':>6}  {'units held':<20}  {'unit cov':>8}  {'param cov':>9}  {'payload MB':>10}",
    ]
    for i, held in enumerate(rep["assignment"]):
        mb = rep["bytes_per_worker"][i]["allreduce_payload"] / 1e6
        lines.append(
            f"{i:>6}  {_ranges(held):<20}  {rep['unit_coverage'][i]:>8.3f}  "
            f"{rep['param_coverage'][i]:>9.3f}  {mb:>10.3f}"
        )
    return "\n".join(lines)


def _budget(args: argparse.Namespace) -> int:
    """``--memory-gb``: the strategies and coverages that fit (``bench.budget.plan_budget``)."""
    from subnetdp.bench.budget import format_options, plan_budget
    from subnetdp.bench.strategies import BenchSpec

    try:
        if args.recipe is None or args.world is None:
            raise ValueError("--memory-gb needs --recipe NAME and --world N")
        base = BenchSpec(recipe=args.recipe, strategy="ddp", world=args.world,
                         batch=args.batch_size, seq=args.seq_len, dtype=args.dtype)
        options = plan_budget(base, args.memory_gb, fsdp=args.fsdp, ac=args.ac)
    except ValueError as e:
        print(f"subnetdp plan: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"memory_gb": args.memory_gb, "options": [o.to_dict() for o in options]}))
    else:
        print(format_options(options, base, args.memory_gb))
    return 0


def run(args: argparse.Namespace) -> int:
    """Run ``subnetdp plan``; 0 on success, 2 on a user error (message on stderr)."""
    if args.memory_gb is not None:
        return _budget(args)
    try:
        plan, recipe = build_plan(args)
        if args.save:
            with open(args.save, "w") as f:
                f.write(plan.to_json() + "\n")
    except (PlanError, KeyError, ValueError, OSError) as e:
        # KeyError's str() adds quotes; its first argument is the message.
        msg = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
        print(f"subnetdp plan: error: {msg}", file=sys.stderr)
        return 2
    rep = report(plan, recipe, param_bytes=MASTER_BYTES[args.dtype],
                 optimizer_states=args.optimizer_states,
                 masking=get_strategy(args.strategy).cost_masking)
    print(json.dumps(rep) if args.json else format_table(rep))
    return 0
