"""Which ``train`` options apply to which runs: an option that cannot apply is refused in one
line, never ignored (issue 27).

``APPLIES`` is the one table: an option -> when it applies (``WHEN``: a predicate over the
run's configuration that asks the ``Strategy``'s properties, the recipe's task and the data,
never a strategy's name) and the words that say where it does (its declaration's ``where``,
train/options.py). ``check_applicable`` runs it
once, where ``train`` decodes its options (``commands/train_cmd.config_from_args``: the
command line and ``--config`` files alike), before any default is filled in. A value equal to
the option's default is inert and always accepted; an option declared without ``where``
applies to every run (``ALWAYS``). An option declared with a ``where`` and no predicate here
(or the reverse) fails at import.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path

from subnetdp.strategy import Strategy
from subnetdp.train.options import TrainOptions, declared, default, flag, opt

__all__ = ["ALWAYS", "APPLIES", "WHEN", "Rule", "applies", "check_applicable"]


@dataclass(frozen=True)
class Rule:
    """``when(cfg)``: the option has an effect on the run ``cfg``; ``where``: what such runs
    are, in the words of the refusal ("... applies to WHERE; drop it")."""

    when: Callable[[TrainOptions], bool]
    where: str


def _strategy(cfg: TrainOptions) -> Strategy:
    return cfg.strategy_value


def _lm(cfg: TrainOptions) -> bool:
    from subnetdp.models import get_recipe

    return get_recipe(cfg.recipe).task == "lm"


def _llama_lm(cfg: TrainOptions) -> bool:
    """A language model whose model is our LLaMA: lm-eval scores it as ``LlamaForCausalLM``
    (hf/llama.py), as ``export --format hf`` writes it."""
    import torch

    from subnetdp.models import get_recipe
    from subnetdp.models.llama.model import Llama

    recipe = get_recipe(cfg.recipe)
    with torch.device("meta"):
        return recipe.task == "lm" and isinstance(recipe.build_model(), Llama)


def _pretokenised(cfg: TrainOptions) -> bool:
    """A ``--data-dir`` of token ids (``train.bin``), read as is (``data.prepare_text``)."""
    return cfg.data_dir is not None and (Path(cfg.data_dir).expanduser() / "train.bin").exists()


def _ids_without_vocab(cfg: TrainOptions) -> bool:
    """Pre-tokenised ids whose meta.json names no vocabulary: ``--vocab-size`` is it."""
    meta = Path(cfg.data_dir or ".").expanduser() / "meta.json"
    try:
        return "vocab_size" not in json.loads(meta.read_text())
    except (OSError, ValueError, TypeError):
        return True  # no meta.json (or none to read): the data loader says what is wrong


def _held_plan(cfg: TrainOptions) -> bool:
    """An SDP run whose plan is made from --coverage/--scheme (not read from --plan-file)."""
    return _strategy(cfg).is_sdp and cfg.plan_file is None


WHEN: dict[str, Callable[[TrainOptions], bool]] = {
    # data and tokenizer (language models only)
    "vocab_size": lambda c: _lm(c) and c.tokenizer is None and (
        not _pretokenised(c) or _ids_without_vocab(c)),
    "tokenizer": lambda c: _lm(c) and not _pretokenised(c),
    "seq_len": _lm,
    "dataset": _lm,
    "data_files": _lm,
    "text_field": lambda c: _lm(c) and not _pretokenised(c) and bool(
        c.dataset or c.data_files or c.data_dir),
    # the plan
    "coverage": lambda c: _held_plan(c) and c.capacities is None and c.memory_gb is None,
    "scheme": _held_plan,
    "spread_nodes": _held_plan,
    "balance": lambda c: _held_plan(c) and (
        c.scheme == "balanced" or c.capacities is not None or c.memory_gb is not None),
    "min_holders": _held_plan,
    "max_groups": _held_plan,
    "plan_file": lambda c: _strategy(c).is_sdp,
    "capacities": lambda c: _strategy(c).balanceable,
    "memory_gb": lambda c: _strategy(c).balanceable,
    "comm_mem_mb": lambda c: c.memory_gb is not None,
    "neuron_groups": lambda c: _strategy(c).splits_layers,
    "neuron_kinds": lambda c: _strategy(c).splits_layers,
    "rotate": lambda c: _strategy(c).splits_layers,
    "output_scaling": lambda c: _strategy(c).default_output_scaling == "keep",
    "refresh_every": lambda c: _strategy(c).backward_masked,
    "stochastic_depth": lambda c: not _strategy(c).is_sdp,
    "neuron_dropout": lambda c: not _strategy(c).is_sdp,
    # local steps (runtime/local_steps.py)
    "outer_lr": lambda c: c.sync_every > 1,
    "outer_momentum": lambda c: c.sync_every > 1,
    "outer_dtype": lambda c: c.sync_every > 1,
    "sync_fragments": lambda c: c.sync_every > 1,
    # checkpoints and restarts
    "ckpt_keep": lambda c: c.ckpt_every > 0 or c.save_final,
    "final_ckpt": lambda c: c.checkpoints_unbuilt is None,
    "reshard": lambda c: c.resume is not None,
    "overwrite": lambda c: c.resume is None,
    "rescue": lambda c: c.min_nproc is not None,
    # precision on CUDA only
    "tf32": lambda c: c.device != "cpu",
    # downstream evaluation (issue 31)
    "eval_tasks": lambda c: _llama_lm(c) and not _pretokenised(c),
    "eval_limit": lambda c: bool(c.eval_tasks) and _llama_lm(c),
}


def _table() -> dict[str, Rule]:
    """``WHEN`` joined to the declarations' ``where``, in declaration order."""
    where = {f.name: text for f in declared() if (text := opt(f.name).where) is not None}
    if set(where) != set(WHEN):
        raise RuntimeError(f"train.applies.WHEN and the declarations' where differ: "
                           f"{sorted(set(where) ^ set(WHEN))}")
    return {name: Rule(WHEN[name], text) for name, text in where.items()}


APPLIES: dict[str, Rule] = _table()
# Options with an effect on every run (their ranges are TrainOptions.validate's).
ALWAYS = frozenset(f.name for f in declared()) - set(APPLIES)


def applies(cfg: TrainOptions, name: str) -> bool:
    """Whether field ``name`` has an effect on the run ``cfg``."""
    rule = APPLIES.get(name)
    return rule is None or rule.when(cfg)


def check_applicable(cfg: TrainOptions, only: Collection[str] | None = None) -> None:
    """Raise ``ValueError`` (one line: the option, its value, where it applies) for the first
    field of ``APPLIES`` (of ``only``, when given) set to a value other than its default on a
    run it has no effect on."""
    for name, rule in APPLIES.items():
        if only is not None and name not in only:
            continue
        value = getattr(cfg, name)
        if value == default(name) or rule.when(cfg):
            continue
        shown = "" if isinstance(value, bool) else f" {_shown(value)}"
        raise ValueError(f"{flag(name)}{shown} has no effect on this run: it applies to "
                         f"{rule.where} only; drop it")


def _shown(value: object) -> str:
    if isinstance(value, list):
        return ",".join(str(v) for v in value)
    return str(value)
