"""What a unit becomes on a worker that does not hold it: a module with no parameters."""

from __future__ import annotations

from typing import Any

from torch import nn

from subnetdp.subnet.adapter import RemovedKind


class Passthrough(nn.Module):
    """A removed residual block: the identity on the residual stream (its first argument)."""

    def __init__(self, unit: str) -> None:
        super().__init__()
        self.unit = unit

    def forward(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        return x

    def extra_repr(self) -> str:
        return f"removed unit {self.unit!r}"


class ZeroBranch(nn.Module):
    """A removed residual branch: contributes nothing to ``branch(x) + shortcut(x)``.

    Returning the Python ``0`` (not a tensor) allocates nothing, and ``0 + t`` is ``t``.
    """

    def __init__(self, unit: str) -> None:
        super().__init__()
        self.unit = unit

    def forward(self, *args: Any, **kwargs: Any) -> int:
        return 0

    def extra_repr(self) -> str:
        return f"removed unit {self.unit!r}"


def removed_module(kind: RemovedKind, unit: str) -> nn.Module:
    if kind == "passthrough":
        return Passthrough(unit)
    if kind == "zero":
        return ZeroBranch(unit)
    raise ValueError(f"unknown removed-unit kind {kind!r}; use 'passthrough' or 'zero'")


def is_removed(module: nn.Module) -> bool:
    return isinstance(module, Passthrough | ZeroBranch)
