"""Plan files, read by one function for every command (``plan``, ``train``, ``bench``).

Two formats are accepted:

- a bare matrix ``[[1, 0, 1], [0, 1, 1]]``, one row per worker and one 0/1 column per unit
  (the units are the caller's: a model's blocks, or ``unit{i}`` of size 1);
- a JSON object with ``matrix`` and optionally ``units`` and ``shared_size``; a saved plan
  (``Plan.to_json``, ``subnetdp plan --save``) is such an object and keeps its scheme,
  coverage and seed.

Torch-free, like the rest of ``subnetdp.plan``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from subnetdp.plan.plan import Plan, PlanError, Unit, explicit_plan

__all__ = ["check_shape", "read_plan_file"]


def read_plan_file(path: str, *, units: Sequence[Unit] | None = None, shared_size: int = 0,
                   world: int | None = None) -> Plan:
    """The plan in ``path``, validated (once). ``units``/``shared_size``: those of a bare
    matrix (a file's own units win); ``world``: the number of workers that will run it."""
    data = _load(path)
    if isinstance(data, dict):
        if "matrix" not in data:
            raise PlanError(f"--plan-file {path}: expected a list of rows or an object with "
                            "'matrix'")
        if "world" in data and "units" in data:  # a saved plan: scheme, coverage, seed kept
            plan = Plan.from_dict(data)
        else:
            if "units" in data:
                units = [Unit(str(u["name"]), int(u["size"])) for u in data["units"]]
                shared_size = int(data.get("shared_size") or 0)
            plan = explicit_plan(data["matrix"], units, shared_size=shared_size)
    else:
        plan = explicit_plan(data, units, shared_size=shared_size)
    if world is not None and world != plan.world:
        plan.validate(world)  # raises: the message says how to rebuild it for ``world``
    return plan


def check_shape(plan: Plan, *, units: int | None = None, world: int | None = None) -> Plan:
    """``plan`` (read from a file), refused if the ``--units``/``--nproc`` given with it
    disagree with its columns or rows (``subnetdp plan``: no rebuilding, unlike ``world`` of
    ``read_plan_file``)."""
    if units is not None and units != plan.num_units:
        raise PlanError(f"--units {units} but the explicit matrix has {plan.num_units} "
                        "columns")
    if world is not None and world != plan.world:
        raise PlanError(
            f"--nproc {world} but the explicit matrix has {plan.world} rows (one per "
            "worker); drop --nproc or fix the matrix"
        )
    return plan


def _load(path: str) -> Any:
    try:
        with open(path) as f:
            return json.load(f)
    except OSError as e:
        raise PlanError(f"cannot read --plan-file {path}: {e.strerror}") from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise PlanError(f"--plan-file {path} is not valid JSON: {e}") from e
