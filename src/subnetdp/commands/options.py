"""Command-line options shared by the subcommands: one definition (name, type, meaning) each.

Kept torch-free: ``plan`` imports it and must not load torch (``strategy`` is torch-free).
"""

from __future__ import annotations

import argparse
import json

from subnetdp.estimate.communicators import DEFAULT_COMM_MB
from subnetdp.strategy import (
    BASELINES,
    DTYPES,
    NAMES,
    REDUCE_DTYPES,
    SDP_NAMES,
    STRATEGIES,
    Composition,
    parse_label,
)

# argparse's common base of parsers, argument groups and mutually exclusive groups
Container = argparse._ActionsContainer


class HelpFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default, unless the help already names one or there
    is none to show (None, a flag's False/True, an empty list)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if ("default" in text or default is None or default is argparse.SUPPRESS
                or isinstance(default, bool) or default == []):
            return text
        return f"{text} (default: %(default)s)"


def old_name(old: str) -> str:
    """The help note of a spelling kept for one release (CHANGELOG, Unreleased)."""
    return f" ({old}: the old spelling, kept for one release)"


DTYPE_HELP = ("precision: fp32; bf16-mixed (bf16 compute, fp32 master parameters, gradients "
              "and optimizer state); bf16 (everything stored and computed in bf16)")


def add_model_arg_argument(p: Container) -> None:
    p.add_argument("--model-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="override a model config field, e.g. --model-arg width=16 (repeatable)")


def parse_model_arg(text: str) -> tuple[str, object]:
    """``KEY=VALUE`` -> (key, the value as JSON if it parses, else the string)."""
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise ValueError(f"--model-arg expects KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(raw)
    except json.JSONDecodeError:
        return key, raw


COMM_MEM_HELP = ("device MiB each NCCL communicator takes, counted per rank in the estimates "
                 "(default {default}; 0: not counted)")


def add_comm_mem_argument(p: Container, *, default: str) -> None:
    """``--comm-mem-mb``: what ``plan --memory-gb`` and ``train --memory-gb`` count per
    communicator (``estimate.communicators.comm_mem_mb`` turns None into the default);
    ``default`` says what that is, ``{mb}`` standing for NCCL's ``DEFAULT_COMM_MB``."""
    note = default.format(mb=f"{DEFAULT_COMM_MB:g}")
    p.add_argument("--comm-mem-mb", type=float, default=None, metavar="MB",
                   help=COMM_MEM_HELP.format(default=note))


def add_nproc_argument(p: Container, *, default: int | None, help: str) -> None:
    """``--nproc N``, the number of workers everywhere; ``--world`` is its old spelling in
    ``plan`` and ``bench`` (dest ``world`` there)."""
    p.add_argument("--nproc", "--world", dest="world", type=int, default=default, metavar="N",
                   help=help + old_name("--world"))


def add_min_nproc_argument(p: Container, *, help: str) -> None:
    """``--min-nproc N``: the fewest workers an elastic run goes on with (train), or reports
    its re-plans for (plan): [Note: shrinking plans] in plan/shrink.py."""
    p.add_argument("--min-nproc", type=int, default=None, metavar="N", help=help)


def add_node_arguments(p: Container) -> None:
    """``--nnodes K`` and ``--no-spread-nodes``: failure domains ([Note: holders across
    nodes] in plan/nodes.py)."""
    p.add_argument("--nnodes", type=int, default=None, metavar="K",
                   help="the workers run on K nodes, contiguous ranks each (train: the local "
                        "launcher emulates them; under torchrun, torchrun's nodes count "
                        "instead); with --min-holders 2 each unit's holders span >= 2 nodes "
                        "(default 1)")
    p.add_argument("--no-spread-nodes", dest="spread_nodes", action="store_false",
                   default=None, help="keep the scheme's rank order: holders may share a node")


def add_recipe_argument(p: Container, *, default: str | None, help: str) -> None:
    p.add_argument("--recipe", default=default, metavar="NAME", help=help)


def add_batch_arguments(p: Container, *, batch_size: int | None, seq_len: int | None,
                        default_note: str) -> None:
    """``--batch-size`` (per worker) and ``--seq-len`` (tokens per sample)."""
    p.add_argument("--batch-size", type=int, default=batch_size,
                   help=f"micro-batch per worker ({default_note})")
    p.add_argument("--seq-len", type=int, default=seq_len,
                   help=f"tokens per sequence, language models ({default_note})")


def add_dtype_argument(p: Container, *, default: str = "fp32") -> None:
    p.add_argument("--dtype", default=default, choices=DTYPES, help=DTYPE_HELP)


def add_reduce_dtype_argument(p: Container) -> None:
    p.add_argument("--reduce-dtype", default=None, choices=REDUCE_DTYPES,
                   help="with --fsdp: the dtype gradients are averaged in (default: the master "
                        "dtype, fp32 under bf16-mixed)")


def add_bucket_cap_argument(p: Container, *, default: float = Composition.bucket_cap_mb) -> None:
    p.add_argument("--bucket-cap-mb", type=float, default=default, metavar="MB",
                   help="gradient all-reduce bucket size")


DEVICES = ("auto", "cpu", "cuda")


def add_device_argument(p: Container, *, default: str | None, help: str) -> None:
    """``--device``: the same three choices everywhere; auto = CUDA when available."""
    p.add_argument("--device", default=default, choices=DEVICES,
                   help=f"{help} (auto: CUDA when available)")


def add_plan_file_argument(p: Container, *, help: str) -> None:
    p.add_argument("--plan-file", default=None, metavar="FILE", help=help)


def add_strategy_argument(p: Container, *, default: str, sdp_only: bool = False,
                          labels: bool = False, note: str | None = None) -> None:
    """``--strategy``: a name of ``strategy.STRATEGIES`` (``sdp_only``: subnetwork strategies
    only); ``labels``: also the composed names ``parse_label`` reads (``fsdp+ac``,
    ``b-sdp+fsdp``); ``note``: what it means to this command."""
    default_help = f"(default {default})"
    if labels:
        p.add_argument("--strategy", default=default, type=strategy_label, metavar="STRATEGY",
                       help=f"{', '.join((*BASELINES, *SDP_NAMES))}, or an SDP strategy with "
                            f"+fsdp/+ac {default_help}")
    else:
        names = SDP_NAMES if sdp_only else NAMES
        what = "; ".join(f"{n}: {STRATEGIES[n].help}" for n in names)
        p.add_argument("--strategy", default=default, choices=names,
                       help=f"{note + '. ' if note else ''}{what} {default_help}")


def add_composition_arguments(p: Container, *, zero: bool = False,
                              compile: bool = False) -> None:
    """``--fsdp`` and ``--ac`` (and ``--zero``, where the command uses it): what a strategy is
    composed with (``strategy.Composition``)."""
    p.add_argument("--fsdp", action="store_true",
                   help="shard each held unit over its holders with FSDP2 and shared "
                        "parameters over all workers (with ddp: plain FSDP2)")
    p.add_argument("--ac", action="store_true", help="activation checkpointing per block")
    if compile:
        p.add_argument("--compile", action="store_true",
                       help="torch.compile each block (torchtitan style; the first step "
                            "compiles, no recompilation after it: docs/composition.md)")
    if not zero:
        return
    p.add_argument("--zero", type=int, default=0, choices=(0, 1, 2),
                   help="ZeRO inside holder groups: 1 shards the optimizer state over each "
                        "unit's holders, 2 also the reduced gradients (same bytes moved; "
                        "not with --fsdp)")


def add_neuron_arguments(p: Container) -> None:
    """How n-sdp / nb-sdp split each layer pair (``subnet.neurons.make_neuron_plan``)."""
    p.add_argument("--neuron-groups", type=int, default=None,
                   help="n-sdp/nb-sdp: groups per layer pair (default: the world size, or "
                        "its smallest multiple that makes coverage x groups whole)")
    p.add_argument("--neuron-kinds", default=None,
                   help="n-sdp/nb-sdp: pair kinds to split, e.g. ffn or ffn,heads "
                        "(default: all)")
    p.add_argument("--rotate", action="store_true",
                   help="n-sdp/nb-sdp: rotate each layer's spread window by the layer index")


SCHEMES = ("spread", "random", "balanced")


def _balance(text: str) -> str:
    from subnetdp.plan.objectives import parse_balance
    from subnetdp.plan.plan import PlanError

    try:
        parse_balance(text)
    except PlanError as e:  # argparse shows an ArgumentTypeError's message as is
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def add_scheme_arguments(p: Container, *, default: str | None) -> None:
    """``--scheme``, ``--balance`` and ``--min-holders`` (``plan.schemes.make_plan``)."""
    from subnetdp.plan.objectives import DEFAULT_BALANCE, RESOURCES

    p.add_argument("--scheme", default=default, choices=SCHEMES,
                   help="spread (windows), random, or balanced: each rank holds about the "
                        "coverage's share of the units' cost, never worse than spread "
                        f"(default {default or 'spread'})")
    p.add_argument("--balance", default=DEFAULT_BALANCE, type=_balance, metavar="R[+R...]",
                   help=f"balanced: the unit costs to balance, one or several at once (the "
                        f"largest ratio over all is minimised): {', '.join(RESOURCES)}; "
                        "measured on the model at the batch size (time: compute + gradient "
                        "all-reduce, accelerator rates; cpu-time: CPU rates) "
                        f"(default {DEFAULT_BALANCE})")
    p.add_argument("--min-holders", type=int, default=1, metavar="H",
                   help="every unit is held by at least H workers (default 1)")
    p.add_argument("--max-groups", type=int, default=None, metavar="K",
                   help="spread/random: at most K distinct holder sets (process groups, each "
                        "an NCCL communicator): units tiled into K holder patterns "
                        "(docs/plans.md; default: no bound)")


def strategy_label(text: str) -> str:
    """A ``--strategy`` label (``fsdp+ac``, ``b-sdp+fsdp``), checked."""
    return _label(text)[0]


def strategy_list(text: str) -> list[str]:
    """A comma-separated ``--strategies`` value, each entry checked like ``--strategy``."""
    return [strategy_label(s.strip()) for s in text.split(",") if s.strip()]


def searched_strategy_list(text: str) -> list[tuple[str, str | None]]:
    """``plan --memory-gb --strategies``: each entry checked like ``--strategy``, with the
    name of its strategy when that is an SDP one (the command refuses composed SDP labels)."""
    return [_label(s.strip()) for s in text.split(",") if s.strip()]


def _label(text: str) -> tuple[str, str | None]:
    """``text`` checked, and the name of its strategy when that is an SDP one."""
    try:
        strategy = parse_label(text)[0]
    except ValueError as e:  # argparse shows an ArgumentTypeError's message as is
        raise argparse.ArgumentTypeError(str(e)) from None
    return text, strategy.name if strategy.is_sdp else None
