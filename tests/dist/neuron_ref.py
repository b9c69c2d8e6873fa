"""Shared pieces of the neuron-level oracles: a small LLaMA, its plans and batches, and the
independent masking reference (which hidden entries and parameter elements a worker holds,
computed by hand from the plan's unit names, not through subnetdp's index maps)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from subnetdp.models import get_recipe
from subnetdp.plan import make_layered_plan
from subnetdp.subnet.neurons import describe_neuron_units

SMALL = {"dim": 32, "n_layers": 2, "n_heads": 4, "vocab_size": 64, "ffn_hidden": 48,
         "max_seq_len": 16}


def small_llama(**cfg):
    with torch.device("meta"):
        return get_recipe("llama-tiny").build_model(**(SMALL | cfg))


def small_plan(world: int, coverage: float, *, groups: int, kinds=None, rotate=False, **cfg):
    units, shared, layers = describe_neuron_units(
        small_llama(**cfg), get_recipe("llama-tiny").adapter, groups=groups, kinds=kinds
    )
    return make_layered_plan(world=world, units=units, layers=layers, coverage=coverage,
                             shared_size=shared, rotate=rotate)


def small_batch(rank: int, step: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randint(0, SMALL["vocab_size"], (3, 9), generator=g)
    return x[:, :-1], x[:, 1:]


def lm_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))


def hidden_masks(plan, model: nn.Module, worker: int, scaling: str) -> dict[str, torch.Tensor]:
    """Per pair's ``down`` module: a 0/1 (or 0/scale) mask over its input features."""
    pairs = {p.name: p for p in get_recipe("llama-tiny").adapter.neuron_pairs(model)}
    groups: dict[str, list[int]] = {}
    for u, unit in enumerate(plan.units):
        name, g = unit.name[:-1].split("[")
        groups.setdefault(name, []).append(u)
    masks = {}
    for name, units in groups.items():
        pair = pairs[name]
        down = model.get_submodule(pair.down)
        width = down.weight.shape[1]
        per_slot = width // pair.slots
        m = torch.zeros(width)
        n = len(units)
        for g, u in enumerate(units):
            if plan.holds(worker, u):
                a, b = g * pair.slots // n * per_slot, (g + 1) * pair.slots // n * per_slot
                m[a:b] = 1.0
        if scaling == "keep":
            m *= width / m.sum()
        masks[pair.down] = m
    return masks


def element_holders(plan, model: nn.Module, worker: int) -> dict[str, torch.Tensor]:
    """1 where ``worker`` holds a parameter element (shared ones: everywhere)."""
    held = {n: torch.ones_like(p) for n, p in model.named_parameters()}
    ones = hidden_masks(plan, model, worker, "none")
    pairs = get_recipe("llama-tiny").adapter.neuron_pairs(model)
    for pair in pairs:
        if pair.down not in ones:
            continue
        m = ones[pair.down]
        for key, dim in pair.tensors:
            size = held[key].shape[dim]
            per = size // pair.slots
            slot_mask = m.view(pair.slots, -1)[:, 0]  # 1 per held slot
            entries = slot_mask.repeat_interleave(per)
            shape = [1] * held[key].ndim
            shape[dim] = size
            held[key] = held[key] * entries.view(shape)
    return held


def piece_of(full: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    key, _, cut = name.partition("@")
    if not cut:
        return full[key]
    dim, span = cut.split(":", 1)
    a, b = (int(v) for v in span.split(":"))
    return full[key].narrow(int(dim), a, b - a)
