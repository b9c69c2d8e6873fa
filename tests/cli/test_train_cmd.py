"""`subnetdp train`'s command line: which options it gives explicitly (what a resume must
honour), and the configuration it validates (strategy, composition, precision)."""

from __future__ import annotations

import re
from typing import Any

import pytest

from subnetdp.cli import build_parser
from subnetdp.commands.train_cmd import _explicit_options, config_from_args
from subnetdp.strategy import Composition, get_strategy
from subnetdp.train.config import TrainConfig


def _explicit(argv: list[str], *, keep_argv: bool = True) -> set[str]:
    args = build_parser().parse_args(argv)
    if keep_argv:
        args.argv = argv
    return _explicit_options(args)


def test_options_equal_to_their_default_still_count() -> None:
    argv = ["train", "--resume", "runs/x", "--coverage", "0.5", "--steps", "20",
            "--no-progress", "--model-arg", "dim=8", "--out", "runs/x"]
    # --coverage 0.5 is the default, yet it was given: a resumed 0.25 run must refuse it
    assert _explicit(argv) == {"coverage", "steps", "progress", "model_args", "out"}
    # without the raw command line only values that differ from the defaults are visible
    assert "coverage" not in _explicit(argv, keep_argv=False)
    assert _explicit(["train", "--resume", "runs/x"]) == set()


def test_precision_and_composition_reach_the_config() -> None:
    args = build_parser().parse_args(["train", "--strategy", "b-sdp", "--fsdp", "--ac",
                                      "--dtype", "bf16-mixed", "--reduce-dtype", "bf16"])
    cfg = config_from_args(args)
    assert cfg.strategy_value is get_strategy("b-sdp")
    assert cfg.composition() == Composition(fsdp=True, ac=True, dtype="bf16-mixed",
                                            reduce_dtype="bf16")
    cfg.validate("lm")
    TrainConfig(dtype="bf16").validate("lm")  # pure bf16 is a precision of its own
    with pytest.raises(SystemExit):  # argparse: not one of fp32, bf16-mixed, bf16
        build_parser().parse_args(["train", "--dtype", "fp16"])


@pytest.mark.parametrize(("fields", "message"), [
    ({"strategy": "ddp", "plan_file": "p.json"}, "--plan-file needs an SDP strategy"),
    ({"strategy": "ddp", "fsdp": True, "ckpt_every": 2}, "checkpoints of the plain FSDP2"),
    ({"reduce_dtype": "bf16"}, "--reduce-dtype needs --fsdp"),
    ({"strategy": "b-sdp", "output_scaling": "keep"}, "applies to n-sdp only"),
    ({"strategy": "zero"}, "unknown strategy 'zero'"),
    ({"dtype": "fp16"}, "--dtype must be one of fp32, bf16-mixed, bf16"),
    ({"strategy": "bb-sdp", "refresh_every": 2, "ckpt_every": 3}, "multiple of --refresh-every"),
])
def test_config_refuses_what_cannot_be_built(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        TrainConfig(**fields).validate("lm")
