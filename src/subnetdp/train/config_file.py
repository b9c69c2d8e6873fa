"""``subnetdp train --config FILE``: a run's options from a TOML file or a run's own
``config.json`` (or ``summary.json``), under the options given on the command line.

TOML keys are ``TrainConfig`` field names, with ``-`` or ``_`` (``batch-size = 8``), at the top
level or in a ``[train]`` table; ``[model_args]`` (or ``[train.model_args]``) holds the model
overrides. A run's ``config.json`` records every resolved option and the real world size
(``nproc``), so ``--config runs/a/config.json --out runs/b`` replays run ``a``; its ``resume``
is dropped (a replay trains from step 0).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from subnetdp.train.config import TrainConfig


def load_config_file(path: str | Path) -> dict[str, Any]:
    """The ``TrainConfig`` fields a config file sets. Raises ``ValueError`` (one line, saying
    what to fix) for an unreadable file or an unknown key."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise ValueError(f"--config {p}: no such file")
    text = p.read_text(encoding="utf-8")
    if p.suffix == ".toml":
        data = _toml(text, p)
        data = dict(data.get("train", data))
    elif p.suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--config {p} is not valid JSON ({e})") from None
        if isinstance(data, dict) and isinstance(data.get("config"), dict):  # a summary.json
            data = data["config"]
        if not isinstance(data, dict):
            raise ValueError(f"--config {p} must hold a JSON object of train options")
        data.pop("resume", None)
    else:
        raise ValueError(f"--config {p}: use a .toml file or a run's config.json")
    values = {str(k).replace("-", "_"): v for k, v in data.items()}
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    unknown = sorted(set(values) - fields)
    if unknown:
        raise ValueError(f"--config {p}: unknown option(s) {', '.join(unknown)}; the keys are "
                         f"`subnetdp train` options, e.g. batch-size, strategy, model_args")
    return values


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
