"""``subnetdp plan``: build a plan and print its diagnostics and per-worker bytes.

    subnetdp plan --world 8 --units 12 --coverage 0.5 [--scheme spread|random] [--seed S] [--json]
    subnetdp plan --world 8 --model llama-tiny --coverage 0.5 --save plan.json
    subnetdp plan --world 4 --model llama-tiny --strategy n-sdp --coverage 0.5 [--rotate]
    subnetdp plan --explicit matrix.json [--model NAME]

torch is imported only for ``--model`` (the model is built on the meta device: no memory).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from subnetdp.commands.options import add_neuron_arguments
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
    src.add_argument("--model", help="use this recipe's blocks as units, e.g. llama-tiny")
    p.add_argument("--coverage", type=float, help="fraction of units each worker holds, in (0, 1]")
    p.add_argument("--scheme", choices=["spread", "random"], help="default: spread")
    p.add_argument("--seed", type=int, default=0, help="seed of the random scheme (default 0)")
    p.add_argument("--strategy", choices=["b-sdp", "n-sdp", "bb-sdp", "nb-sdp"],
                   default="b-sdp",
                   help="units are blocks (b-sdp, bb-sdp) or neuron groups of every layer pair "
                        "(n-sdp, nb-sdp; needs --model); bb/nb: backward masking bytes")
    add_neuron_arguments(p)
    p.add_argument(
        "--explicit",
        metavar="FILE",
        help="JSON matrix [worker][unit] of 0/1 (or a saved plan) instead of a scheme",
    )
    p.add_argument(
        "--shared-size", type=int, default=0, help="shared parameter elements (with --units)"
    )
    p.add_argument("--param-bytes", type=int, default=4, help="bytes per element (default 4)")
    p.add_argument(
        "--optimizer-states", type=int, default=2, help="optimizer tensors per parameter (AdamW: 2)"
    )
    p.add_argument("--save", metavar="FILE", help="also write the plan as JSON to FILE")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    budget = p.add_argument_group("memory budget (subnetdp.bench.budget; needs --model, --world)")
    budget.add_argument("--memory-gb", type=float,
                        help="search strategies and coverages that fit in this many GB/worker")
    budget.add_argument("--batch", type=int, default=1, help="micro-batch per worker (default 1)")
    budget.add_argument("--seq", type=int, default=2048, help="sequence length (default 2048)")
    budget.add_argument("--dtype", choices=["fp32", "bf16", "bf16-mixed"], default="fp32",
                        help="bf16: pure; bf16-mixed: bf16 compute, fp32 master state")
    budget.add_argument("--fsdp", action="store_true",
                        help="compose SDP options with FSDP2 over each holder group")
    budget.add_argument("--ac", action="store_true",
                        help="compose SDP options with activation checkpointing")
    p.set_defaults(func=run)


def _model_units(name: str) -> tuple[list[Unit], int]:
    # Lazy: the plan command must stay usable (and fast) without building anything real.
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
        raise PlanError(f"cannot read --explicit {path}: {e.strerror}") from e
    except json.JSONDecodeError as e:
        raise PlanError(f"--explicit {path} is not valid JSON: {e}") from e
    if isinstance(data, dict):
        if "matrix" not in data:
            raise PlanError(
                f"--explicit {path}: expected a list of rows or an object with 'matrix'"
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

    if args.model is None or args.world is None or args.coverage is None:
        raise PlanError("--strategy n-sdp needs --model NAME, --world N and --coverage C")
    if args.explicit is not None:
        raise PlanError("--explicit does not combine with --strategy n-sdp; give the matrix "
                        "of a saved n-sdp plan to `train --plan-file` instead")
    recipe = get_recipe(args.model)
    with torch.device("meta"):
        model = recipe.build_model()
    return make_neuron_plan(model, recipe.adapter, world=args.world, coverage=args.coverage,
                            scheme=args.scheme or "spread", seed=args.seed,
                            groups=args.neuron_groups, kinds=args.neuron_kinds,
                            rotate=args.rotate)


def build_plan(args: argparse.Namespace) -> tuple[Plan, str | None]:
    """The plan the arguments describe, and the model name if one was used."""
    if getattr(args, "strategy", "b-sdp") in ("n-sdp", "nb-sdp"):
        return _neuron_plan(args), args.model
    units: int | list[Unit] | None = args.units
    shared = args.shared_size
    if args.model is not None:
        units, shared = _model_units(args.model)
    if args.explicit is not None:
        if args.coverage is not None or args.scheme is not None:
            raise PlanError("--coverage and --scheme do not apply with --explicit; drop them")
        matrix, file_units, file_shared = _load_explicit(args.explicit)
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
        return plan, args.model
    if units is None:
        raise PlanError("give --units N or --model NAME (or --explicit FILE)")
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
    return plan, args.model


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


def run(args: argparse.Namespace) -> int:
    """Run ``subnetdp plan``; 0 on success, 2 on a user error (message on stderr)."""
    if getattr(args, "memory_gb", None) is not None:
        from subnetdp.bench.budget import run_budget

        return run_budget(args)
    try:
        plan, model = build_plan(args)
        if args.save:
            with open(args.save, "w") as f:
                f.write(plan.to_json() + "\n")
    except (PlanError, KeyError, ValueError, OSError) as e:
        # KeyError's str() adds quotes; its first argument is the message.
        msg = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
        print(f"subnetdp plan: error: {msg}", file=sys.stderr)
        return 2
    masking = "backward" if args.strategy in ("bb-sdp", "nb-sdp") else "forward"
    rep = report(plan, model, param_bytes=args.param_bytes,
                 optimizer_states=args.optimizer_states, masking=masking)
    print(json.dumps(rep) if args.json else format_table(rep))
    return 0
