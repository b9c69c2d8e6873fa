"""Each option of a run is declared once (train/options.py, issue 43): the flag of every
command that takes it, its TOML key, its config.json key and its row of train/applies.py
all come from that one declaration, with the same name, type, default and help."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import pytest

from subnetdp.cli import build_parser
from subnetdp.commands.options import command_default, flag_arguments
from subnetdp.strategy import Composition, PlanSpec
from subnetdp.train.applies import ALWAYS, APPLIES, WHEN
from subnetdp.train.config import TrainConfig
from subnetdp.train.config_file import load_config_file
from subnetdp.train.options import SECTIONS, declared, default, flag, opt


def _parsers() -> dict[str, argparse.ArgumentParser]:
    """Every parser by its command: train, bench, plan's jobs (``plan budget``, ...)."""
    out = {}
    todo = [("", build_parser())]
    while todo:
        name, parser = todo.pop()
        for a in parser._actions:
            if isinstance(a, argparse._SubParsersAction):
                todo += [(f"{name} {n}".strip(), p) for n, p in a.choices.items()]
        out[name] = parser
    return out


PARSERS = _parsers()
COMMANDS = ["train", "bench", "plan show", "plan budget", "plan fit", "plan cluster"]
NAMES = [f.name for f in declared()]


def _flags(command: str) -> dict[str, argparse.Action]:
    """The parser's options that carry a declared option, by option name."""
    return {a.dest: a for a in PARSERS[command]._actions if a.dest in NAMES}


def test_every_option_has_a_section_help_and_an_applies_row() -> None:
    for f in declared():
        o = opt(f.name)
        assert o.section in SECTIONS and o.help.strip(), f.name
        assert (f.name in APPLIES) != (f.name in ALWAYS), f.name
        if f.name in APPLIES:  # the refusal's words are the declaration's
            assert APPLIES[f.name].where == o.where and APPLIES[f.name].when is WHEN[f.name]


@pytest.mark.parametrize("command", COMMANDS)
def test_each_commands_flag_is_the_declared_one(command: str) -> None:
    flags = _flags(command)
    assert flags, command
    for name, action in flags.items():
        assert command.split()[0] in opt(name).commands, (command, name)
        assert action.option_strings[0] == flag(name), (command, name)
        expect = flag_arguments(name, command)
        assert action.help.startswith(expect["help"]), (command, name)  # (+ old spelling)
        assert set(action.option_strings[1:]) <= set(opt(name).aliases) | {
            "--coverages"}, (command, name)  # plan cluster's old spelling of its list
        if getattr(action, "narrowed", False):
            continue  # a command that narrows the values (plan's SDP strategies)
        assert action.default == command_default(name, command) or (
            action.default == [] and isinstance(default(name), dict)), (command, name)
        assert action.type == expect.get("type"), (command, name)


def test_train_takes_every_declared_option() -> None:
    assert set(_flags("train")) == {n for n in NAMES if opt(n).flag != ""}
    assert {n for n in NAMES if opt(n).flag == ""} == {"config_version"}


def test_config_json_keys_are_the_declared_names(tmp_path: Path) -> None:
    """A run records every option under its declared name, and reads it back."""
    recorded = TrainConfig().resolved().to_dict()
    assert list(recorded) == NAMES
    f = tmp_path / "config.json"
    f.write_text(json.dumps(recorded))
    assert set(load_config_file(f)) == set(NAMES) - {"config_version", "resume", "overwrite"}


@pytest.mark.parametrize("name", [n for n in NAMES if n != "config_version"])
def test_toml_key_is_the_declared_name_and_type(name: str, tmp_path: Path) -> None:
    """The TOML key of each option, dashed or not, at the top or in its section's table,
    reads back its value with the declared type."""
    value = {int: 7, float: 0.25, str: "x", bool: True}.get(type(default(name)))
    if value is None or name in ("resume", "overwrite"):
        pytest.skip("lists, dicts and None defaults: test_config_file types them")
    section = opt(name).section
    for text in (f"{name.replace('_', '-')} = {json.dumps(value)}\n",
                 f"[{section}]\n{name} = {json.dumps(value)}\n"):
        f = tmp_path / "c.toml"
        f.write_text(text)
        read = load_config_file(f)
        assert read == {name: value} and type(read[name]) is type(default(name))


def test_sections_are_the_typed_values() -> None:
    """``strategy`` is ``Composition`` and ``plan`` is ``PlanSpec``: every field they share
    with the options has the declared default (PlanSpec's coverage: 1.0, a plan's own)."""
    for cls, section in ((Composition, "strategy"), (PlanSpec, "plan")):
        for f in dataclasses.fields(cls):
            if f.name in NAMES and f.name != "coverage":
                assert opt(f.name).section in (section, "plan"), f.name
                assert f.default == default(f.name), (cls.__name__, f.name)
    cfg = TrainConfig(coverage=0.25, fsdp=True)
    assert cfg.plan_spec.coverage == 0.25 and cfg.composition().fsdp
    assert cfg.section("plan")["coverage"] == 0.25


def test_bench_spec_is_built_from_the_run_sections() -> None:
    """``BenchSpec.of``: a run's ``Composition`` and ``PlanSpec`` plus a shape, field for
    field what a spec spelled out by hand holds."""
    from subnetdp.estimate.spec import BenchSpec

    cfg = TrainConfig(strategy="bb-sdp", coverage=0.75, min_holders=2, seed=3, zero=1,
                      dtype="bf16-mixed", bucket_cap_mb=5.0, refresh_every=2)
    spec = BenchSpec.of(cfg.strategy, cfg.composition(), cfg.plan_spec, recipe="llama-tiny",
                        world=4, batch=2, seq=32, model_args={"n_layers": 2}, comm_mem_mb=8.0)
    assert spec == BenchSpec(recipe="llama-tiny", strategy="bb-sdp", world=4, batch=2, seq=32,
                             coverage=0.75, min_holders=2, seed=3, zero=1, dtype="bf16-mixed",
                             bucket_cap_mb=5.0, refresh_every=2,
                             model_args=(("n_layers", 2),), comm_mem_mb=8.0)
