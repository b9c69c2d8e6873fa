"""``subnetdp train``: start the workers (or be one, under torchrun) and train one run."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from subnetdp.commands.options import add_neuron_arguments
from subnetdp.train.config import DTYPES, STRATEGIES, TrainConfig


def add_train_arguments(p: argparse.ArgumentParser) -> None:
    d = TrainConfig()
    p.add_argument("--recipe", default=d.recipe,
                   help="llama-tiny, resnet18-fmnist, llama-134m, ...")
    p.add_argument("--strategy", default=d.strategy, choices=STRATEGIES)
    p.add_argument("--coverage", type=float, default=d.coverage,
                   help="fraction of units (blocks for b-sdp, neuron groups of every layer "
                        "for n-sdp) each worker holds")
    p.add_argument("--scheme", default=d.scheme, choices=("spread", "random"))
    add_neuron_arguments(p)
    p.add_argument("--output-scaling", default=d.output_scaling, choices=("none", "keep"),
                   help="n-sdp: scale kept hidden units by 1/keep-rate while training "
                        "(default: keep for n-sdp)")
    p.add_argument("--refresh-every", type=int, default=d.refresh_every, metavar="K",
                   help="bb-sdp/nb-sdp: refresh non-held units from their owners every K "
                        "steps (1 = exact)")
    p.add_argument("--stochastic-depth", type=float, default=d.stochastic_depth, metavar="P",
                   help="ddp baseline: skip each block with probability P per step and rank "
                        "(no rescaling, like b-sdp)")
    p.add_argument("--neuron-dropout", type=float, default=d.neuron_dropout, metavar="P",
                   help="ddp baseline: drop whole hidden units/heads/channels of every layer "
                        "pair with probability P (inverted dropout)")
    p.add_argument("--fsdp", action="store_true",
                   help="shard each held unit over its holders with FSDP2 and shared "
                        "parameters over all workers (with --strategy ddp: plain FSDP)")
    p.add_argument("--ac", action="store_true", help="activation checkpointing per block")
    p.add_argument("--dtype", default=d.dtype, choices=DTYPES,
                   help="compute dtype; bf16 keeps fp32 master weights and optimizer state")
    p.add_argument("--reduce-dtype", default=None, choices=DTYPES,
                   help="with --fsdp: the dtype gradients are averaged in (default fp32)")
    p.add_argument("--plan-file", default=None, help="a plan JSON instead of --coverage/--scheme")
    # default None (meaning 4) so that an explicit --nproc 4 is seen when resuming
    p.add_argument("--nproc", type=int, default=None,
                   help="local worker processes, default 4 (ignored under torchrun, which sets "
                        "the world)")
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--batch-size", type=int, default=None, help="per worker; recipe default")
    p.add_argument("--seq-len", type=int, default=None)
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--weight-decay", type=float, default=None)
    p.add_argument("--grad-clip", type=float, default=None)
    p.add_argument("--vocab-size", type=int, default=None)
    p.add_argument("--data-dir", default=None, help="your own text/images instead of the packages")
    p.add_argument("--eval-batches", type=int, default=d.eval_batches)
    p.add_argument("--memory-step", type=int, default=d.memory_step,
                   help="step whose memory is measured (-1: none)")
    p.add_argument("--device", default=d.device, choices=("auto", "cpu", "cuda"))
    p.add_argument("--bucket-cap-mb", type=float, default=d.bucket_cap_mb)
    p.add_argument("--model-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="override a model config field, e.g. --model-arg width=16 (repeatable)")
    p.add_argument("--no-progress", dest="progress", action="store_false")
    p.add_argument("--ckpt-every", type=int, default=d.ckpt_every, metavar="N",
                   help="write a sharded checkpoint every N steps and at the end (0: never)")
    p.add_argument("--ckpt-keep", type=int, default=d.ckpt_keep, metavar="K",
                   help="keep the newest K checkpoints")
    p.add_argument("--max-restarts", type=int, default=d.max_restarts,
                   help="restart the worker group this many times after a failure; it "
                        "resumes from the newest checkpoint")


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("train", help="train one run (ddp, b-sdp or n-sdp)")
    add_train_arguments(p)
    p.add_argument("--out", default=None, help="run directory (default runs/<recipe>-<strategy>)")
    p.add_argument("--resume", default=None, metavar="RUN",
                   help="continue runs/NAME from its newest checkpoint (or from the given "
                        "runs/NAME/checkpoints/step_N) with the run's own configuration")


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    values = {k: v for k, v in vars(args).items() if k in names and v is not None}
    values["model_args"] = dict(_parse_model_arg(a) for a in args.model_arg)
    if values.get("resume"):
        from subnetdp.train.checkpoint import resume_config

        return resume_config(values["resume"], values, _explicit_options(args))
    values.setdefault("nproc", 4)
    if values.get("out") is None:
        values["out"] = f"runs/{args.recipe}-{args.strategy}"
    return TrainConfig(**values)


def _explicit_options(args: argparse.Namespace) -> set[str]:
    """Options given on the command line, even those equal to their default.

    The command line is parsed again with every default suppressed, so only the options that
    appear in it come back. Without the raw command line (``args`` built by hand), fall back
    to the options whose value differs from the parser's default."""
    p = argparse.ArgumentParser(add_help=False)
    add_train_arguments(p)
    p.add_argument("--out")
    argv = getattr(args, "argv", None)
    if argv is not None:
        for action in p._actions:
            action.default = argparse.SUPPRESS
        given, _ = p.parse_known_args(argv)
        explicit = set(vars(given))
    else:
        defaults = vars(p.parse_args([]))
        explicit = {k for k, v in vars(args).items() if k in defaults and v != defaults[k]}
        if getattr(args, "out", None) is not None:
            explicit.add("out")
    return {"model_args" if k == "model_arg" else k for k in explicit}


def _parse_model_arg(text: str) -> tuple[str, Any]:
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise ValueError(f"--model-arg expects KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(raw)
    except json.JSONDecodeError:
        return key, raw


def run_training(cfg: TrainConfig, *, start_method: str | None = None) -> dict[str, Any]:
    """Train and return the run's summary (read back from ``summary.json``).

    ``start_method`` is ``launch``'s (None: fork). A long-lived caller that trains many runs
    (the quality study) passes ``"forkserver"``: forking from a process whose threads (the
    elastic agent's TCP store) may hold a libc lock can deadlock a worker."""
    from subnetdp.train.launch import launch, under_launcher
    from subnetdp.train.tasks import make_task
    from subnetdp.train.trainer import train_worker

    cfg = cfg.resolved()
    if not under_launcher():
        if cfg.plan_file:  # refuse a plan for another world size before starting anyone
            from subnetdp.plan import Plan

            Plan.from_json(Path(cfg.plan_file).read_text()).validate(cfg.nproc)
        make_task(cfg)  # build the tokenizer/token cache once, before the workers start
        # Refuse a damaged checkpoint or one for another world before anything is written.
        from subnetdp.train.checkpoint import check_fresh_run_dir, preflight_resume

        if cfg.resume:
            preflight_resume(cfg)
        else:
            check_fresh_run_dir(Path(cfg.out))
    results = launch(train_worker, (cfg.to_dict(),), nproc=cfg.nproc,
                     run_id=f"subnetdp-{int(time.time())}", max_restarts=cfg.max_restarts,
                     start_method=start_method)
    stopped = [r["error"] for r in results.values() if isinstance(r, dict) and "error" in r]
    if stopped:
        from subnetdp.train.checkpoint import NonFiniteLossError

        raise NonFiniteLossError(stopped[0])
    summary_path = Path(cfg.out) / "summary.json"
    return json.loads(summary_path.read_text()) if summary_path.exists() else {}


def run(args: argparse.Namespace) -> int:
    from subnetdp.commands.report import format_summary
    from subnetdp.data import DatasetMissingError
    from subnetdp.train.checkpoint import NonFiniteLossError
    from subnetdp.train.launch import WorkerFailedError

    try:
        cfg = config_from_args(args)
        summary = run_training(cfg)
    except (ValueError, FileNotFoundError, DatasetMissingError) as e:
        print(f"subnetdp train: {e}", file=sys.stderr)
        return 2
    except (NonFiniteLossError, WorkerFailedError) as e:  # the run started, then stopped
        print(f"subnetdp train: {e}", file=sys.stderr)
        return 1
    if summary and os.environ.get("RANK", "0") == "0":  # under torchrun, one report
        print(format_summary(summary))
        print(f"\nsummary: {Path(cfg.out) / 'summary.json'}")
    return 0
