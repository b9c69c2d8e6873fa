"""``subnetdp train --config FILE``: TOML layouts, unknown keys and tables, typed values, the
version of a run's config.json, and a replay that never carries overwrite or resume."""

from __future__ import annotations

import argparse
import dataclasses
import json
import types
import typing
from pathlib import Path
from typing import Any

import pytest

from subnetdp.checkpoint.rundir import check_fresh
from subnetdp.cli import main
from subnetdp.commands.train_cmd import add_parser, config_from_args
from subnetdp.train.config import TrainConfig
from subnetdp.train.config_file import load_config_file


def _args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["train", *argv])
    args.argv = argv
    return args


@pytest.fixture
def no_launch(monkeypatch: pytest.MonkeyPatch) -> list[TrainConfig]:
    """``subnetdp train`` resolves and validates its config, then stops before any work."""
    seen: list[TrainConfig] = []

    def fake(cfg: TrainConfig, **_: Any) -> dict[str, Any]:
        seen.append(cfg.resolved())
        return {}

    monkeypatch.setattr("subnetdp.train.run.run_training", fake)
    return seen


def _cli(capsys: pytest.CaptureFixture[str], path: Path, *argv: str) -> tuple[int, str]:
    code = main(["train", "--config", str(path), *argv])
    return code, capsys.readouterr().err


# -- layout: issue 28 item 4 ------------------------------------------------------------------
def test_model_args_table_beside_train_table_is_kept(tmp_path: Path) -> None:
    """The README's form: a [train] table with a top-level [model_args] beside it (dropped on
    40e75c9)."""
    f = tmp_path / "c.toml"
    f.write_text('[train]\nrecipe = "llama-tiny"\nsteps = 7\n\n[model_args]\nn_layers = 2\n')
    cfg = config_from_args(_args(["--config", str(f)]))
    assert cfg.steps == 7 and cfg.model_args == {"n_layers": 2}


def test_flat_keys_with_model_args_table(tmp_path: Path) -> None:
    f = tmp_path / "c.toml"
    f.write_text('recipe = "llama-tiny"\nbatch-size = 3\n[model_args]\nn_layers = 2\n')
    cfg = config_from_args(_args(["--config", str(f)]))
    assert cfg.batch_size == 3 and cfg.model_args == {"n_layers": 2}


def test_top_level_keys_beside_train_table_are_kept(tmp_path: Path) -> None:
    f = tmp_path / "c.toml"
    f.write_text('steps = 5\n[train]\nrecipe = "llama-tiny"\n')
    assert load_config_file(f) == {"steps": 5, "recipe": "llama-tiny"}
    f.write_text('steps = 5\n[train]\nsteps = 6\n')
    with pytest.raises(ValueError, match=r"steps set both at the top level and in \[train\]"):
        load_config_file(f)


def test_misspelt_table_is_refused_in_one_line(tmp_path: Path, capsys, no_launch) -> None:
    f = tmp_path / "c.toml"
    f.write_text('[trian]\nsteps = 7\n')
    code, err = _cli(capsys, f)
    assert code == 2 and not no_launch
    assert err.count("\n") == 1 and str(f) in err
    assert "unknown table [trian] (did you mean 'train'?)" in err
    f.write_text('[train]\nstepz = 7\n')
    code, err = _cli(capsys, f)
    assert code == 2 and "unknown option 'stepz' (did you mean 'steps'?)" in err


# -- typed values: issue 27 root cause 2 --------------------------------------------------------
@pytest.mark.parametrize("line", ['overwrite = "no"', 'fsdp = "false"', "steps = true",
                                  'steps = "6"', "nproc = 2.0", 'coverage = "0.5"',
                                  'data_files = "corpus.jsonl"'])
def test_issue_samples_give_one_line(tmp_path: Path, capsys, no_launch, line: str) -> None:
    f = tmp_path / "c.toml"
    f.write_text(f'recipe = "llama-tiny"\n{line}\n')
    code, err = _cli(capsys, f)
    key = line.split(" = ")[0]
    assert code == 2 and not no_launch, err
    assert err.count("\n") == 1 and err.startswith(f"subnetdp train: --config {f}: {key} = ")


def test_ints_read_as_floats_and_ranges_use_the_command_lines_messages(
        tmp_path: Path, capsys, no_launch) -> None:
    f = tmp_path / "c.toml"
    f.write_text('recipe = "llama-tiny"\ncoverage = 1\ncapacities = [1, 0.5]\n')
    assert load_config_file(f)["coverage"] == 1.0
    f.write_text('recipe = "llama-tiny"\ncoverage = 1.5\n')
    code, err = _cli(capsys, f)
    assert code == 2 and err == "subnetdp train: --coverage must be in (0, 1], got 1.5\n"


def _wrong_values(hint: Any, *, json_null: bool) -> list[Any]:
    """Values of another type than ``hint`` (None too, for JSON, where the field takes none)."""
    args = typing.get_args(hint)
    optional = typing.get_origin(hint) in (typing.Union, types.UnionType) and \
        type(None) in args
    if optional:
        (hint,) = [a for a in args if a is not type(None)]
    origin = typing.get_origin(hint) or hint
    wrong: dict[Any, list[Any]] = {
        bool: ["no", 1], int: ["6", True, 2.0], float: ["0.5", True], str: [6, True],
        list: ["corpus.jsonl", {"a": 1}], dict: ["width=16", [1]]}
    return wrong[origin] + ([None] if json_null and not optional else [])


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(map(_toml_value, v)) + "]"
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{k} = {_toml_value(x)}" for k, x in v.items()) + " }"
    return repr(v)


@pytest.mark.parametrize("suffix", [".toml", ".json"])
def test_every_field_with_a_wrong_type_gives_one_line(tmp_path: Path, capsys, no_launch,
                                                      suffix: str) -> None:
    """Property (issue 27 root cause 2): every field of TrainConfig, fed each value of a wrong
    type from a file, is refused by the CLI in one line naming the field; nothing starts."""
    hints = typing.get_type_hints(TrainConfig)
    f = tmp_path / f"c{suffix}"
    failures = []
    for field in dataclasses.fields(TrainConfig):
        for value in _wrong_values(hints[field.name], json_null=suffix == ".json"):
            if suffix == ".toml":
                f.write_text(f"{field.name} = {_toml_value(value)}\n")
            else:
                f.write_text(json.dumps({"config_version": 2, field.name: value}))
            try:
                code = main(["train", "--config", str(f), "--out", str(tmp_path / "r")])
            except Exception as e:  # a traceback
                code = repr(e)
            err = capsys.readouterr().err
            if code != 2 or err.count("\n") != 1 or f"{field.name} = " not in err:
                failures.append(f"{field.name}={value!r}: {code} {err!r}")
    assert not failures and not no_launch, "\n".join(failures)


# -- versions and replays -------------------------------------------------------------------
def test_config_json_without_version(tmp_path: Path, capsys, no_launch) -> None:
    """Issue 41 item 4: without config_version, a file that versions 1 and 2 read differently
    is refused in one line naming the value (it was read as version 1: bf16 became
    bf16-mixed); one they read alike is read; a version given is followed."""
    f = tmp_path / "config.json"
    f.write_text(json.dumps({"recipe": "llama-tiny", "dtype": "bf16", "steps": 3}))
    code, err = _cli(capsys, f)
    assert code == 2 and not no_launch and err.count("\n") == 1, err
    assert err == (f'subnetdp train: --config {f} has no config_version, and dtype "bf16" is '
                   '"bf16-mixed" in version 1 (a run recorded before config_version existed) '
                   'but "bf16" in version 2 (today\'s); add "config_version": 1 or 2 to the '
                   'file to say which it means\n')
    f.write_text(json.dumps({"recipe": "llama-tiny", "dtype": "bf16-mixed", "steps": 3}))
    assert load_config_file(f) == {"recipe": "llama-tiny", "dtype": "bf16-mixed", "steps": 3}
    f.write_text(json.dumps({"recipe": "llama-tiny", "dtype": "bf16", "config_version": 1}))
    assert load_config_file(f)["dtype"] == "bf16-mixed"  # v1's bf16 was bf16 compute only
    f.write_text(json.dumps({"recipe": "llama-tiny", "dtype": "bf16", "config_version": 2}))
    assert load_config_file(f)["dtype"] == "bf16"
    f.write_text(json.dumps({"recipe": "llama-tiny", "config_version": 99}))
    with pytest.raises(ValueError, match=r"config_version 99 is not one this subnetdp reads"):
        load_config_file(f)
    assert TrainConfig.from_dict({"dtype": "bf16"}).dtype == "bf16-mixed"
    with pytest.raises(ValueError, match="config_version 99"):
        TrainConfig.from_dict({"config_version": 99})


def test_replayed_config_never_deletes_its_run(tmp_path: Path) -> None:
    """Issue 27 root cause 1: ``train --config R/config.json --steps 2`` (no --out) of a run
    started with --overwrite must not replace R."""
    run = tmp_path / "R"
    (run / "checkpoints" / "step_00000003").mkdir(parents=True)
    (run / "checkpoints" / "step_00000003" / "manifest.json").write_text("{}")
    saved = {**TrainConfig(out=str(run), overwrite=True, resume=str(run)).to_dict(), "nproc": 2}
    (run / "config.json").write_text(json.dumps(saved))
    cfg = config_from_args(_args(["--config", str(run / "config.json"), "--steps", "2"]))
    assert (cfg.overwrite, cfg.resume, cfg.out) == (False, None, str(run))
    with pytest.raises(ValueError, match="already holds checkpoints"):
        check_fresh(Path(cfg.out), resume=bool(cfg.resume), overwrite=cfg.overwrite)
    assert (run / "checkpoints" / "step_00000003" / "manifest.json").exists()


# -- a config file on --resume: issue 41 item 5 -----------------------------------------------
@pytest.fixture
def resumable(tmp_path: Path) -> Path:
    """A run folder whose newest checkpoint is at step 6 of 6 (2 workers, lr 1e-3)."""
    from tests.checkpoint.test_io import _checkpoint

    saved = TrainConfig(recipe="llama-tiny", steps=6, nproc=2, lr=1e-3, seed=1,
                        out=str(tmp_path / "R")).to_dict()
    shards: dict[str, dict[str, Any]] = {f"rank0000{r}.safetensors": {} for r in (0, 1)}
    _checkpoint(tmp_path / "R" / "checkpoints", 6, shards, config=saved)
    return tmp_path / "R"


def test_config_file_on_resume_applies_what_a_resume_may_change(
        resumable: Path, tmp_path: Path) -> None:
    """``train --resume R --config s.toml`` with ``steps = 9`` trains to step 9 (the file's
    steps were dropped: "nothing left to train"); keys equal to the run's own are accepted,
    so a run's config.json resumes it; the command line still wins over the file."""
    s = tmp_path / "s.toml"
    s.write_text('steps = 9\neval-every = 3\nrecipe = "llama-tiny"\nlr = 1e-3\n')
    cfg = config_from_args(_args(["--resume", str(resumable), "--config", str(s)]))
    assert (cfg.steps, cfg.eval_every, cfg.lr, cfg.nproc) == (9, 3, 1e-3, 2)
    cfg = config_from_args(_args(["--resume", str(resumable), "--config", str(s),
                                  "--steps", "12"]))
    assert (cfg.steps, cfg.eval_every) == (12, 3)
    recorded = json.dumps({**TrainConfig(recipe="llama-tiny", steps=8, nproc=2, lr=1e-3, seed=1,
                                         out=str(resumable)).to_dict()})
    (tmp_path / "config.json").write_text(recorded)
    cfg = config_from_args(_args(["--resume", str(resumable), "--config",
                                  str(tmp_path / "config.json")]))
    assert cfg.steps == 8 and cfg.out == str(resumable)


def test_config_file_on_resume_refuses_the_rest_by_name(
        resumable: Path, tmp_path: Path, capsys, no_launch) -> None:
    s = tmp_path / "s.toml"
    s.write_text('steps = 9\nlr = 0.1\nseed = 5\nrecipe = "llama-tiny"\ncoverage = 0.75\n')
    code, err = _cli(capsys, s, "--resume", str(resumable))
    assert code == 2 and not no_launch and err.count("\n") == 1, err
    assert err.startswith(f"subnetdp train: --config {s} sets coverage = 0.75, lr = 0.1, "
                          "seed = 5, but the resumed run keeps its own (coverage = 0.5, "
                          "lr = 0.001, seed = 1)"), err
    assert "drop them from the file (or add --reshard for coverage)" in err
    s.write_text("steps = 9\ncoverage = 0.75\n")  # with --reshard, coverage may change
    cfg = config_from_args(_args(["--resume", str(resumable), "--config", str(s),
                                  "--reshard"]))
    assert (cfg.steps, cfg.coverage) == (9, 0.75)
