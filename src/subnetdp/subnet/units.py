"""Reading a model's units and sizes through its adapter (works on the meta device)."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from subnetdp.plan import Unit
from subnetdp.subnet.adapter import UnitAdapter


def unit_modules(model: nn.Module, adapter: UnitAdapter) -> list[tuple[str, nn.Module]]:
    """The model's units as ``(qualified name, module)`` in forward order."""
    paths = adapter.unit_paths(model)
    if not paths:
        raise ValueError(
            f"{type(model).__name__} declares no units: its adapter's unit_paths returned an "
            "empty list. Give the adapter the residual blocks (or branches) to distribute."
        )
    if len(set(paths)) != len(paths):
        raise ValueError(f"the adapter lists a unit twice: {paths}")
    for a in paths:
        for b in paths:
            if a != b and b.startswith(a + "."):
                raise ValueError(f"unit {b!r} is nested inside unit {a!r}; units must be disjoint")
    return [(p, model.get_submodule(p)) for p in paths]


def unit_index(name: str, unit_names: Sequence[str]) -> int | None:
    """The unit a parameter/buffer/state key belongs to (by qualified-name prefix), or None
    when it is shared."""
    for i, unit in enumerate(unit_names):
        if name.startswith(unit + "."):
            return i
    return None


def describe_units(model: nn.Module, adapter: UnitAdapter) -> tuple[list[Unit], int]:
    """The plan's view of a model: its units with parameter counts, and the shared size.

    Sizes are numbers of parameter elements (not bytes); shared = everything outside units.
    """
    units = [
        Unit(name=name, size=sum(p.numel() for p in mod.parameters()))
        for name, mod in unit_modules(model, adapter)
    ]
    total = sum(p.numel() for p in model.parameters())
    return units, total - sum(u.size for u in units)
