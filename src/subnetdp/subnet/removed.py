"""What a unit becomes on a worker that does not hold it: a module with no parameters."""

from __future__ import annotations

import inspect
import re
import typing
from typing import Any

from torch import nn

from subnetdp.subnet.adapter import RemovedKind


class Passthrough(nn.Module):
    """A removed residual block: the identity on the residual stream.

    The stream is the first positional argument or, when the caller passes everything by
    keyword (``layer(hidden_states=h, ...)``), the keyword ``input_name``. With
    ``tuple_output`` the result is ``(x,)``, for callers that unpack ``layer(...)[0]`` (blocks
    whose forward returns a tuple, e.g. Hugging Face decoder layers before transformers 4.54).
    """

    def __init__(
        self, unit: str, *, input_name: str | None = None, tuple_output: bool = False
    ) -> None:
        super().__init__()
        self.unit, self.input_name, self.tuple_output = unit, input_name, tuple_output

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if args:
            x = args[0]
        elif self.input_name is not None and self.input_name in kwargs:
            x = kwargs[self.input_name]
        else:
            raise TypeError(
                f"removed unit {self.unit!r} was called without the residual stream: pass it "
                f"as the first positional argument"
                + (f" or as {self.input_name}=" if self.input_name else "")
            )
        return (x,) if self.tuple_output else x

    def extra_repr(self) -> str:
        return f"removed unit {self.unit!r}"


def passthrough_like(unit: str, block: nn.Module) -> Passthrough:
    """A ``Passthrough`` that follows ``block``'s calling convention: the name of its forward's
    first parameter (for keyword calls), and a 1-tuple result when its forward is annotated to
    return a tuple (``-> tuple[...]``/``Tuple[...]``); otherwise the stream itself."""
    try:
        params = list(inspect.signature(block.forward).parameters.values())
    except (TypeError, ValueError):  # no introspectable signature (e.g. a C extension)
        params = []
    first = next((p.name for p in params if p.kind in (p.POSITIONAL_ONLY,
                                                      p.POSITIONAL_OR_KEYWORD)), None)
    return Passthrough(unit, input_name=first, tuple_output=_returns_tuple(block))


def _returns_tuple(block: nn.Module) -> bool:
    forward = type(block).forward
    try:
        ret = typing.get_type_hints(forward).get("return")
    except Exception:  # unresolvable string annotations: fall back to the raw text
        ret = inspect.signature(forward).return_annotation
    if isinstance(ret, str):
        return re.match(r"^\s*(typing\.)?(tuple|Tuple)\b", ret) is not None
    return ret is tuple or typing.get_origin(ret) is tuple


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


def removed_module(kind: RemovedKind, unit: str, like: nn.Module | None = None) -> nn.Module:
    """The stand-in for ``unit``; ``like`` (the module it replaces) lets a passthrough follow
    that module's calling convention (see ``passthrough_like``)."""
    if kind == "passthrough":
        return Passthrough(unit) if like is None else passthrough_like(unit, like)
    if kind == "zero":
        return ZeroBranch(unit)
    raise ValueError(f"unknown removed-unit kind {kind!r}; use 'passthrough' or 'zero'")
