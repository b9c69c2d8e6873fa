"""Every configuration a run may be given resolves to the run main's code resolved
(tests/cli/replay_cases.py; the expectation was written from main's code before the options
were declared once): the TOML files of docs/ and tests/, config.json files of
config_version 1 and 2, and command lines over every train option."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from subnetdp.train.options import default
from tests.cli.replay_cases import EXPECTED, cases, config_json_cases, resolve

_EXPECTED = json.loads(EXPECTED.read_text())["resolved"]


def _all(tmp: Path) -> dict[str, list[str]]:
    return {**cases(tmp), **config_json_cases(tmp)}


def test_every_case_has_an_expectation(tmp_path: Path) -> None:
    """A new docs TOML block or test file needs its expectation (regenerate from main)."""
    assert set(_all(tmp_path)) == set(_EXPECTED)


@pytest.mark.parametrize("name", sorted(_EXPECTED))
def test_replays_as_before(name: str, tmp_path: Path) -> None:
    """The same run; an option added since holds its declared default (so it changes no
    earlier run)."""
    got = resolve(_all(tmp_path)[name])
    assert {k: got[k] for k in _EXPECTED[name]} == _EXPECTED[name]
    assert {k: v for k, v in got.items() if k not in _EXPECTED[name]} == {
        k: default(k) for k in got if k not in _EXPECTED[name]}
