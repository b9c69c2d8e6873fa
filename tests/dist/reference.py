"""A single-process reference for any model under ddp, b-sdp or n-sdp.

One process plays the plan's N workers in turn on the *full* model: worker w's subnetwork is
made with hooks (a non-held block's output is replaced by its input, or by zeros for a
residual branch; a non-held neuron group's activations are zeroed on their way into the pair's
``down`` module), it runs forward/backward on w's batch, and its gradients are kept only where
w holds the parameter. Every gradient element is then averaged by hand over the workers that
hold it, and one optimizer step is taken. Nothing of subnetdp's runtime (dropping, narrowing,
reducer) is used, so the multi-process runs are checked against an independent computation.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from subnetdp.plan import Plan
from subnetdp.subnet.adapter import NeuronPair, UnitAdapter
from subnetdp.subnet.units import unit_index

Batch = tuple[Any, torch.Tensor]


def _first_input(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    if args:
        return args[0]
    first = next(iter(inspect.signature(module.forward).parameters))
    return kwargs[first]


def _removed_hook(kind: str) -> Callable[..., Any]:
    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> Any:
        if kind == "zero":  # a residual branch: contributes nothing
            return torch.zeros_like(out)
        x = _first_input(module, args, kwargs)  # a whole block: the identity on the stream
        return (x, *out[1:]) if isinstance(out, tuple) else x

    return hook


def _mask_hook(mask: torch.Tensor) -> Callable[..., Any]:
    def pre_hook(module: nn.Module, args: tuple[Any, ...]) -> Any:
        x = args[0]
        # The hidden dimension: channels (dim 1) for a conv, features (last) for a Linear.
        shape = [1] * x.ndim
        shape[1 if isinstance(module, nn.Conv2d) else -1] = mask.numel()
        return (x * mask.view(shape).to(x.dtype), *args[1:])

    return pre_hook


class _Group:
    """Neuron group ``pair[g]`` of a plan: slots ``[slot_start, slot_stop)`` of ``pair``."""

    def __init__(self, pair: NeuronPair, g: int, n: int) -> None:
        # By hand, not through subnetdp.subnet.neurons: n contiguous near-equal slot ranges.
        self.pair = pair
        self.slot_start = g * pair.slots // n
        self.slot_stop = (g + 1) * pair.slots // n

    def span(self, size: int) -> tuple[int, int]:
        per = size // self.pair.slots
        return self.slot_start * per, self.slot_stop * per


def _groups(model: nn.Module, adapter: UnitAdapter, names: list[str]) -> list[_Group]:
    assert adapter.neuron_pairs is not None
    pairs = {p.name: p for p in adapter.neuron_pairs(model)}
    parsed = [(n[: n.rindex("[")], int(n[n.rindex("[") + 1 : -1])) for n in names]
    count: dict[str, int] = {}
    for pair, _ in parsed:
        count[pair] = count.get(pair, 0) + 1
    return [_Group(pairs[pair], g, count[pair]) for pair, g in parsed]


class VirtualWorkers:
    """The plan's workers, played one at a time on one full model."""

    def __init__(self, model: nn.Module, adapter: UnitAdapter, plan: Plan, strategy: str):
        self.model, self.adapter, self.plan, self.strategy = model, adapter, plan, strategy
        self.names = [u.name for u in plan.units]
        self.groups = _groups(model, adapter, self.names) if strategy == "n-sdp" else None

    def param_mask(self, w: int, name: str, p: torch.Tensor) -> torch.Tensor:
        """1 where worker w holds the parameter's elements, 0 elsewhere."""
        held = set(self.plan.held_units(w))
        if self.strategy == "ddp":
            return torch.ones_like(p)
        if self.groups is None:  # block level: whole tensors
            u = unit_index(name, self.names)
            return torch.full_like(p, float(u is None or u in held))
        mask = torch.ones_like(p)
        for u, g in enumerate(self.groups):
            for key, dim in g.pair.tensors:
                if key == name and u not in held:
                    a, b = g.span(p.shape[dim])
                    mask.narrow(dim, a, b - a).zero_()
        return mask

    @contextmanager
    def as_worker(self, w: int) -> Iterator[None]:
        held = set(self.plan.held_units(w))
        handles = []
        if self.strategy == "b-sdp":
            for u, name in enumerate(self.names):
                if u not in held:
                    mod = self.model.get_submodule(name)
                    handles.append(mod.register_forward_hook(
                        _removed_hook(self.adapter.removed), with_kwargs=True))
        elif self.groups is not None:
            masks: dict[str, torch.Tensor] = {}
            for u, g in enumerate(self.groups):
                m = masks.setdefault(g.pair.down, torch.ones(g.pair.slots))
                if u not in held:
                    m[g.slot_start:g.slot_stop] = 0
            for down, m in masks.items():
                # n-sdp's default output scaling: kept units count 1/keep-rate in training
                m *= m.numel() / m.sum()
                mod = self.model.get_submodule(down)
                width = mod.weight.shape[1]  # the hidden size the down module consumes
                slot_mask = m.repeat_interleave(width // m.numel())
                handles.append(mod.register_forward_pre_hook(_mask_hook(slot_mask)))
        try:
            yield
        finally:
            for h in handles:
                h.remove()


def reference_history(
    model: nn.Module,
    adapter: UnitAdapter,
    plan: Plan,
    strategy: str,
    *,
    batch: Callable[[int, int], Batch],
    loss: Callable[[Any, torch.Tensor], torch.Tensor],
    optimizer: Callable[[Any], torch.optim.Optimizer],
    steps: int,
) -> list[dict[str, torch.Tensor]]:
    """Full-model parameters after each step. ``model`` must hold the workers' initial values
    (e.g. ``build_full_model`` with their ``init_seed``); ``batch(w, step)`` is worker w's."""
    workers = VirtualWorkers(model, adapter, plan, strategy)
    params = dict(model.named_parameters())
    masks = [{n: workers.param_mask(w, n, p) for n, p in params.items()}
             for w in range(plan.world)]
    opt = optimizer(model.parameters())
    history = []
    for step in range(steps):
        sums = {n: torch.zeros_like(p) for n, p in params.items()}
        counts = {n: torch.zeros_like(p) for n, p in params.items()}
        for w in range(plan.world):
            model.zero_grad(set_to_none=True)
            with workers.as_worker(w):
                x, y = batch(w, step)
                loss(model(x), y).backward()
            for n, p in params.items():
                if p.grad is not None:
                    sums[n] += p.grad * masks[w][n]
                counts[n] += masks[w][n]
        for n, p in params.items():
            assert bool((counts[n] > 0).all()), f"{n} has elements no worker holds"
            p.grad = sums[n] / counts[n]
        opt.step()
        history.append({n: p.detach().clone() for n, p in params.items()})
    return history


def assert_pieces_match(
    pieces: dict[str, torch.Tensor], full: dict[str, torch.Tensor], *, atol: float, rtol: float
) -> int:
    """Compare a rank's ``shard_state(owned_only=False)`` (full-coordinate pieces: ``key`` or
    ``key@dim:start:stop``) with full-model parameters; buffers are skipped. Returns how many
    pieces were compared."""
    compared = 0
    for name, value in pieces.items():
        key, _, cut = name.partition("@")
        if key not in full:
            continue  # a buffer (e.g. BatchNorm statistics: each rank keeps its own)
        ref = full[key]
        if cut:
            dim, span = cut.split(":", 1)
            a, b = (int(v) for v in span.split(":"))
            ref = ref.narrow(int(dim), a, b - a)
        torch.testing.assert_close(value, ref, atol=atol, rtol=rtol, msg=lambda m, n=name:
                                   f"{n}: {m}")
        compared += 1
    return compared
