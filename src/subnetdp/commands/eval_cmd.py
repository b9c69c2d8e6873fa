"""``subnetdp eval``: validation loss (and accuracy) of a checkpoint or an exported model;
with ``--eval-tasks``, downstream zero-shot accuracy through lm-evaluation-harness.

The model is the plain model class built from the recipe, loaded strictly with the full
state: the same evaluation as the end of ``subnetdp train`` (same validation batches).
``--eval-tasks`` evaluates a Hugging Face folder (``subnetdp export --format hf``), exporting a
run or checkpoint into a temporary one first (subnetdp.evals).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from subnetdp._moved import moved_name
from subnetdp.commands.options import HelpFormatter, add_alias, add_device_argument


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("eval", help="validation loss/accuracy of a checkpoint or export",
                              description=__doc__, formatter_class=HelpFormatter)
    p.set_defaults(func=run)
    p.add_argument("path", help="runs/NAME, runs/NAME/checkpoints/step_N or an exported "
                                ".safetensors file")
    p.add_argument("--eval-batches", type=int, default=None,
                   help="validation batches (default: the run's own --eval-batches)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--accept-new-data", action="store_true",
                   help="evaluate on the current corpus although it changed since the run "
                        "recorded it (tokenised with the run's own tokenizer)")
    add_device_argument(p, default=None,
                        help="where to evaluate (default: the run's own --device, cpu with "
                             "--eval-tasks)")
    # train's spelling (--eval-tasks, --eval-limit: train.options) for the same values
    add_alias(p, "--eval-tasks", old=("--tasks",), dest="tasks", default=None,
              help="downstream tasks instead of validation loss, comma-separated, e.g. "
                   "arc_easy,sciq (path may also be an `export --format hf` folder)")
    p.add_argument("--list-tasks", action=ListTasks,
                   help="list the downstream tasks available here and exit")
    add_alias(p, "--eval-limit", old=("--limit",), dest="limit", type=int, default=None,
              help="--eval-tasks: only the first N documents of each task")
    p.add_argument("--out", default=None, metavar="FILE",
                   help="--eval-tasks: also write the result to this JSON file (default: stdout "
                        "only)")


class ListTasks(argparse.Action):
    """``--list-tasks``: print the available tasks and the lm-eval configs' folder, and exit
    (as ``--version`` does: no PATH needed)."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *_: Any) -> None:
        from subnetdp.evals.tasks import PREFIX, TASK_DIR, EvalDataMissingError, available_tasks

        try:
            names = available_tasks()
        except EvalDataMissingError as e:
            parser.exit(2, f"subnetdp eval: {e}\n")
        print("\n".join(names))
        print(f"(lm-eval configs: lm_eval --include_path {TASK_DIR} --tasks {PREFIX}NAME)",
              file=sys.stderr)
        parser.exit(0)


# options of downstream evaluation only: without --eval-tasks they would be ignored
TASKS_ONLY = {"limit": "--eval-limit", "out": "--out"}


def run(args: argparse.Namespace) -> int:
    from subnetdp.data import DatasetMissingError
    from subnetdp.distributed.process_group import set_threads

    given = [flag for name, flag in TASKS_ONLY.items() if getattr(args, name) is not None]
    if args.tasks is None and given:
        print(f"subnetdp eval: {given[0]} has no effect without --eval-tasks (it applies to "
              "downstream evaluation only); drop it, or add --eval-tasks", file=sys.stderr)
        return 2
    set_threads()  # as train's workers compute: the same figures, and no oversubscription
    if args.tasks is not None:
        return run_downstream(args)
    from subnetdp.train.evaluation import evaluate_path

    try:
        if args.device is not None:
            from subnetdp.train.device import device_name

            device_name(args.device)  # --device cuda without CUDA: refused before any work
        result = evaluate_path(args.path, eval_batches=args.eval_batches, device=args.device,
                               accept_new_data=args.accept_new_data)
    except (ValueError, OSError, DatasetMissingError) as e:
        print(f"subnetdp eval: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result))
    else:
        rest = "  ".join(f"{k} {v:.4f}" for k, v in result.items() if k != "step")
        print(f"step {int(result['step'])}  {rest}")
    return 0


def run_downstream(args: argparse.Namespace) -> int:
    from subnetdp.evals import EvalDataMissingError, LmEvalMissingError, format_table
    from subnetdp.evals.downstream import downstream
    from subnetdp.evals.tasks import parse_tasks
    from subnetdp.train.config import config_keys
    from subnetdp.train.device import device_name

    try:
        if args.out:
            from subnetdp.checkpoint.rundir import check_output

            check_output(args.out, sources=(args.path,))
        if args.limit is not None and args.limit < 1:
            raise ValueError(f"--eval-limit must be >= 1, got {args.limit}")
        device = device_name(args.device or "cpu")  # an HF folder records no device of its own
        result = downstream(args.path, parse_tasks(args.tasks), config_keys=config_keys(),
                            limit=args.limit, device=device)
    except (EvalDataMissingError, LmEvalMissingError, ValueError, OSError) as e:
        print(f"subnetdp eval: {e}", file=sys.stderr)
        return 2
    if args.out:
        from subnetdp.metrics.sinks import write_json_atomic

        write_json_atomic(args.out, result)
    print(json.dumps(result) if args.json else format_table(result))
    return 0


def __getattr__(name: str) -> Any:  # library functions that lived here (subnetdp/_moved.py)
    return moved_name(__name__, name)
