"""Every option of a run, declared once: ``TrainOptions``'s fields, each with its ``Opt``.

A field is the option's name (``batch_size``: ``--batch-size`` on the command line,
``batch-size``/``batch_size`` in a TOML file, ``"batch_size"`` in a run's ``config.json``), its
type (the annotation) and its default (the field's); its ``Opt`` says the rest: the section it
belongs to (``SECTIONS``: the ``--help`` group and the TOML table), its help, which commands
take it (``train``, ``plan``, ``bench``) and with which default there, the runs it has an
effect on (``where``: ``train.applies`` holds the matching predicate) and what a resumed run
may do with it (``on_resume``). ``commands.options.add_declared`` makes the flags of every
command from these declarations, ``train.applies.APPLIES`` its table, ``train.resume`` its
sets of what a resume may change, ``train.config_file`` the TOML sections; nothing else
spells an option. tests/cli/test_declared_once.py holds them to it.

Storage stays flat (a run's ``config.json`` is one object, and ``TrainConfig(coverage=...)``
is the Python API): the typed sections are views decoded once, ``rank_spec`` (the strategy
and its ``Composition``) and ``plan_spec`` (``PlanSpec``), and ``section(name)`` for any.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from subnetdp.plan.objectives import DEFAULT_BALANCE, parse_balance
from subnetdp.strategy import (
    DTYPES,
    NAMES,
    OUTPUT_SCALINGS,
    REDUCE_DTYPES,
    STRATEGIES,
    Composition,
    PlanSpec,
    RankSpec,
    Strategy,
    composition_of,
)

T = TypeVar("T")

# section -> its --help group's title, in the order --help lists them
SECTIONS: dict[str, str] = {
    "model": "model", "data": "data and tokenizer",
    "strategy": "strategy and composition (strategy.Composition)",
    "plan": "plan (strategy.PlanSpec)", "optimizer": "optimizer", "schedule": "schedule",
    "checkpoint": "checkpoints and resume", "faults": "faults and elastic runs",
    "launch": "run folder and launch", "tracking": "logging and tracking",
    "eval": "evaluation",
}
Command = Literal["train", "plan", "bench"]
DEVICES = ("auto", "cpu", "cuda")  # every command's --device; auto: CUDA when available
# keep: a resumed run keeps the recorded value; change: a resume may change it; reshard: a
# resume with --reshard may change it (train.resume)
OnResume = Literal["keep", "change", "reshard"]


@dataclass(frozen=True)
class Opt:
    """How an option is offered: ``flag`` (None: ``--`` and the name with dashes; a switch on
    by default is ``--no-NAME``); ``aliases``: old spellings, accepted with a one-line notice
    naming ``flag``; ``parse``: argparse's ``type`` (None: the annotation's int, float, str);
    ``repeat``: given once per value; ``defaults``: a command's own default where it differs
    from the field's; ``default_note``: what a None default means, for --help."""

    section: str
    help: str
    flag: str | None = None
    aliases: tuple[str, ...] = ()
    metavar: str | None = None
    choices: tuple[Any, ...] | None = None
    parse: Callable[[str], Any] | None = None
    repeat: bool = False
    commands: tuple[Command, ...] = ("train",)
    defaults: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    default_note: str | None = None
    where: str | None = None
    on_resume: OnResume = "keep"


def option(default: T, section: str, help: str, **kw: Any) -> T:
    """A ``TrainOptions`` field: its default and its ``Opt`` (a list or dict default is
    copied per instance)."""
    opt = Opt(section, help, **kw)
    if isinstance(default, list | dict):
        return dataclasses.field(default_factory=lambda: type(default)(default),  # type: ignore[return-value]
                                 metadata={"opt": opt})
    return dataclasses.field(default=default, metadata={"opt": opt})  # type: ignore[no-any-return]


def floats(text: str) -> list[float]:
    """``1,0.5,0.5``: numbers separated by commas."""
    import argparse

    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:  # argparse shows an ArgumentTypeError's message as is
        raise argparse.ArgumentTypeError(f"expected numbers separated by commas, got "
                                         f"{text!r}") from None


def balance(text: str) -> str:
    """``--balance R[+R...]``, checked (``plan.objectives.parse_balance``)."""
    import argparse

    from subnetdp.plan.plan import PlanError

    try:
        parse_balance(text)
    except PlanError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def tasks(text: str) -> list[str]:
    """``--eval-tasks``: lm-eval task names, checked (``evals.tasks.parse_tasks``)."""
    import argparse

    from subnetdp.evals.tasks import parse_tasks

    try:
        return parse_tasks(text)
    except ValueError as e:  # argparse shows an ArgumentTypeError's message as is
        raise argparse.ArgumentTypeError(str(e)) from None




_ALL: tuple[Command, ...] = ("train", "plan", "bench")
_HELD_PLAN = "SDP strategies without --plan-file"
_LOCAL = "local steps (--sync-every > 1)"
_NEURON = "neuron-level strategies"
_LOCAL_CMDS: tuple[Command, ...] = ("train", "bench")  # bench step times a run's windows
_LM = "language-model recipes"
_TP: tuple[Command, ...] = ("train", "plan")
# plan's jobs that estimate a run: at micro-batch 1 x 2048 tokens unless told
_ESTIMATES = ("plan budget", "plan fit", "plan cluster")


@dataclass
class TrainOptions:
    """A run's options (``TrainConfig`` adds their checks and the recipe's defaults)."""

    # -- model
    recipe: str = option(
        "llama-tiny", "model", "the model and its training defaults: llama-tiny, "
        "resnet18-fmnist, llama-134m, ... (plan: its blocks or neuron groups are the units)",
        metavar="NAME", commands=_ALL, defaults={"plan": None})
    model_args: dict[str, Any] = option(  # noqa: RUF009 (copied per instance)
        {}, "model", "override a model config field, e.g. --model-arg width=16 (repeatable)",
        flag="--model-arg", metavar="KEY=VALUE", repeat=True, commands=_ALL)
    init_from: str | None = option(
        None, "model", "start from a Hugging Face LLaMA folder (config.json, safetensors, "
        "tokenizer.json): its weights, shape, tokenizer and recipe (docs/init-from.md; "
        "default: a new model from --seed)", metavar="DIR")
    # -- data (None: the recipe's)
    batch_size: int | None = option(
        None, "data", "micro-batch per worker", commands=_ALL, default_note="the recipe's",
        defaults={"bench": 1, **dict.fromkeys(_ESTIMATES, 1)})
    seq_len: int | None = option(
        None, "data", "tokens per sequence, language models", commands=_ALL,
        default_note="the recipe's", defaults={"bench": 2048, **dict.fromkeys(_ESTIMATES, 2048)},
        where=_LM)
    vocab_size: int | None = option(
        None, "data", "tokenizer vocabulary of a trained BPE, language models",
        metavar="V", default_note="the recipe's",
        where="a BPE trained on the corpus (no --tokenizer), or pre-tokenised ids whose "
              "meta.json names no vocab_size")
    data_dir: str | None = option(
        None, "data", "your own text/images instead of the data packages",
        metavar="DIR", default_note="the packages")
    tokenizer: str | None = option(
        None, "data", "a tokenizer.json (any Hugging Face tokenizers file), or gpt2 for the "
        "GPT-2 BPE package, instead of training a BPE on the corpus", metavar="PATH",
        default_note="a BPE trained on the corpus",
        where="text a tokenizer reads (not a --data-dir of pre-tokenised train.bin ids), "
              "language-model recipes")
    dataset: str | None = option(
        None, "data", "text through Hugging Face datasets: a builder (json, parquet, text, "
        "csv, arrow) over --data-files, or a local dataset folder (extra: data)",
        metavar="NAME", default_note="the data packages", where=_LM)
    data_files: list[str] = option(  # noqa: RUF009 (copied per instance)
        [], "data", "local files for --dataset (repeatable)", metavar="GLOB", repeat=True,
        where=_LM)
    text_field: str = option(
        "text", "data", "the documents' text field in JSONL/parquet/datasets", metavar="NAME",
        where="JSONL/parquet/datasets text (--dataset, --data-files or a --data-dir of text)")
    # -- strategy and its composition (strategy.Composition)
    strategy: str = option(
        "b-sdp", "strategy", "what each worker holds (README, Strategies): " + "; ".join(
            f"{n}: {s.help}" for n, s in STRATEGIES.items()), choices=NAMES, commands=_ALL)
    fsdp: bool = option(
        False, "strategy", "shard each held unit over its holders with FSDP2 and shared "
        "parameters over all workers (with ddp: plain FSDP2)", commands=_ALL)
    ac: bool = option(False, "strategy", "activation checkpointing per block", commands=_ALL)
    compile: bool = option(
        False, "strategy", "torch.compile each block (torchtitan style; the first step "
        "compiles, no recompilation after it: docs/composition.md)")
    dtype: str = option(
        "fp32", "strategy", "precision: fp32; bf16-mixed (bf16 compute, fp32 master "
        "parameters, gradients and optimizer state); bf16 (everything stored and computed in "
        "bf16)", choices=DTYPES, commands=_ALL)
    reduce_dtype: str | None = option(
        None, "strategy", "with --fsdp: the dtype gradients are averaged in",
        choices=REDUCE_DTYPES, commands=_TP,
        default_note="the master dtype, fp32 under bf16-mixed")
    zero: int = option(
        0, "strategy", "ZeRO inside holder groups: 1 shards the optimizer state over each "
        "unit's holders, 2 also the reduced gradients (same bytes moved; not with --fsdp)",
        choices=(0, 1, 2), commands=_ALL, on_resume="change")
    bucket_cap_mb: float = option(
        25.0, "strategy", "gradient all-reduce bucket size", metavar="MB", commands=_TP)
    tf32: bool = option(
        True, "strategy", "on CUDA, keep float32 matmuls in full fp32 (default: TF32)",
        where="CUDA devices (not --device cpu)")
    output_scaling: str | None = option(
        None, "strategy", "n-sdp: scale kept hidden units by 1/keep-rate while training",
        choices=OUTPUT_SCALINGS, default_note="keep for n-sdp, else none",
        where="forward-masked neuron strategies (n-sdp)")
    refresh_every: int = option(
        1, "strategy", "bb-sdp/nb-sdp: refresh non-held units from their owners every K steps "
        "(1 = exact)", metavar="K", where="backward-masked strategies (bb-sdp, nb-sdp)")
    stochastic_depth: float = option(
        0.0, "strategy", "ddp baseline: skip each block with probability P per step and rank "
        "(no rescaling, like b-sdp)", metavar="P", where="the ddp baseline")
    neuron_dropout: float = option(
        0.0, "strategy", "ddp baseline: drop whole hidden units/heads/channels of every layer "
        "pair with probability P (inverted dropout)", metavar="P", where="the ddp baseline")
    # -- the plan (strategy.PlanSpec)
    coverage: float = option(
        0.5, "plan", "fraction of units (blocks for b-sdp, neuron groups of every layer for "
        "n-sdp) each worker holds, in (0, 1]", commands=_ALL, on_resume="reshard",
        defaults={"plan": None},
        where="SDP strategies whose plan is made from it (not with --plan-file, --capacities "
              "or --memory-gb)")
    scheme: str = option(
        "spread", "plan", "spread (windows), random, or balanced: each rank holds about the "
        "coverage's share of the units' cost, never worse than spread",
        choices=("spread", "random", "balanced"), commands=_TP, on_resume="reshard",
        defaults={"plan": None}, default_note="spread", where=_HELD_PLAN)
    balance: str = option(
        DEFAULT_BALANCE, "plan", "balanced: the unit costs to balance, one or several at once "
        "(the largest ratio over all is minimised): memory, time, cpu-time, params, grads, "
        "optimizer, activations, flops; measured on the model at the batch size (time: "
        "compute + gradient all-reduce, accelerator rates; cpu-time: CPU rates)",
        metavar="R[+R...]", parse=balance, commands=_TP, on_resume="reshard",
        where="balanced plans (--scheme balanced, --capacities or --memory-gb)")
    min_holders: int = option(
        1, "plan", "every unit is held by at least H workers", metavar="H", commands=_TP,
        on_resume="reshard", where=_HELD_PLAN)
    max_groups: int | None = option(
        None, "plan", "spread/random: at most K distinct holder sets (process groups, each an "
        "NCCL communicator): units tiled into K holder patterns (docs/plans.md)",
        metavar="K", commands=_TP, default_note="no bound",
        where="SDP strategies whose plan is made from --coverage")
    capacities: list[float] | None = option(  # noqa: RUF009 (copied per instance)
        None, "plan", "each rank's share of the units' cost, e.g. 1,0.5,0.5,0.5: a balanced "
        "plan with unequal numbers of units per rank (replaces --coverage)",
        metavar="C0,C1,...", parse=floats, commands=_TP, default_note="--coverage",
        where="block-level SDP strategies")
    memory_gb: list[float] | None = option(  # noqa: RUF009 (copied per instance)
        None, "plan", "memory budget per rank in GB: one per worker, e.g. 80,40,40,40, a "
        "balanced plan in which every rank's estimated peak fits (train: made before the "
        "workers start; plan fit); one for all ranks (plan budget: the strategies and "
        "coverages that fit; plan cluster: whether each fits)", metavar="GB0,GB1,...",
        parse=floats, commands=_TP, default_note="train: --coverage; plan cluster: the "
                                                 "device's", where="block-level SDP strategies")
    comm_mem_mb: float | None = option(
        None, "plan", "device MiB each NCCL communicator takes, counted per rank in the "
        "estimates (0: not counted)", metavar="MB", commands=_TP,
        default_note="NCCL's buffers at their defaults on CUDA, docs/plans.md; 0 on CPU, "
                     "where gloo runs", where="runs planned for --memory-gb")
    plan_file: str | None = option(
        None, "plan", "a saved plan (`subnetdp plan --out`) or a JSON matrix [worker][unit] "
        "of 0/1 over the model's blocks, instead of --coverage/--scheme", metavar="FILE",
        commands=_TP, on_resume="reshard", default_note="made from them",
        where="SDP strategies")
    neuron_groups: int | None = option(
        None, "plan", "n-sdp/nb-sdp: groups per layer pair", commands=_TP, on_resume="reshard",
        default_note="the world size, or its smallest multiple that makes coverage x groups "
                     "whole", where=_NEURON)
    neuron_kinds: str | None = option(
        None, "plan", "n-sdp/nb-sdp: pair kinds to split, e.g. ffn or ffn,heads",
        commands=_TP, on_resume="reshard", default_note="all", where=_NEURON)
    rotate: bool = option(
        False, "plan", "n-sdp/nb-sdp: rotate each layer's spread window by the layer index",
        commands=_TP, on_resume="reshard", where=_NEURON)
    seed: int = option(
        0, "plan", "seed of the model's initialisation, the data order and the plan's random "
        "and balanced schemes", commands=_TP)
    # -- optimizer (None: the recipe's)
    lr: float | None = option(None, "optimizer", "peak learning rate, AdamW",
                              default_note="the recipe's")
    weight_decay: float | None = option(None, "optimizer", "AdamW weight decay",
                                        default_note="the recipe's")
    grad_clip: float | None = option(
        None, "optimizer", "clip the full model's gradient norm to NORM, 0 = off",
        metavar="NORM", default_note="the recipe's")
    # local steps (runtime/local_steps.py, SDP x DiLoCo): the outer optimizer
    sync_every: int = option(
        1, "optimizer", "local steps (SDP x DiLoCo): each worker takes H steps alone, then "
        "each unit's holders average their weight changes in an outer Nesterov step "
        "(1: every step; docs/strategies.md)", metavar="H", commands=_LOCAL_CMDS)
    outer_lr: float = option(0.7, "optimizer", "with --sync-every: the outer step's learning "
                             "rate", where=_LOCAL)
    outer_momentum: float = option(0.9, "optimizer", "with --sync-every: the outer step's "
                                   "Nesterov momentum", where=_LOCAL)
    outer_dtype: str | None = option(
        None, "optimizer", "with --sync-every: the dtype the averaged weight changes travel "
        "in", choices=REDUCE_DTYPES, default_note="the parameters'", where=_LOCAL,
        commands=_LOCAL_CMDS)
    sync_fragments: int = option(
        1, "optimizer", "with --sync-every H: sync F fragments of the model at staggered "
        "steps, one every H/F steps (H a multiple of F)", metavar="F", where=_LOCAL,
        commands=_LOCAL_CMDS)
    # -- schedule
    steps: int = option(300, "schedule", "training steps", on_resume="change")
    warmup: int | None = option(None, "schedule", "linear learning-rate warm-up steps",
                                metavar="STEPS", default_note="the recipe's")
    # -- checkpoints and resume (checkpoint/checkpointer.py)
    ckpt_every: int = option(
        0, "checkpoint", "also write a sharded checkpoint every N steps (0: only the final "
        "one)", metavar="N", on_resume="change")
    ckpt_keep: int = option(
        3, "checkpoint", "keep the newest K checkpoints", metavar="K", on_resume="change",
        where="runs that write checkpoints (--ckpt-every, the final one)")
    final_ckpt: bool = option(
        True, "checkpoint", "do not save the state at the end of the run (default: saved, so "
        "that export, eval and --resume --steps can use it)", on_resume="change",
        where="runs whose checkpoints are built (not ddp with --fsdp or --zero 1)")
    resume: str | None = option(
        None, "checkpoint", "continue runs/NAME from its newest checkpoint (or from the given "
        "runs/NAME/checkpoints/step_N) with the run's own configuration", metavar="RUN",
        on_resume="change", default_note="a new run")
    reshard: bool = option(
        False, "checkpoint", "with --resume: load the checkpoint into a different --nproc, "
        "--coverage or plan (values exact; data order changes: README)",
        where="resumed runs (--resume)")
    accept_new_data: bool = option(
        False, "checkpoint", "with --resume: go on although the corpus changed since the run "
        "recorded it (tokenised with the run's own tokenizer)", on_resume="change")
    # -- faults and elastic runs (train/elastic.py, distributed/timeouts.py)
    max_restarts: int = option(
        0, "faults", "restart the worker group this many times after a failure; it resumes "
        "from the newest checkpoint", on_resume="change")
    min_nproc: int | None = option(
        None, "faults", "elastic shrink: after a worker is lost for good (restarts used up), "
        "go on with one worker fewer, down to N, from the survivors' copies of the step in "
        "flight when every unit has two holders, else from the newest checkpoint; each "
        "smaller world is planned at the start (plan: the report says whether each loss is "
        "recoverable and how each smaller world re-plans)", metavar="N", commands=_TP,
        on_resume="change", default_note="never shrink; plan: --nproc - 1, one loss")
    rescue: bool = option(
        True, "faults", "with --min-nproc: always go on from the newest checkpoint, never "
        "from the survivors' copies of the step in flight (docs/checkpointing.md)",
        on_resume="change", where="runs that go on after a lost worker (--min-nproc)")
    collective_timeout: float = option(
        300.0, "faults", "stop the run when a collective waits S seconds for a peer, naming "
        "the rank that hung (also bounds worker start-up; evaluation and checkpoint writes "
        "get longer; at most 604800: a week)", metavar="S", on_resume="change")
    max_nproc: int | None = option(
        None, "faults", "grow back: start M workers, those beyond --nproc joining at a step "
        "boundary with their state from the holders; after an elastic shrink a lost worker is "
        "restarted and rejoins", metavar="M", on_resume="change", default_note="never grow")
    nnodes: int = option(
        1, "plan", "the workers run on K nodes, contiguous ranks each (train: the local "
        "launcher emulates them; under torchrun, torchrun's nodes count instead); with "
        "--min-holders 2 each unit's holders span >= 2 nodes", metavar="K", commands=_TP,
        on_resume="reshard")
    spread_nodes: bool = option(
        True, "plan", "keep the scheme's rank order: holders may share a node", commands=_TP,
        on_resume="reshard", where=_HELD_PLAN)
    # -- run folder and launch
    nproc: int = option(
        1, "launch", "worker processes (train: local ones, 4 unless given; ignored under "
        "torchrun, which sets the world)", aliases=("--world",), metavar="N", commands=_ALL,
        on_resume="reshard", defaults={"train": None, "plan": None, "bench": 8})
    device: str = option("auto", "launch", "where the workers train (auto: CUDA when "
                         "available)", choices=DEVICES, commands=_ALL,
                         defaults={"bench": "cpu"})
    out: str = option("runs/default", "launch", "the run folder", metavar="DIR",
                      defaults={"train": None}, default_note="runs/<recipe>-<strategy>")
    overwrite: bool = option(
        False, "launch", "a new run into an --out holding an earlier run: delete that run's "
        "files first (without it, such an --out is refused)",
        where="new runs (a resume keeps its folder)")
    # -- logging and tracking (metrics/)
    log_every: int = option(
        10, "tracking", "read and check the loss every N steps (a host sync), write metrics "
        "and print a progress line", metavar="N", on_resume="change")
    progress: bool = option(True, "tracking", "no progress lines (default: rank 0's, every "
                            "--log-every steps)", on_resume="change")
    memory_step: int = option(3, "tracking", "step whose memory is measured (-1: none)",
                              metavar="STEP", on_resume="change")
    peak_tflops: float | None = option(
        None, "tracking", "the device's peak TFLOP/s at the compute dtype (train: for "
        "mfu(%%); plan cluster: for the predicted step time)", metavar="T", commands=_TP,
        on_resume="change", default_note="known CUDA devices; plan cluster: the device "
                                         "table's")
    tensorboard: bool = option(
        False, "tracking", "also write TensorBoard events to RUN/tensorboard (extra: "
        "tensorboard)", on_resume="change")
    wandb: bool = option(
        False, "tracking", "also log to Weights & Biases, offline unless WANDB_MODE=online "
        "(extra: wandb)", on_resume="change")
    wandb_project: str | None = option(
        None, "tracking", "the W&B project (implies --wandb)", metavar="NAME",
        on_resume="change", default_note="subnetdp")
    # -- evaluation
    eval_every: int = option(
        0, "eval", "validate the assembled full model every N steps (0: at the end only)",
        metavar="N", on_resume="change")
    eval_batches: int = option(40, "eval", "validation batches", metavar="N",
                               on_resume="change")
    eval_tasks: list[str] = option(  # noqa: RUF009 (copied per instance)
        [], "eval", "LLaMA: also score the assembled model on these lm-eval tasks with each "
        "validation (e.g. arc_easy,sciq; `subnetdp eval --list-tasks` lists them; metrics "
        "eval/<task>/acc, acc_norm)", metavar="T1,T2", parse=tasks, on_resume="change",
        default_note="none",
        where="LLaMA recipes trained on text (not pre-tokenised ids: lm-eval reads text with "
              "the run's tokenizer)")
    eval_limit: int | None = option(
        None, "eval", "with --eval-tasks: only the first N documents of each task",
        metavar="N", on_resume="change", default_note="all",
        where="runs that score --eval-tasks")
    # 2: the shared precision words (strategy.DTYPES); recorded configs without it are
    # version 1, whose dtype "bf16" meant bf16 compute with fp32 master state (now
    # "bf16-mixed"); a --config JSON file without it must read alike in both (config_file.py)
    config_version: int = option(2, "launch", "the config's version", flag="")

    # [Note: values decoded once]
    # The fields above are the run's file form (config.json, TOML, the command line): the
    # strategy's name and flat options. A run's code reads the values instead, decoded here
    # once per config (and carried along when a config is pickled to a worker): nothing below
    # compares strategy names or rebuilds a Composition. A config is not edited after its
    # values are read (``dataclasses.replace`` makes a new one).
    @functools.cached_property
    def rank_spec(self) -> RankSpec:
        """The run's strategy and composition, checked together."""
        return RankSpec.of(self.strategy, composition_of(self))

    @functools.cached_property
    def plan_spec(self) -> PlanSpec:
        """How the run's plan is made (``subnet.planning.build_plan``)."""
        return PlanSpec.of(self)

    @property
    def strategy_value(self) -> Strategy:
        """The run's ``Strategy`` (``strategy`` is its name, as stored in config.json)."""
        return self.rank_spec.strategy

    def composition(self) -> Composition:
        """How the run's rank is built around its strategy (``parallelize`` reads this)."""
        return self.rank_spec.comp

    def section(self, name: str) -> dict[str, Any]:
        """The values of one section (``SECTIONS``), by option name."""
        return {f.name: getattr(self, f.name) for f in declared() if f.metadata["opt"].section
                == name}

    def label(self, coverage: float | None = None) -> str:
        """The run's name in summary.json and reports (``strategy.label``)."""
        return self.rank_spec.label(coverage)

    @property
    def checkpoints_unbuilt(self) -> str | None:
        """The baseline whose checkpoints are not built, when this run is one (else None)."""
        if self.strategy_value.is_sdp:
            return None
        if self.fsdp:
            return "the plain FSDP2 baseline (ddp with --fsdp)"
        return "ddp --zero 1 (torch's ZeroRedundancyOptimizer)" if self.zero == 1 else None

    @property
    def save_final(self) -> bool:
        """Save the run's state at its end: ``final_ckpt``, where checkpoints are built (the
        two baselines that have none save nothing by default)."""
        return self.final_ckpt and self.checkpoints_unbuilt is None

    def saves_at(self, step: int) -> bool:
        """A checkpoint is written after ``step``: every ``ckpt_every`` steps, and at the end
        of the run (``save_final``)."""
        every = self.ckpt_every
        return (every > 0 and step % every == 0) or (step == self.steps and self.save_final)


@functools.cache
def option_types() -> dict[str, Any]:
    """Every option's type, resolved once (each resolution compiles every annotation)."""
    import typing

    return typing.get_type_hints(TrainOptions)


def declared() -> tuple[dataclasses.Field[Any], ...]:
    """Every option's field, in declaration order."""
    return dataclasses.fields(TrainOptions)


def opt(name: str) -> Opt:
    """The declaration of option ``name``."""
    return _by_name()[name].metadata["opt"]  # type: ignore[no-any-return]


@functools.cache
def _by_name() -> dict[str, dataclasses.Field[Any]]:
    return {f.name: f for f in declared()}


def default(name: str) -> Any:
    """Option ``name``'s default (a fresh copy of a list or dict)."""
    f = _by_name()[name]
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def flag(name: str) -> str:
    """The option's command-line flag (``--no-NAME`` for a switch on by default)."""
    o = opt(name)
    if o.flag is not None:
        return o.flag
    dashed = "--" + name.replace("_", "-")
    return "--no-" + dashed[2:] if default(name) is True else dashed


def resumable(*kinds: OnResume) -> frozenset[str]:
    """The options a resumed run may change (``change``), or with --reshard (``reshard``)."""
    return frozenset(f.name for f in declared() if f.metadata["opt"].on_resume in kinds)
