"""``subnetdp train``: start the workers (or be one, under torchrun) and train one run."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path
from typing import Any

from subnetdp.commands.options import (
    Container,
    HelpFormatter,
    add_batch_arguments,
    add_bucket_cap_argument,
    add_comm_mem_argument,
    add_composition_arguments,
    add_device_argument,
    add_dtype_argument,
    add_min_nproc_argument,
    add_model_arg_argument,
    add_neuron_arguments,
    add_node_arguments,
    add_plan_file_argument,
    add_recipe_argument,
    add_reduce_dtype_argument,
    add_scheme_arguments,
    add_strategy_argument,
    parse_model_arg,
)
from subnetdp.strategy import OUTPUT_SCALINGS
from subnetdp.train.config import TrainConfig


def add_train_arguments(p: argparse.ArgumentParser) -> dict[str, Container]:
    """Every option of a run, in groups; returns the groups by short name (``add_parser``
    adds the run-folder options to them)."""
    d = TrainConfig()
    g: dict[str, Container] = {key: p.add_argument_group(title) for key, title in (
        ("model", "model and data"), ("strategy", "strategy and plan"),
        ("composition", "composition and precision"), ("optim", "optimisation"),
        ("ckpt", "checkpoints and restarts"), ("run", "run folder and launch"),
        ("log", "logging and evaluation"))}
    m = g["model"]
    add_recipe_argument(m, default=d.recipe, help="llama-tiny, resnet18-fmnist, llama-134m, "
                                                  "... (default %(default)s)")
    add_model_arg_argument(m)
    add_batch_arguments(m, batch_size=None, seq_len=None, default_note="default: the recipe's")
    m.add_argument("--vocab-size", type=int, default=None, metavar="V",
                   help="tokenizer vocabulary of a trained BPE, language models (default: the "
                        "recipe's)")
    m.add_argument("--data-dir", default=None, metavar="DIR",
                   help="your own text/images instead of the data packages (default: the "
                        "packages)")
    add_data_arguments(m)
    m.add_argument("--init-from", default=None, metavar="DIR",
                   help="start from a Hugging Face LLaMA folder (config.json, safetensors, "
                        "tokenizer.json): its weights, shape, tokenizer and recipe "
                        "(docs/init-from.md; default: a new model from --seed)")

    s = g["strategy"]
    add_strategy_argument(s, default=d.strategy,
                          note="ddp: the full model on every worker; the others: a subnetwork "
                               "each (README, Strategies)")
    s.add_argument("--coverage", type=float, default=d.coverage,
                   help="fraction of units (blocks for b-sdp, neuron groups of every layer "
                        "for n-sdp) each worker holds")
    add_scheme_arguments(s, default=d.scheme)
    add_node_arguments(s)
    add_neuron_arguments(s)
    s.add_argument("--output-scaling", default=d.output_scaling, choices=OUTPUT_SCALINGS,
                   help="n-sdp: scale kept hidden units by 1/keep-rate while training "
                        "(default: keep for n-sdp, else none)")
    s.add_argument("--refresh-every", type=int, default=d.refresh_every, metavar="K",
                   help="bb-sdp/nb-sdp: refresh non-held units from their owners every K "
                        "steps (1 = exact)")
    s.add_argument("--stochastic-depth", type=float, default=d.stochastic_depth, metavar="P",
                   help="ddp baseline: skip each block with probability P per step and rank "
                        "(no rescaling, like b-sdp)")
    s.add_argument("--neuron-dropout", type=float, default=d.neuron_dropout, metavar="P",
                   help="ddp baseline: drop whole hidden units/heads/channels of every layer "
                        "pair with probability P (inverted dropout)")
    add_plan_file_argument(s, help="a saved plan (`subnetdp plan --out`) or a JSON matrix "
                                   "[worker][unit] of 0/1 over the model's blocks, instead of "
                                   "--coverage/--scheme (default: made from them)")
    # heterogeneous workers (train/hetero.py): one value per worker, instead of --coverage
    s.add_argument("--capacities", type=_floats, metavar="C0,C1,...",
                   help="each rank's share of the units' cost, e.g. 1,0.5,0.5,0.5: a balanced "
                        "plan with unequal numbers of units per rank (default: --coverage)")
    s.add_argument("--memory-gb", type=_floats, metavar="GB0,GB1,...",
                   help="each rank's memory budget, e.g. 80,40,40,40: a balanced plan in which "
                        "every rank's estimated peak fits (made before the workers start; "
                        "default: --coverage)")
    add_comm_mem_argument(s, default="{mb} on CUDA: NCCL's buffers at their defaults, "
                                     "docs/plans.md; 0 on CPU, where gloo runs; like plan "
                                     "--memory-gb")

    c = g["composition"]
    add_composition_arguments(c, zero=True, compile=True)
    add_dtype_argument(c, default=d.dtype)
    add_reduce_dtype_argument(c)
    c.add_argument("--no-tf32", dest="tf32", action="store_false",
                   help="on CUDA, keep float32 matmuls in full fp32 (default: TF32)")
    add_bucket_cap_argument(c, default=d.bucket_cap_mb)

    o = g["optim"]
    o.add_argument("--steps", type=int, default=d.steps, help="training steps")
    o.add_argument("--seed", type=int, default=d.seed,
                   help="seed of the model's initialisation, the data order and the plan")
    o.add_argument("--lr", type=float, default=None,
                   help="peak learning rate, AdamW (default: the recipe's)")
    o.add_argument("--warmup", type=int, default=None, metavar="STEPS",
                   help="linear learning-rate warm-up steps (default: the recipe's)")
    o.add_argument("--weight-decay", type=float, default=None,
                   help="AdamW weight decay (default: the recipe's)")
    o.add_argument("--grad-clip", type=float, default=None, metavar="NORM",
                   help="clip the full model's gradient norm to NORM, 0 = off (default: the "
                        "recipe's)")

    k = g["ckpt"]
    k.add_argument("--ckpt-every", type=int, default=d.ckpt_every, metavar="N",
                   help="also write a sharded checkpoint every N steps (0: only the final "
                        "one)")
    k.add_argument("--no-final-ckpt", dest="final_ckpt", action="store_false", default=None,
                   help="do not save the state at the end of the run (default: saved, so "
                        "that export, eval and --resume --steps can use it)")
    k.add_argument("--ckpt-keep", type=int, default=d.ckpt_keep, metavar="K",
                   help="keep the newest K checkpoints")
    k.add_argument("--max-restarts", type=int, default=d.max_restarts,
                   help="restart the worker group this many times after a failure; it "
                        "resumes from the newest checkpoint")
    k.add_argument("--reshard", action="store_true", default=None,
                   help="with --resume: load the checkpoint into a different --nproc, "
                        "--coverage or plan (values exact; data order changes: README)")
    k.add_argument("--accept-new-data", action="store_true", default=None,
                   help="with --resume: go on although the corpus changed since the run "
                        "recorded it (tokenised with the run's own tokenizer)")
    add_min_nproc_argument(k, help="elastic shrink: after a worker is lost for good (restarts "
                                   "used up), go on with one worker fewer, down to N, from the "
                                   "survivors' copies of the step in flight when every unit has "
                                   "two holders, else from the newest checkpoint; each smaller "
                                   "world is planned at the start (default: never shrink)")
    k.add_argument("--max-nproc", type=int, default=None, metavar="M",
                   help="grow back: start M workers, those beyond --nproc joining at a step "
                        "boundary with their state from the holders; after an elastic "
                        "shrink a lost worker is restarted and rejoins (default: never grow)")
    k.add_argument("--no-rescue", dest="rescue", action="store_false", default=None,
                   help="with --min-nproc: always go on from the newest checkpoint, never "
                        "from the survivors' copies of the step in flight (docs/checkpointing.md)")

    r = g["run"]
    # default None (meaning 4) so that an explicit --nproc 4 is seen when resuming
    r.add_argument("--nproc", type=int, default=None, metavar="N",
                   help="local worker processes (ignored under torchrun, which sets the "
                        "world; default 4)")
    add_device_argument(r, default=d.device, help="where the workers train")
    r.add_argument("--overwrite", action="store_true", default=None,
                   help="a new run into an --out holding an earlier run: delete that run's "
                        "files first (without it, such an --out is refused)")
    r.add_argument("--collective-timeout", type=float, default=d.collective_timeout,
                   metavar="S", help="stop the run when a collective waits S seconds for a "
                                     "peer, naming the rank that hung (also bounds worker "
                                     "start-up; evaluation and checkpoint writes get longer; "
                                     "default %(default)g, at most 604800: a week)")

    lg = g["log"]
    lg.add_argument("--log-every", type=int, default=d.log_every, metavar="N",
                    help="read and check the loss every N steps (a host sync), write metrics "
                         "and print a progress line")
    lg.add_argument("--no-progress", dest="progress", action="store_false",
                    help="no progress lines (default: rank 0's, every --log-every steps)")
    lg.add_argument("--eval-every", type=int, default=0, metavar="N",
                    help="validate the assembled full model every N steps (default 0: at "
                         "the end only)")
    lg.add_argument("--eval-batches", type=int, default=d.eval_batches, metavar="N",
                    help="validation batches")
    add_eval_task_arguments(lg)
    lg.add_argument("--memory-step", type=int, default=d.memory_step, metavar="STEP",
                    help="step whose memory is measured (-1: none)")
    lg.add_argument("--peak-tflops", type=float, default=None, metavar="T",
                    help="the device's peak TFLOP/s for mfu(%%) (default: known CUDA devices)")
    add_tracking_arguments(lg)
    return g


def add_eval_task_arguments(p: Container) -> None:
    """Downstream accuracy with each validation (issue 31; docs/checkpointing.md)."""
    p.add_argument("--eval-tasks", type=_tasks, default=None, metavar="T1,T2",
                   help="LLaMA: also score the assembled model on these lm-eval tasks with "
                        "each validation (e.g. arc_easy,sciq; `subnetdp eval --list-tasks` "
                        "lists them; metrics eval/<task>/acc, acc_norm; default: none)")
    p.add_argument("--eval-limit", type=int, default=None, metavar="N",
                   help="with --eval-tasks: only the first N documents of each task "
                        "(default: all)")


def _tasks(text: str) -> list[str]:
    from subnetdp.evals.tasks import parse_tasks

    try:
        return parse_tasks(text)
    except ValueError as e:  # argparse shows an ArgumentTypeError's message as is
        raise argparse.ArgumentTypeError(str(e)) from None


def add_tracking_arguments(p: Container) -> None:
    """TensorBoard and W&B (README, Watching a run)."""
    p.add_argument("--tensorboard", action="store_true",
                   help="also write TensorBoard events to RUN/tensorboard (extra: tensorboard)")
    p.add_argument("--wandb", action="store_true",
                   help="also log to Weights & Biases, offline unless WANDB_MODE=online "
                        "(extra: wandb)")
    p.add_argument("--wandb-project", default=None, metavar="NAME",
                   help="the W&B project (implies --wandb; default subnetdp)")


def add_data_arguments(p: Container) -> None:
    """Text sources: any tokenizer.json, Hugging Face datasets (docs/data.md)."""
    p.add_argument("--tokenizer", default=None, metavar="PATH",
                   help="a tokenizer.json (any Hugging Face tokenizers file), or gpt2 for the "
                        "GPT-2 BPE package, instead of training a BPE on the corpus "
                        "(default: a BPE trained on the corpus)")
    p.add_argument("--dataset", default=None, metavar="NAME",
                   help="text through Hugging Face datasets: a builder (json, parquet, text, "
                        "csv, arrow) over --data-files, or a local dataset folder (extra: data; "
                        "default: the data packages)")
    p.add_argument("--data-files", action="append", default=None, metavar="GLOB",
                   help="local files for --dataset (repeatable)")
    p.add_argument("--text-field", default="text", metavar="NAME",
                   help="the documents' text field in JSONL/parquet/datasets (default text)")


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("train", help="train one run (any strategy, composition and plan)",
                              description=__doc__, formatter_class=HelpFormatter)
    p.set_defaults(func=run)
    g = add_train_arguments(p)
    g["run"].add_argument("--out", default=None, metavar="DIR",
                          help="the run folder (default runs/<recipe>-<strategy>)")
    g["run"].add_argument("--config", default=None, metavar="FILE",
                          help="options from a TOML file or a run's config.json (replays "
                               "it); options given here override the file (default: none)")
    g["ckpt"].add_argument("--resume", default=None, metavar="RUN",
                           help="continue runs/NAME from its newest checkpoint (or from the "
                                "given runs/NAME/checkpoints/step_N) with the run's own "
                                "configuration (default: a new run)")


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    values = {k: v for k, v in vars(args).items() if k in names and v is not None}
    values["model_args"] = dict(parse_model_arg(a) for a in args.model_arg)
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


def _floats(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers separated by commas, got "
                                         f"{text!r}") from None


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
