"""The quality study's suites: which runs (cells) make up a comparison, and at what budget.

A *cell* is one training run: task × method × coverage × steps × seed. A *budget* maps each
(method, coverage) to a number of steps:

- step-matched: every method trains ``S`` steps.
- FLOP-matched (the paper's convention): methods whose forward pass skips part of the model
  train ``round(S / C)`` steps, everyone else ``S``. Those are the forward-masked SDP variants
  (b-sdp, n-sdp) and stochastic depth, which skips a fraction 1 - C of the blocks in
  expectation and so also spends about C of DDP's block FLOPs per step. Neuron dropout
  multiplies by a mask and saves nothing; bb-sdp/nb-sdp run the full forward. The convention
  slightly favours the 1/C methods: shared layers (embeddings, head, stem) are not masked, so
  their real FLOPs per step are above C of DDP's.

Cells that two budgets share (DDP, backward masking, dropout, and every method's S-step run)
are one run.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from subnetdp.strategy import NAMES, STRATEGIES, Strategy, get_strategy, matched_steps
from subnetdp.train.config import TrainConfig

BUDGETS = ("step", "flop")
# Study-only baselines: ddp with a regulariser at rate 1 - C (the TrainConfig field it sets).
REGULARISED = {"ddp+sd": "stochastic_depth", "ddp+dropout": "neuron_dropout"}
# Methods in table order: every strategy, then the baselines.
METHODS = (*NAMES, *REGULARISED)
# get round(S / C) steps when FLOP-matched: the forward-masked strategies, and stochastic depth
FLOP_SCALED = frozenset({*(n for n, s in STRATEGIES.items() if s.flop_scaled), "ddp+sd"})


def method_strategy(method: str) -> Strategy:
    """The strategy a method trains with: its own, or ddp for the regularised baselines."""
    return get_strategy("ddp" if method in REGULARISED else method)


def is_reference(method: str) -> bool:
    """The full model without a regulariser (ddp): one run at C = 1 that the rest compare to."""
    return method not in REGULARISED and not method_strategy(method).is_sdp


@dataclass(frozen=True)
class TaskSpec:
    """One model + data set of the study, with the fixed training settings of all its runs."""

    name: str  # short name used in file names: "llama", "resnet"
    recipe: str
    steps: int  # S, the step-matched budget
    train: dict[str, Any] = field(default_factory=dict)  # TrainConfig fields (batch, lr, ...)
    # Fashion-MNIST tasks: train on a fixed random subset of this many training images (the
    # over-fitting regime; study/subset.py writes it under the runs folder), test on all.
    train_images: int | None = None

    @property
    def metric(self) -> str:
        """The headline quality figure of this task's summaries."""
        return "val_loss" if self.recipe.startswith("llama") else "val_accuracy"


@dataclass(frozen=True)
class Suite:
    name: str
    tasks: tuple[TaskSpec, ...]
    coverages: tuple[float, ...] = (0.75, 0.5, 0.375)
    methods: tuple[str, ...] = METHODS
    seeds: int = 3
    nproc: int = 4


@dataclass(frozen=True, order=True)
class Cell:
    """One training run of the suite."""

    task: str
    method: str
    coverage: float  # 1.0 for DDP
    steps: int
    seed: int

    def run_name_in(self, world: int) -> str:
        cov = "" if is_reference(self.method) else f"-C{self.coverage:g}"
        groups = neuron_groups(self.method, self.coverage, world)
        g = f"-g{groups}" if groups is not None else ""
        return f"{self.task}/{self.method}{cov}{g}-s{self.steps}-seed{self.seed}"


def neuron_groups(method: str, coverage: float, world: int) -> int | None:
    """Groups per layer pair for n-sdp/nb-sdp: the default (``world``, returned as None) when
    coverage x world is a whole number of groups, else the smallest multiple of ``world`` that
    makes it one (C = 0.375 on 4 workers: 8 groups, 3 held; with 4, round(1.5) = 2 would be
    held, i.e. C = 0.5). A pair with fewer slots than groups (llama-tiny's 4 attention heads)
    still gets one group per slot, so its coverage stays rounded."""
    if not method_strategy(method).splits_layers:
        return None
    for m in range(1, 9):
        k = coverage * world * m
        if abs(k - round(k)) < 1e-9:
            return None if m == 1 else world * m
    return None


def budget_steps(method: str, coverage: float, steps: int, budget: str) -> int:
    """Steps of ``method`` at ``coverage`` under ``budget`` (S = ``steps``)."""
    if budget not in BUDGETS:
        raise ValueError(f"unknown budget {budget!r}; use one of {BUDGETS}")
    if budget == "flop" and method in FLOP_SCALED:
        return matched_steps(steps, coverage)
    return steps


def method_points(suite: Suite) -> list[tuple[str, float]]:
    """(method, coverage) pairs in table order: DDP once, then every method at every C."""
    points = [(m, 1.0) for m in suite.methods if is_reference(m)]
    for c in suite.coverages:
        points += [(m, c) for m in suite.methods if not is_reference(m)]
    return points


def budget_cells(suite: Suite, task: TaskSpec, budget: str) -> list[Cell]:
    """The cells of one task under one budget (every seed)."""
    return [Cell(task.name, m, c, budget_steps(m, c, task.steps, budget), seed)
            for m, c in method_points(suite) for seed in range(suite.seeds)]


def enumerate_cells(suite: Suite) -> list[Cell]:
    """Every distinct run of the suite (shared cells once), seed by seed: a suite stopped
    early still has every cell of its first seeds."""
    cells: dict[Cell, None] = {}
    for seed in range(suite.seeds):
        for task in suite.tasks:
            for budget in BUDGETS:
                for cell in budget_cells(suite, task, budget):
                    if cell.seed == seed:
                        cells.setdefault(cell, None)
    return list(cells)


def cell_config(suite: Suite, task: TaskSpec, cell: Cell, out: str,
                data_dir: str | None = None) -> TrainConfig:
    """The TrainConfig of one cell: the task's settings, the method's strategy or baseline;
    ``data_dir``: the task's data folder (its ``train_images`` subset)."""
    fields: dict[str, Any] = dict(task.train)
    fields.update(recipe=task.recipe, steps=cell.steps, seed=cell.seed, nproc=suite.nproc,
                  out=out, progress=False)
    if data_dir is not None:
        fields["data_dir"] = data_dir
    # a cell's result is its summary: a study of many cells keeps no final states (GBs) unless
    # its task asks for checkpoints (the convergence study's --ckpt-every)
    fields.setdefault("final_ckpt", False)
    if cell.seed > 0:
        # Peak memory depends on shapes, not on the seed: measure it on seed 0 only (the
        # instrumented step costs 1-4 s of a run of a few tens of seconds).
        fields["memory_step"] = -1
    if cell.method in REGULARISED:
        fields.update(strategy=method_strategy(cell.method).name,
                      **{REGULARISED[cell.method]: round(1.0 - cell.coverage, 6)})
    else:
        fields.update(strategy=cell.method, coverage=cell.coverage,
                      neuron_groups=neuron_groups(cell.method, cell.coverage, suite.nproc))
    return TrainConfig(**fields)


# ---- the suites ------------------------------------------------------------------------------
# Sized for 4 workers on a shared 2-core CPU, measured (docs/results/quality.md): llama-tiny
# (2.66 M params: 8 blocks, dim 128, vocab 4096) at batch 8 x 32 tokens per worker, DDP
# ~0.26 s/step; resnet18-fmnist at width 8 (0.18 M params) and batch 32, DDP ~0.11 s/step;
# ~5 s of start-up and evaluation per run. The recipes' warm-ups (100 steps for llama-tiny)
# are shortened to fit the short budgets.

_LLAMA_TRAIN: dict[str, Any] = {"batch_size": 8, "seq_len": 32, "warmup": 5, "eval_batches": 20}
_RESNET_TRAIN: dict[str, Any] = {"batch_size": 32, "model_args": {"width": 8},
                                 "eval_batches": 20}

QUALITY = Suite(
    name="quality",
    tasks=(
        TaskSpec("llama", "llama-tiny", steps=40, train=_LLAMA_TRAIN),
        TaskSpec("resnet", "resnet18-fmnist", steps=60, train=_RESNET_TRAIN),
    ),
)

# --quick: the same methods at C = 0.5 only, one seed, a few steps: under 10 minutes.
QUICK = Suite(
    name="quality-quick",
    tasks=(
        TaskSpec("llama", "llama-tiny", steps=20,
                 train=_LLAMA_TRAIN | {"warmup": 3, "eval_batches": 4}),
        TaskSpec("resnet", "resnet18-fmnist", steps=20,
                 train=_RESNET_TRAIN | {"eval_batches": 4}),
    ),
    coverages=(0.5,),
    seeds=1,
)

SUITES = {"quality": QUALITY}


def select(suite: Suite, *, tasks: list[str] | None = None, seeds: int | None = None,
           steps: int | None = None) -> Suite:
    """``suite`` restricted to some tasks, with another seed count or step budget S."""
    chosen = suite.tasks
    if tasks:
        unknown = set(tasks) - {t.name for t in suite.tasks}
        if unknown:
            raise ValueError(f"unknown task(s) {sorted(unknown)}; the suite has "
                             f"{[t.name for t in suite.tasks]}")
        chosen = tuple(t for t in suite.tasks if t.name in tasks)
    if steps is not None:
        chosen = tuple(dataclasses.replace(t, steps=steps) for t in chosen)
    return Suite(suite.name, chosen, suite.coverages, suite.methods,
                 suite.seeds if seeds is None else seeds, suite.nproc)
