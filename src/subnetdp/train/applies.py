"""Which ``train`` options apply to which runs: an option that cannot apply is refused in one
line, never ignored (issue 27).

``APPLIES`` is the one table: a ``TrainConfig`` field -> when it applies (a predicate over the
run's configuration that asks the ``Strategy``'s properties, the recipe's task and the data,
never a strategy's name) and the words that say where it does. ``check_applicable`` runs it
once, where ``train`` decodes its options (``commands/train_cmd.config_from_args``: the
command line and ``--config`` files alike), before any default is filled in. A value equal to
the field's default is inert and always accepted; a field not in the table applies to every
run (``ALWAYS``): tests/cli/test_applicability.py holds every parser option to one of the two.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from subnetdp.strategy import Strategy

# A TrainConfig, untyped here: train/config.py asks this module which defaults a run records,
# so importing it back would make the two modules a cycle.
TrainConfig = Any

__all__ = ["ALWAYS", "APPLIES", "NEGATED", "Rule", "applies", "check_applicable"]


@dataclass(frozen=True)
class Rule:
    """``when(cfg)``: the option has an effect on the run ``cfg``; ``where``: what such runs
    are, in the words of the refusal ("... applies to WHERE; drop it")."""

    when: Callable[[TrainConfig], bool]
    where: str


def _strategy(cfg: TrainConfig) -> Strategy:
    return cfg.strategy_value


def _lm(cfg: TrainConfig) -> bool:
    from subnetdp.models import get_recipe

    return get_recipe(cfg.recipe).task == "lm"


def _llama_lm(cfg: TrainConfig) -> bool:
    """A language model whose model is our LLaMA: lm-eval scores it as ``LlamaForCausalLM``
    (hf/llama.py), as ``export --format hf`` writes it."""
    import torch

    from subnetdp.models import get_recipe
    from subnetdp.models.llama.model import Llama

    recipe = get_recipe(cfg.recipe)
    with torch.device("meta"):
        return recipe.task == "lm" and isinstance(recipe.build_model(), Llama)


def _pretokenised(cfg: TrainConfig) -> bool:
    """A ``--data-dir`` of token ids (``train.bin``), read as is (``data.prepare_text``)."""
    return cfg.data_dir is not None and (Path(cfg.data_dir).expanduser() / "train.bin").exists()


def _ids_without_vocab(cfg: TrainConfig) -> bool:
    """Pre-tokenised ids whose meta.json names no vocabulary: ``--vocab-size`` is it."""
    meta = Path(cfg.data_dir or ".").expanduser() / "meta.json"
    try:
        return "vocab_size" not in json.loads(meta.read_text())
    except (OSError, ValueError, TypeError):
        return True  # no meta.json (or none to read): the data loader says what is wrong


def _held_plan(cfg: TrainConfig) -> bool:
    """An SDP run whose plan is made from --coverage/--scheme (not read from --plan-file)."""
    return _strategy(cfg).is_sdp and cfg.plan_file is None


APPLIES: dict[str, Rule] = {
    # data and tokenizer (language models only)
    "vocab_size": Rule(lambda c: _lm(c) and c.tokenizer is None and (
        not _pretokenised(c) or _ids_without_vocab(c)),
        "a BPE trained on the corpus (no --tokenizer), or pre-tokenised ids whose meta.json "
        "names no vocab_size"),
    "tokenizer": Rule(lambda c: _lm(c) and not _pretokenised(c),
                      "text a tokenizer reads (not a --data-dir of pre-tokenised train.bin "
                      "ids), language-model recipes"),
    "seq_len": Rule(_lm, "language-model recipes"),
    "dataset": Rule(_lm, "language-model recipes"),
    "data_files": Rule(_lm, "language-model recipes"),
    "text_field": Rule(lambda c: _lm(c) and not _pretokenised(c) and bool(
        c.dataset or c.data_files or c.data_dir),
        "JSONL/parquet/datasets text (--dataset, --data-files or a --data-dir of text)"),
    # the plan
    "coverage": Rule(lambda c: _held_plan(c) and c.capacities is None and c.memory_gb is None,
                     "SDP strategies whose plan is made from it (not with --plan-file, "
                     "--capacities or --memory-gb)"),
    "scheme": Rule(_held_plan, "SDP strategies without --plan-file"),
    "spread_nodes": Rule(_held_plan, "SDP strategies without --plan-file"),
    "balance": Rule(lambda c: _held_plan(c) and (
        c.scheme == "balanced" or c.capacities is not None or c.memory_gb is not None),
        "balanced plans (--scheme balanced, --capacities or --memory-gb)"),
    "min_holders": Rule(_held_plan, "SDP strategies without --plan-file"),
    "plan_file": Rule(lambda c: _strategy(c).is_sdp, "SDP strategies"),
    "capacities": Rule(lambda c: _strategy(c).level == "block", "block-level SDP strategies"),
    "memory_gb": Rule(lambda c: _strategy(c).level == "block", "block-level SDP strategies"),
    "comm_mem_mb": Rule(lambda c: c.memory_gb is not None, "runs planned for --memory-gb"),
    "neuron_groups": Rule(lambda c: _strategy(c).neuron_level, "neuron-level strategies"),
    "neuron_kinds": Rule(lambda c: _strategy(c).neuron_level, "neuron-level strategies"),
    "rotate": Rule(lambda c: _strategy(c).neuron_level, "neuron-level strategies"),
    "output_scaling": Rule(lambda c: _strategy(c).default_output_scaling == "keep",
                           "forward-masked neuron strategies (n-sdp)"),
    "refresh_every": Rule(lambda c: _strategy(c).backward_masked,
                          "backward-masked strategies (bb-sdp, nb-sdp)"),
    "stochastic_depth": Rule(lambda c: not _strategy(c).is_sdp, "the ddp baseline"),
    "neuron_dropout": Rule(lambda c: not _strategy(c).is_sdp, "the ddp baseline"),
    # checkpoints and restarts
    "ckpt_keep": Rule(lambda c: c.ckpt_every > 0 or c.save_final,
                      "runs that write checkpoints (--ckpt-every, the final one)"),
    "final_ckpt": Rule(lambda c: c.checkpoints_unbuilt is None,
                       "runs whose checkpoints are built (not ddp with --fsdp or --zero 1)"),
    "reshard": Rule(lambda c: c.resume is not None, "resumed runs (--resume)"),
    "overwrite": Rule(lambda c: c.resume is None, "new runs (a resume keeps its folder)"),
    # precision on CUDA only
    "tf32": Rule(lambda c: c.device != "cpu", "CUDA devices (not --device cpu)"),
    "max_groups": Rule(_held_plan, "SDP strategies whose plan is made from --coverage"),
    "rescue": Rule(lambda c: c.min_nproc is not None, "runs that go on after a lost worker "
                   "(--min-nproc)"),
    # downstream evaluation (issue 31)
    "eval_tasks": Rule(lambda c: _llama_lm(c) and not _pretokenised(c),
                       "LLaMA recipes trained on text (not pre-tokenised ids: lm-eval reads "
                       "text with the run's tokenizer)"),
    "eval_limit": Rule(lambda c: bool(c.eval_tasks) and _llama_lm(c),
                       "runs that score --eval-tasks"),
}

# Fields with an effect on every run (their ranges are TrainConfig.validate's); ``config``,
# ``resume`` and ``out`` are where a run comes from and goes.
ALWAYS = frozenset({
    "recipe", "model_args", "batch_size", "data_dir", "strategy", "fsdp", "ac", "zero",
    "dtype", "reduce_dtype", "bucket_cap_mb", "steps", "seed", "lr", "warmup", "weight_decay",
    "grad_clip", "ckpt_every", "max_restarts", "min_nproc", "nproc", "device",
    "collective_timeout", "log_every", "progress", "eval_every", "eval_batches", "memory_step",
    "peak_tflops", "tensorboard", "wandb", "wandb_project", "out", "resume",
    "config_version", "compile", "accept_new_data",
    "init_from", "nnodes", "max_nproc"})


# Switches on by default: the flag a user gives turns them off.
NEGATED = {"tf32": "--no-tf32", "rescue": "--no-rescue", "final_ckpt": "--no-final-ckpt",
           "spread_nodes": "--no-spread-nodes"}


def applies(cfg: TrainConfig, name: str) -> bool:
    """Whether field ``name`` has an effect on the run ``cfg``."""
    rule = APPLIES.get(name)
    return rule is None or rule.when(cfg)


def _default(cfg: TrainConfig, name: str) -> object:
    f = next(f for f in dataclasses.fields(cfg) if f.name == name)
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def check_applicable(cfg: TrainConfig, only: Collection[str] | None = None) -> None:
    """Raise ``ValueError`` (one line: the option, its value, where it applies) for the first
    field of ``APPLIES`` (of ``only``, when given) set to a value other than its default on a
    run it has no effect on."""
    for name, rule in APPLIES.items():
        if only is not None and name not in only:
            continue
        value = getattr(cfg, name)
        if value == _default(cfg, name) or rule.when(cfg):
            continue
        flag = NEGATED.get(name, "--" + name.replace("_", "-"))
        shown = "" if isinstance(value, bool) else f" {_shown(value)}"
        raise ValueError(f"{flag}{shown} has no effect on this run: it applies to {rule.where} "
                         f"only; drop it")


def _shown(value: object) -> str:
    if isinstance(value, list):
        return ",".join(str(v) for v in value)
    return str(value)
