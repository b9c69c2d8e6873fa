"""The two DDP baselines SDP's constructions come from: stochastic depth and neuron dropout.

b-sdp removes whole residual blocks from a worker's model for the whole run; *stochastic depth*
(Huang et al. 2016) removes each block at random, independently at every training step. n-sdp
removes groups of neurons (FFN hidden units, heads, channels); *neuron dropout* drops the same
slots at random at every step. Both are applied here to the full model of a torch-DDP run,
generically over any ``UnitAdapter``, so the quality study can ask whether SDP's static,
per-worker masks do better or worse than the random masks they descend from at the same drop
rate (1 - C).

Decisions (see docs/results/quality.md):

- Stochastic depth does **not** rescale the kept branches, because b-sdp does not either: the
  two then differ only in *how* blocks are dropped (static per worker vs random per step), not
  in the scale of what is kept. A skipped block behaves exactly like b-sdp's removed block
  (``subnet/removed.py``): the identity on the residual stream (``passthrough``) or a branch
  that contributes ``0`` to its shortcut (``zero``), and its compute is really skipped.
- Each rank draws its own masks (a generator seeded by seed and rank), the closest analogue of
  SDP where every worker trains a different subnetwork. A block skipped on one rank then gets
  no gradient there, so torch DDP must be built with ``find_unused_parameters=True``; DDP still
  divides by the world size (a skipped rank contributes zero), unlike holder averaging, which
  divides by the number of holders. The masks live on a private generator, so they do not
  perturb the global RNG; a resumed run therefore redraws them (resume is exact for the SDP
  strategies, not for these baselines).
- Neuron dropout is inverted dropout (1/(1 - p) on kept slots, as torch's ``nn.Dropout``) on the
  *input* of each pair's ``down`` module, whole slots at a time: one FFN hidden unit, one K/V
  head with all its query heads' columns, one intermediate channel. Linear inputs ``[..., F]``
  get a mask per position (per token); convolution inputs ``[B, C, ...]`` a mask per sample and
  channel (like ``nn.Dropout2d``). n-sdp's default output scaling is the same 1/keep-rate.
- Both act in training mode only; ``model.eval()`` runs the full, unscaled model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from subnetdp.subnet.adapter import UnitAdapter
from subnetdp.subnet.removed import removed_module


def check_drop_rate(p: float, what: str) -> None:
    if not 0.0 <= p < 1.0:
        raise ValueError(f"{what} must be in [0, 1), got {p}")


def rank_generator(seed: int, rank: int) -> torch.Generator:
    """A private CPU generator, different on every rank and reproducible from (seed, rank)."""
    g = torch.Generator()
    g.manual_seed(1_000_003 * (seed + 1) + 7919 * rank)
    return g


class _SkippableForward:
    """Replaces one unit's ``forward`` (an instance attribute, so the module, its parameters
    and its state-dict keys stay exactly as they were): in training mode, with probability
    ``p`` it calls the unit's removed stand-in instead of the unit."""

    def __init__(self, module: nn.Module, stand_in: nn.Module, p: float,
                 generator: torch.Generator) -> None:
        self.module, self.stand_in, self.p, self.generator = module, stand_in, p, generator
        self.forward = type(module).forward.__get__(module)
        self.skipped = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        drawn = self.module.training and self.p > 0
        if drawn and torch.rand((), generator=self.generator).item() < self.p:
            self.skipped += 1
            return self.stand_in(*args, **kwargs)
        return self.forward(*args, **kwargs)


@dataclass
class StochasticDepth:
    """Handle on the units made skippable by ``apply_stochastic_depth``."""

    units: dict[str, _SkippableForward] = field(default_factory=dict)

    @property
    def skipped(self) -> int:
        """Block skips drawn so far on this rank (all units)."""
        return sum(u.skipped for u in self.units.values())

    def remove(self) -> None:
        for f in self.units.values():
            del f.module.forward  # back to the class's forward
        self.units.clear()


def apply_stochastic_depth(
    model: nn.Module, adapter: UnitAdapter, p: float, generator: torch.Generator
) -> StochasticDepth:
    """Make every unit of ``adapter`` skip itself with probability ``p`` per training forward.

    A skipped unit is replaced, for that call only, by what b-sdp would put in its place
    (``adapter.removed``); kept units are not rescaled (see the module docstring)."""
    check_drop_rate(p, "stochastic depth")
    handle = StochasticDepth()
    for path in adapter.unit_paths(model):
        module = model.get_submodule(path)
        f = _SkippableForward(module, removed_module(adapter.removed, path, like=module), p,
                              generator)
        module.forward = f  # type: ignore[method-assign]
        handle.units[path] = f
    return handle


def _slot_dim(module: nn.Module) -> int:
    """The dimension of ``module``'s input that carries the pair's hidden units."""
    if isinstance(module, nn.Linear):
        return -1
    if isinstance(module, nn.Conv1d | nn.Conv2d | nn.Conv3d):
        return 1
    raise ValueError(
        f"neuron dropout does not know which input dimension of a {type(module).__name__} "
        f"holds the hidden units; it supports nn.Linear and nn.ConvNd 'down' modules"
    )


def _slot_dropout_hook(
    slots: int, dim: int, p: float, generator: torch.Generator
) -> Callable[[nn.Module, tuple[Any, ...]], tuple[Any, ...] | None]:
    def hook(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        if not module.training or p == 0:
            return None
        x = args[0]
        d = dim % x.ndim
        size = x.shape[d]
        if size % slots:
            raise ValueError(f"input width {size} is not a multiple of {slots} slots")
        # [..., slots, per_slot, ...]: one Bernoulli draw per slot, per position before the
        # slot dim (tokens, or samples), broadcast over the slot's entries and what follows.
        mask_shape = (*x.shape[:d], slots, 1, *([1] * (x.ndim - d - 1)))
        keep = torch.rand(mask_shape, generator=generator) >= p
        mask = keep.to(device=x.device, dtype=x.dtype) / (1.0 - p)
        grouped = x.reshape(*x.shape[:d], slots, size // slots, *x.shape[d + 1:])
        return ((grouped * mask).reshape(x.shape), *args[1:])

    return hook


@dataclass
class NeuronDropout:
    """Handle on the hooks installed by ``apply_neuron_dropout``."""

    handles: list[RemovableHandle] = field(default_factory=list)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()


def apply_neuron_dropout(
    model: nn.Module, adapter: UnitAdapter, p: float, generator: torch.Generator,
    *, kinds: set[str] | None = None,
) -> NeuronDropout:
    """Drop whole slots of every neuron pair's hidden activation with probability ``p`` (inverted
    scaling), in training mode, through a forward pre-hook on the pair's ``down`` module."""
    check_drop_rate(p, "neuron dropout")
    if adapter.neuron_pairs is None:
        raise ValueError("this model's adapter declares no neuron pairs; neuron dropout needs "
                         "them (see subnetdp.subnet.adapter.NeuronPair)")
    handle = NeuronDropout()
    for pair in adapter.neuron_pairs(model):
        if kinds is not None and pair.kind not in kinds:
            continue
        down = model.get_submodule(pair.down)
        hook = _slot_dropout_hook(pair.slots, _slot_dim(down), p, generator)
        handle.handles.append(down.register_forward_pre_hook(hook))
    return handle
