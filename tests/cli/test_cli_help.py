"""The command line: every option explained with its default, --version, one vocabulary with
the old spellings kept as aliases (issue 28, item 15)."""

from __future__ import annotations

import argparse

import pytest

import subnetdp
from subnetdp.cli import build_parser, main


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def _options(p: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in p._actions if not isinstance(a, argparse._HelpAction)]


@pytest.mark.parametrize("command", sorted(_subparsers()))
def test_every_option_has_help_and_shows_its_default(command: str) -> None:
    p = _subparsers()[command]
    formatter = p._get_formatter()
    for action in _options(p):
        name = action.option_strings[0] if action.option_strings else action.dest
        assert action.help and action.help.strip(), f"{command} {name} has no help"
        shown = formatter._expand_help(action)
        default = action.default
        if default is None or isinstance(default, bool) or default in ([], argparse.SUPPRESS):
            continue  # nothing to show (a flag, "the recipe's" said in words, an action
            # that prints and exits, as --help and --list-tasks)
        value = f"{default:g}" if isinstance(default, float) else str(default)
        assert "default" in shown and (value in shown or str(default) in shown), \
            f"{command} {name}: the help does not show its default {default!r}: {shown!r}"


def test_train_options_are_grouped_by_section() -> None:
    from subnetdp.train.options import SECTIONS

    p = _subparsers()["train"]
    groups = {g.title: [a.dest for a in g._group_actions] for g in p._action_groups}
    assert set(SECTIONS.values()) <= set(groups)
    assert "steps" in groups["schedule"] and "lr" in groups["optimizer"]
    assert "out" in groups["run folder and launch"]
    assert "coverage" in groups["plan (strategy.PlanSpec)"]
    # nothing left in the flat list but -h
    assert groups["options"] == ["help"]


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"subnetdp {subnetdp.__version__}"


# (command line with the new spelling, the same with the old one, the dest they set)
ALIASES = [
    (["plan", "--nproc", "4", "--units", "8"], ["plan", "--world", "4", "--units", "8"],
     "nproc"),
    (["bench", "memory", "--nproc", "2"], ["bench", "memory", "--world", "2"], "nproc"),
    (["plan", "--units", "8", "--out", "p.json"], ["plan", "--units", "8", "--save", "p.json"],
     "save"),
    (["demo", "--runs", "x"], ["demo", "--out", "x"], "out"),
    (["compare", "--subset", "llama"], ["compare", "--tasks", "llama"], "tasks"),
]


@pytest.mark.parametrize(("new", "old", "dest"), ALIASES)
def test_old_spellings_parse_to_the_new_options(new: list[str], old: list[str],
                                                dest: str) -> None:
    parser = build_parser()
    a, b = vars(parser.parse_args(new)), vars(parser.parse_args(old))
    assert a == b and a[dest] not in (None, 8, "runs/demo")


def test_device_has_the_same_choices_everywhere() -> None:
    for command in ("train", "eval", "bench"):
        (device,) = [a for a in _options(_subparsers()[command]) if a.dest == "device"]
        assert tuple(device.choices or ()) == ("auto", "cpu", "cuda"), command
