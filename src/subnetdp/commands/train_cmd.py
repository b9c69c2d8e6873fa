"""``subnetdp train``: start the workers (or be one, under torchrun) and train one run."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path
from typing import Any

from subnetdp.commands.options import Container, HelpFormatter, add_declared, parse_model_arg
from subnetdp.train.config import TrainConfig


def add_train_arguments(p: argparse.ArgumentParser) -> dict[str, Container]:
    """Every option of a run (``train.options``), one group per section, and ``--config``;
    returns the groups by section."""
    groups = add_declared(p, "train")
    groups["launch"].add_argument(
        "--config", default=None, metavar="FILE",
        help="options from a TOML file or a run's config.json (replays it); options given "
             "here override the file (default: none)")
    return groups


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("train", help="train one run (any strategy, composition and plan)",
                              description=__doc__, formatter_class=HelpFormatter)
    p.set_defaults(func=run)
    add_train_arguments(p)


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    values = {k: v for k, v in vars(args).items() if k in names and v is not None}
    values["model_args"] = dict(parse_model_arg(a) for a in args.model_args or ())
    from_file: dict[str, Any] = {}
    if getattr(args, "config", None):
        from subnetdp.train.config_file import load_config_file, merge_config

        from_file = load_config_file(args.config)
        explicit = _explicit_options(args)
        if values.get("overwrite") and "out" in from_file and "out" not in explicit:
            raise ValueError(f"--overwrite deletes the run folder that --out names; "
                             f"{from_file['out']} comes from --config {args.config}, so add "
                             f"--out {from_file['out']} to replace it (nothing was changed)")
        values = merge_config(from_file, values, explicit)
    from subnetdp.train.applies import check_applicable

    if values.get("resume"):
        from subnetdp.train.resume import resume_config

        explicit = _explicit_options(args)
        if "init_from" in explicit:
            raise ValueError("--init-from starts a new run from a Hugging Face folder; --resume "
                             "continues a run from its checkpoint, which holds its weights: "
                             "drop one of them")
        # a config file's options are held to what a resume may change, as the command line's
        cfg = resume_config(values["resume"], values, explicit, from_file=set(from_file),
                            where=f"--config {getattr(args, 'config', None)}")
        check_applicable(cfg, only=explicit | set(from_file))  # the run's own values stand
        return cfg
    values.setdefault("nproc", 4)
    cfg = TrainConfig(**values)
    check_applicable(cfg)
    if cfg.init_from:  # the recipe, shape and tokenizer follow the folder
        from subnetdp.train.init_from import apply_init_from

        cfg = apply_init_from(cfg, _explicit_options(args))
    if values.get("out") is None:
        cfg = dataclasses.replace(cfg, out=f"runs/{cfg.recipe}-{cfg.strategy}")
    return cfg


def _explicit_options(args: argparse.Namespace) -> set[str]:
    """Options given on the command line, even those equal to their default.

    The command line is parsed again with every default suppressed, so only the options that
    appear in it come back. Without the raw command line (``args`` built by hand), fall back
    to the options whose value differs from the parser's default."""
    p = argparse.ArgumentParser(add_help=False)
    add_train_arguments(p)
    argv = getattr(args, "argv", None)
    if argv is not None:
        for action in p._actions:
            action.default = argparse.SUPPRESS
        given, _ = p.parse_known_args(argv)
        explicit = set(vars(given))
    else:
        defaults = vars(p.parse_args([]))
        explicit = {k for k, v in vars(args).items() if k in defaults and v != defaults[k]}
    return explicit - {"resume", "config"}  # where a run starts from, not its options


def run(args: argparse.Namespace) -> int:
    try:
        cfg = config_from_args(args)
    except (ValueError, OSError) as e:
        print(f"subnetdp train: {e}", file=sys.stderr)
        return 2
    if cfg.progress and "RANK" not in os.environ:  # at once: what follows takes a while
        print(f"{cfg.strategy} on {cfg.recipe}: {cfg.nproc} workers, {cfg.steps} steps, run "
              f"folder {cfg.out}", flush=True)
    from subnetdp.data import DatasetMissingError
    from subnetdp.distributed.launch import (
        RunInterruptedError,
        WorkerFailedError,
        WorkerStartTimeoutError,
    )
    from subnetdp.metrics.report import format_summary
    from subnetdp.train.resume import NonFiniteLossError, interrupted_message
    from subnetdp.train.run import run_training

    try:
        summary = run_training(cfg)
    except (ValueError, OSError, DatasetMissingError) as e:
        print(f"subnetdp train: {e}", file=sys.stderr)
        return 2
    except WorkerFailedError as e:  # one line; every rank's traceback is in the run's logs
        print(f"subnetdp train: {e.summary}", file=sys.stderr)
        return 1
    except (NonFiniteLossError, WorkerStartTimeoutError) as e:  # started, then stopped
        print(f"subnetdp train: {e}", file=sys.stderr)
        return 1
    except RunInterruptedError as e:
        print(f"subnetdp train: {interrupted_message(e.signal, cfg.out)}", file=sys.stderr)
        return 130 if e.signal == "SIGINT" else 143
    except KeyboardInterrupt:  # Ctrl-C before the workers started (checks, tokenizer)
        print(f"subnetdp train: {interrupted_message('SIGINT', cfg.out)}", file=sys.stderr)
        return 130
    if summary and os.environ.get("RANK", "0") == "0":  # under torchrun, one report
        print(format_summary(summary))
        print(f"\nsummary: {Path(cfg.out) / 'summary.json'}")
    return 0
