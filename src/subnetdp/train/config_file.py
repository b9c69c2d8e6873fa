"""``subnetdp train --config FILE``: a run's options from a TOML file or a run's own
``config.json`` (or ``summary.json``), under the options given on the command line.

TOML keys are ``TrainConfig`` field names, with ``-`` or ``_`` (``batch-size = 8``), at the top
level, in a ``[train]`` table (not both for one key) or in their section's table (``[plan]
coverage = 0.5``: train.options.SECTIONS); ``[model_args]`` (beside ``[train]`` or as
``[train.model_args]``) holds the model overrides. Every value is checked against its
field's type (train/config_values.py) and an unknown key or table is refused, naming the
nearest option. A run's ``config.json`` records every resolved option and the real world size
(``nproc``), so ``--config runs/a/config.json --out runs/b`` replays run ``a``. A JSON file
without ``config_version`` (a run recorded before versions, or one written by hand) is read
when every version reads it alike, and refused, naming the values that differ, otherwise
(``_unversioned_problem``). A replay drops the file's ``resume`` and ``overwrite``, so it
trains from step 0 and never deletes a folder the command line did not ask to replace. A TOML
file setting either is refused: both act on a run folder and come from the command line only,
and ``--overwrite`` replaces only a folder that the command line names with ``--out``
(train_cmd.py), never one that a file names.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
from pathlib import Path
from typing import Any

from subnetdp.train.config import CONFIG_VERSION, TrainConfig, config_keys, upgrade_config
from subnetdp.train.config_values import check_field_values
from subnetdp.train.options import SECTIONS, declared, opt

# What a replayed run's config must not carry: they act on a folder, not on the training
REPLAY_DROPPED = ("resume", "overwrite")


def load_config_file(path: str | Path) -> dict[str, Any]:
    """The ``TrainConfig`` fields a config file sets, typed. Raises ``ValueError`` (one line,
    saying what to fix) for an unreadable file, an unknown key or table, or a wrong type."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise ValueError(f"--config {p}: no such file")
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--config {p} cannot be read ({e})") from None
    where = f"--config {p}"
    if p.suffix not in (".toml", ".json"):
        raise ValueError(f"--config {p}: use a .toml file or a run's config.json")
    if not text.strip():
        raise ValueError(f"{where} is empty: it sets no option; give a TOML file of train "
                         "options or a run's config.json")
    if p.suffix == ".toml":
        options = _known(_toml_options(_toml(text, p), where), where, toml=True)
        values = check_field_values(options, where=where)
        for name in REPLAY_DROPPED:  # a shared file must never replace or continue a run
            if name in values:
                raise ValueError(f"{where}: {name} acts on a run folder, so it is taken from "
                                 f"the command line only; drop it from the file and pass "
                                 f"--{name}{' RUN' if name == 'resume' else ''} there")
        # a hand-written file is in today's words unless it names its version
        return _upgraded(values, where) if "config_version" in values else values
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--config {p} is not valid JSON ({e})") from None
    if isinstance(data, dict) and isinstance(data.get("config"), dict):  # a summary.json
        data = data["config"]
    if not isinstance(data, dict):
        raise ValueError(f"--config {p} must hold a JSON object of train options")
    options = _known(data, where, toml=False)
    values = check_field_values(options, where=where, syntax="json")
    if "config_version" not in values:
        problem = _unversioned_problem(values)
        if problem:
            raise ValueError(f"{where} has no config_version, and {problem}")
    values = _upgraded(values, where)
    for name in REPLAY_DROPPED:
        values.pop(name, None)
    return values


def _unversioned_problem(values: dict[str, Any]) -> str | None:
    """What an unversioned file's ``values`` mean differently in version 1 (recorded runs
    before versions existed) and today's version, or None when both read them alike: only
    then is no version needed (a guess would silently change the run)."""
    old = upgrade_config({**values, "config_version": 1})
    now = {**values, "config_version": CONFIG_VERSION}
    differ = [k for k in sorted(values) if old[k] != now[k]]
    if not differ:
        return None
    readings = ", ".join(f"{k} {json.dumps(values[k])} is {json.dumps(old[k])} in version 1 "
                         f"(a run recorded before config_version existed) but "
                         f"{json.dumps(now[k])} in version {CONFIG_VERSION} (today's)"
                         for k in differ)
    return (f"{readings}; add \"config_version\": 1 or {CONFIG_VERSION} to the file to say "
            "which it means")


def _upgraded(values: dict[str, Any], where: str) -> dict[str, Any]:
    """``values`` in today's words (without ``config_version``: the current one is the
    default)."""
    try:
        values = upgrade_config(values)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    del values["config_version"]
    return values


def _toml_options(data: dict[str, Any], where: str) -> dict[str, Any]:
    """The options of a TOML document: its top-level keys, its ``[train]`` table's and its
    sections' (``[plan]``, ``[strategy]``, ...: train.options.SECTIONS), with
    ``[model_args]`` from either place."""
    train = data.get("train", {})
    if not isinstance(train, dict):
        raise ValueError(f"{where}: train must be a [train] table of options")
    top = _sections({k: v for k, v in data.items() if k != "train"}, where)
    both = sorted(set(map(_key, top)) & set(map(_key, train)))
    if both:
        raise ValueError(f"{where}: {', '.join(both)} set both at the top level and in [train]; "
                         "keep one")
    return {**top, **train}


def _sections(data: dict[str, Any], where: str) -> dict[str, Any]:
    """``data`` with each section's table (``[plan] coverage = 0.5``) read as its keys; a key
    in another section's table is refused, naming its own."""
    out = {k: v for k, v in data.items() if not (k in SECTIONS and isinstance(v, dict))}
    for section, table in data.items():
        if section not in out:
            for key, value in table.items():
                name = _key(key)
                own = opt(name).section if name in config_keys() else None
                if own != section:
                    is_in = f"belongs in [{own}]" if own else "is no option"
                    raise ValueError(f"{where}: [{section}] {key}: {key} {is_in}; the keys of "
                                     f"[{section}] are {', '.join(_in(section))}")
                if name in map(_key, out):
                    raise ValueError(f"{where}: {key} set both in [{section}] and outside it; "
                                     "keep one")
                out[key] = value
    return out


def _in(section: str) -> list[str]:
    return [f.name for f in declared() if opt(f.name).section == section]


def _known(data: dict[str, Any], where: str, *, toml: bool) -> dict[str, Any]:
    """``data`` with ``-`` in its keys read as ``_``; an unknown key is refused."""
    values = {_key(k): v for k, v in data.items()}
    names = [f.name for f in dataclasses.fields(TrainConfig)]
    for key in sorted(set(values) - set(names)):
        table = toml and isinstance(values[key], dict)
        what = f"table [{key}]" if table else f"option {key!r}"
        near = difflib.get_close_matches(key, [*names, "train"] if table else names, n=1)
        hint = f"did you mean {near[0]!r}?" if near else "see `subnetdp train --help`"
        layout = (" at the top level or in [train], and [model_args]" if toml else
                  ", as a run's config.json records them")
        raise ValueError(f"{where}: unknown {what} ({hint}); the keys are `subnetdp train` "
                         f"options (batch-size, strategy, ...){layout}")
    return values


def _key(name: object) -> str:
    return str(name).replace("-", "_")


def _toml(text: str, path: Path) -> dict[str, Any]:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib  # type: ignore[no-redef]
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"--config {path} is not valid TOML ({e})") from None


def merge_config(file_values: dict[str, Any], cli_values: dict[str, Any],
                 explicit: set[str]) -> dict[str, Any]:
    """The file's options under the command line's: an option given on the command line
    (``explicit``) wins; the parser's defaults do not override the file."""
    out = dict(cli_values)
    for key, value in file_values.items():
        if key not in explicit:
            out[key] = value
    return out
