"""Typed values of ``TrainConfig`` fields read from a file (TOML or JSON).

The command line types every option through argparse; a file's values arrive as whatever TOML
or JSON made of them, so each is checked here against its field's annotation before it reaches
``TrainConfig``: a string is never a number or a flag (``overwrite = "no"`` is not true), a
bool is never a number (``steps = true`` is not 1), a list is a list (``data_files =
"corpus.jsonl"`` is refused, not read per character). Ranges are then checked by
``TrainConfig.validate``, with the command line's own messages.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from typing import Any

from subnetdp.train.config import TrainConfig
from subnetdp.train.options import option_types

__all__ = ["check_field_values", "field_types"]


def field_types() -> dict[str, Any]:
    """Each ``TrainConfig`` field's annotation, resolved."""
    return dict(option_types())


def check_field_values(values: dict[str, Any], *, where: str,
                       syntax: str = "toml") -> dict[str, Any]:
    """``values`` (field name -> value from a file) with each value checked against its field's
    type; ints are accepted where a float is meant. Raises ``ValueError`` (one line naming
    ``where``, the key and how to write it in ``syntax``: toml or json) for a value of another
    type."""
    types_ = field_types()
    defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
    out = {}
    for name, value in values.items():
        try:
            out[name] = _typed(value, types_[name])
        except TypeError as e:
            kind, item = e.args
            # one item of a list's type (eval_tasks = "arc_easy"): that item, in brackets
            meant = ([value] if kind is list and _is(value, item)
                     else _meant(value, defaults[name]))
            example = _example(kind, item, meant, syntax)
            sep = " = " if syntax == "toml" else '": '
            key = name if syntax == "toml" else f'"{name}'
            what = f"a list of {_PLURAL[item]}" if kind is list else _WHAT[kind]
            raise ValueError(f"{where}: {name} = {_show(value)} is not {what}; "
                             f"write {key}{sep}{example}") from None
    return out


def _typed(value: Any, hint: Any) -> Any:
    """``value`` as a ``hint``; ``TypeError(origin, element type)`` if it is not one."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):  # X | None
        if value is None and type(None) in args:
            return None
        rest = [a for a in args if a is not type(None)]
        if len(rest) != 1:  # a union of several kinds: TrainConfig decodes it itself
            return value
        hint = rest[0]
        args = typing.get_args(hint)
    origin = typing.get_origin(hint) or hint
    if origin not in _WHAT and origin is not list:  # a value type TrainConfig decodes itself
        return value
    if origin is bool and isinstance(value, bool):
        return value
    if origin is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if origin is float and isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if origin is str and isinstance(value, str):
        return value
    if origin is list and isinstance(value, list):
        try:
            return [_typed(v, args[0]) for v in value]
        except TypeError:
            raise TypeError(list, args[0]) from None
    if origin is dict and isinstance(value, dict):
        return {str(k): v for k, v in value.items()}
    raise TypeError(origin, args[0] if args else None)


def _is(value: Any, hint: Any) -> bool:
    """Whether ``value`` is a ``hint`` as ``_typed`` reads it."""
    try:
        _typed(value, hint)
    except TypeError:
        return False
    return True


def _show(value: Any) -> str:
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


def _meant(value: Any, default: Any) -> Any:
    """What a quoted or fractional number most likely meant (``"6"``, ``6.0`` -> 6), else
    ``default``."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        for kind in (int, float):
            try:
                return kind(value)
            except ValueError:
                pass
    return default


def _example(origin: type, item: type | None, default: Any, syntax: str) -> str:
    """How to write a value of type ``origin`` (a list of ``item``) in ``syntax``."""
    if origin is bool:
        return "true or false (no quotes)"
    if origin is float and isinstance(default, int) and not isinstance(default, bool):
        default = float(default)
    if isinstance(default, origin) and not isinstance(default, bool) and default != "":
        value: Any = default
    else:
        items: dict[Any, list[Any]] = {str: ["corpus.jsonl"], int: [1, 2]}
        value = {int: 6, float: 0.5, str: "text", dict: {"width": 16},
                 list: items.get(item, [1.0, 0.5])}[origin]
    if syntax == "json" or not isinstance(value, dict):
        text = json.dumps(value)
    else:
        text = "{ " + ", ".join(f"{k} = {json.dumps(v)}" for k, v in value.items()) + " }"
    return text + (" (brackets, even for one)" if origin is list else "")


_WHAT = {bool: "true or false", int: "a whole number", float: "a number", str: "a string",
         dict: "a table of model arguments"}
_PLURAL = {str: "strings", int: "whole numbers", float: "numbers"}
