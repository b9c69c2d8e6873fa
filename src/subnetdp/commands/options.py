"""Command-line options shared by the subcommands: one definition (name, type, meaning) each.

The options of a run are declared in ``train.options`` (each once: name, type, default, help,
section); ``add_declared`` makes a command's flags from those declarations, one ``--help``
group per section. What is left here are the options of commands that no run has.

Kept torch-free: ``plan`` imports it and must not load torch (``strategy`` is torch-free).
"""

from __future__ import annotations

import argparse
import json
import sys
import types
import typing
from collections.abc import Callable, Collection
from typing import Any

from subnetdp.strategy import parse_label
from subnetdp.train.options import (
    DEVICES,
    SECTIONS,
    Opt,
    declared,
    default,
    flag,
    opt,
    option_types,
)

# argparse's common base of parsers, argument groups and mutually exclusive groups
Container = argparse._ActionsContainer


class HelpFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default, unless the help already names one or there
    is none to show (None, a flag's False/True, an empty list)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if ("default" in text or default is None or default is argparse.SUPPRESS
                or isinstance(default, bool) or default == []):
            return text
        return f"{text} (default: %(default)s)"


def old_name(old: str) -> str:
    """The help note of a spelling kept for one release (CHANGELOG, Unreleased)."""
    return f" ({old}: the old spelling, kept for one release)"


def renamed(base: type[argparse.Action], old: frozenset[str]) -> type[argparse.Action]:
    """``base`` that says, in one line on stderr, the new spelling when an ``old`` one is
    given (the option still works)."""
    class Renamed(base):  # type: ignore[valid-type,misc]
        def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                     values: Any, option_string: str | None = None) -> None:
            if option_string in old:
                print(f"{parser.prog}: {option_string} is now {self.option_strings[0]} (the "
                      "old spelling works for one release)", file=sys.stderr)
            super().__call__(parser, namespace, values, option_string)
    return Renamed


_ACTIONS: dict[str, type[argparse.Action]] = {
    "store": argparse._StoreAction, "store_true": argparse._StoreTrueAction,
    "store_false": argparse._StoreFalseAction, "append": argparse._AppendAction}


def add_alias(p: Container, *flags: str, old: Collection[str], action: str = "store",
              **kw: Any) -> argparse.Action:
    """``p.add_argument(*flags, *old, ...)`` whose ``old`` spellings print the new one."""
    return p.add_argument(*flags, *old, action=renamed(_ACTIONS[action], frozenset(old)),
                          help=kw.pop("help") + old_name("/".join(old)), **kw)


def add_declared(p: Container, command: str, names: Collection[str] | None = None, *,
                 groups: dict[str, Container] | None = None,
                 narrow: dict[str, dict[str, Any]] | None = None) -> dict[str, Container]:
    """The flags of ``command`` (``train``, ``plan``, ``plan budget``, ``bench``, ...) made
    from the declarations of ``train.options``: every option whose ``commands`` holds the
    command's first word (or only ``names``), in one ``--help`` group per section (``groups``:
    those made so far, returned with the new ones). ``narrow``: a command's own ``type`` or
    ``choices`` for an option whose values it narrows (``plan``'s SDP strategies)."""
    groups = {} if groups is None else groups
    for f in declared():
        o: Opt = f.metadata["opt"]
        if o.flag == "" or command.split()[0] not in o.commands or (
                names is not None and f.name not in names):
            continue
        if o.section not in groups:
            groups[o.section] = p.add_argument_group(SECTIONS[o.section])
        own = (narrow or {}).get(f.name, {})
        kw = {**flag_arguments(f.name, command), **own}
        old = kw.pop("aliases")
        if old:
            action = add_alias(groups[o.section], flag(f.name), old=old, **kw)
        else:
            action = groups[o.section].add_argument(flag(f.name), **kw)
        action.narrowed = bool(own)  # type: ignore[attr-defined]  # (test_declared_once)
    return groups


def command_default(name: str, command: str) -> Any:
    """Option ``name``'s default in ``command`` (its ``Opt.defaults``, else the field's)."""
    own = opt(name).defaults
    for key in (command, command.split()[0]):
        if key in own:
            return own[key]
    return default(name)


def flag_arguments(name: str, command: str) -> dict[str, Any]:
    """``add_argument``'s keywords for option ``name`` in ``command`` (and ``aliases``)."""
    o = opt(name)
    value = command_default(name, command)
    if isinstance(value, dict):  # --model-arg KEY=VALUE, once per key: the texts, in a list
        value = []
    note = f" (default: {o.default_note})" if value is None and o.default_note else ""
    kw: dict[str, Any] = {"dest": name, "default": value, "help": o.help + note,
                          "aliases": o.aliases}
    kind = _kind(name)
    if kind is bool:
        kw["action"] = "store_false" if default(name) is True else "store_true"
        return kw
    kw["action"] = "append" if o.repeat else "store"
    if o.metavar:
        kw["metavar"] = o.metavar
    if o.choices:
        kw["choices"] = o.choices
    parse: Callable[[str], Any] | None = o.parse or (kind if kind in (int, float) else None)
    if parse is not None:
        kw["type"] = parse
    return kw


def _kind(name: str) -> Any:
    """The option's value type: its annotation without ``| None``."""
    hint = option_types()[name]
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    return typing.get_origin(hint) or hint


def parse_model_arg(text: str) -> tuple[str, object]:
    """``KEY=VALUE`` -> (key, the value as JSON if it parses, else the string)."""
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise ValueError(f"--model-arg expects KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(raw)
    except json.JSONDecodeError:
        return key, raw


def add_device_argument(p: Container, *, default: str | None, help: str) -> None:
    """``--device``: the same three choices everywhere; auto = CUDA when available."""
    p.add_argument("--device", default=default, choices=DEVICES,
                   help=f"{help} (auto: CUDA when available)")


def strategy_label(text: str) -> str:
    """A ``--strategy`` label (``fsdp+ac``, ``b-sdp+fsdp``), checked."""
    return _label(text)[0]


def strategy_list(text: str) -> list[str]:
    """A comma-separated ``--strategies`` value, each entry checked like ``--strategy``."""
    return [strategy_label(s.strip()) for s in text.split(",") if s.strip()]


def searched_strategy_list(text: str) -> list[tuple[str, str | None]]:
    """``plan --memory-gb --strategies``: each entry checked like ``--strategy``, with the
    name of its strategy when that is an SDP one (the command refuses composed SDP labels)."""
    return [_label(s.strip()) for s in text.split(",") if s.strip()]


def _label(text: str) -> tuple[str, str | None]:
    """``text`` checked, and the name of its strategy when that is an SDP one."""
    try:
        strategy = parse_label(text)[0]
    except ValueError as e:  # argparse shows an ArgumentTypeError's message as is
        raise argparse.ArgumentTypeError(str(e)) from None
    return text, strategy.name if strategy.is_sdp else None
