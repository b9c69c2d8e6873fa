"""What each unit costs, measured from the model on the meta device (nothing is allocated).

One forward and one backward of the full model at a given batch (and sequence) run on meta
tensors under ``FlopCounterMode`` (FLOPs per module, forward and backward apart) and
saved-tensor hooks (the bytes autograd keeps for backward, attributed to the unit whose forward
is running; parameters excluded, tensors sharing a base counted once). Everything outside the
units is the shared part. The balanced scheme (``plan/balance.py``) reads plain numbers from
here: ``ModelCosts.weights(objective)``, one column per resource of the objective
(``plan.objectives``).

Step time (``time``, ``cpu-time``) is a roofline-style model, not a measurement: a unit costs
``flops / F + act_bytes / M + 2 * grad_bytes / B`` seconds: compute at F FLOP/s, its saved
activations (written in forward, read in backward: memory traffic) at M bytes/s, and the ring
all-reduce of its gradient (each rank sends and receives about twice the gradient) at B bytes/s
of bus bandwidth. ``RATES`` gives the figures: nominal ones for an accelerator (``time``) and
ones fitted on this project's CPU machine (``cpu-time``; ``benchmarks/balanced.py`` fits them
again from measured unit times and prints the fit), where small convolutions are bound by
memory traffic rather than FLOPs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from subnetdp.plan.objectives import RESOURCES, parse_balance
from subnetdp.subnet.adapter import UnitAdapter
from subnetdp.subnet.units import unit_modules

OBJECTIVES = RESOURCES
# cpu-time's compute rates, fitted (benchmarks/balanced.py, "CPU time model")
CPU_FLOPS = 4.3e10
CPU_MEMORY = 1.5e8


@dataclass(frozen=True)
class Rates:
    """The step-time model's rates (module docstring)."""

    flops: float  # FLOP/s sustained
    memory: float  # bytes/s of activation traffic
    network: float  # all-reduce bus bandwidth, bytes/s


RATES = {
    # nominal, one A100/H100-class GPU: ~100 TFLOP/s sustained, ~2 TB/s HBM, ~50 GB/s of
    # all-reduce bus bandwidth between nodes (400 Gb/s InfiniBand per GPU)
    "time": Rates(flops=100e12, memory=2e12, network=50e9),
    # fitted on one core of the project's CPU machine (forward + backward of every unit of
    # resnet18-fmnist width 8 and swin-t-fmnist embed_dim 24, batch 32); the network figure
    # is an assumed 1 GB/s for gloo over loopback, not measured
    "cpu-time": Rates(flops=CPU_FLOPS, memory=CPU_MEMORY, network=1e9),
}


@dataclass(frozen=True)
class UnitCost:
    name: str
    params: int  # elements
    fwd_flops: int
    bwd_flops: int
    act_bytes: int  # saved for backward by this unit's forward, at the measured batch

    @property
    def flops(self) -> int:
        return self.fwd_flops + self.bwd_flops

    def memory_bytes(self, *, param_bytes: int = 4, optimizer_states: int = 2) -> int:
        """Parameters, gradients and optimizer state (fp32 AdamW: 16 B per element, SGD with
        momentum 12 B) plus the activations it keeps: what holding the unit adds to a rank's
        peak, roughly."""
        return self.params * param_bytes * (2 + optimizer_states) + self.act_bytes

    def seconds(self, rates: Rates, *, param_bytes: int = 4) -> float:
        """The step-time model (module docstring)."""
        return (self.flops / rates.flops + self.act_bytes / rates.memory
                + 2 * param_bytes * self.params / rates.network)


@dataclass(frozen=True)
class ModelCosts:
    units: tuple[UnitCost, ...]
    shared: UnitCost
    batch: int
    seq: int | None
    optimizer_states: int = 2  # the recipe's optimizer (Recipe.optimizer_states)

    def cost(self, unit: UnitCost, resource: str) -> float:
        """``unit``'s cost in one resource (``plan.objectives.RESOURCES``)."""
        if resource == "params":
            return float(unit.params)
        if resource == "flops":
            return float(unit.flops)
        if resource == "memory":
            return float(unit.memory_bytes(optimizer_states=self.optimizer_states))
        if resource in RATES:
            return unit.seconds(RATES[resource])
        raise ValueError(f"unknown resource {resource!r}; use one of {', '.join(RESOURCES)}")

    def weights(self, objective: str) -> list[list[float]]:
        """Per unit, its cost in every resource of ``objective`` (e.g. ``params+time``)."""
        names = parse_balance(objective)
        return [[self.cost(u, r) for r in names] for u in self.units]

    def to_dict(self) -> dict[str, Any]:
        return {"batch": self.batch, "seq": self.seq, "optimizer_states": self.optimizer_states,
                "shared": asdict(self.shared), "units": [asdict(u) for u in self.units]}


def example_input(task: str, defaults: dict[str, Any], batch: int,
                  seq: int | None) -> torch.Tensor:
    """A meta batch of a recipe's input: tokens ``[batch, seq]`` or images ``[batch, C, H, W]``."""
    if task == "lm":
        if seq is None:
            raise ValueError("a language model's costs need a sequence length")
        return torch.zeros(batch, seq, dtype=torch.long, device="meta")
    side = int(defaults["image_size"])
    return torch.zeros(batch, int(defaults["in_channels"]), side, side, device="meta")


def measure_costs(model: nn.Module, adapter: UnitAdapter, inputs: torch.Tensor,
                  *, seq: int | None = None) -> ModelCosts:
    """Per-unit and shared costs of one training step of ``model`` (meta) on ``inputs``."""
    units = unit_modules(model, adapter)
    names = [n for n, _ in units]
    acts = [0] * (len(units) + 1)  # the last slot: shared
    current = [len(units)]
    params = {id(p) for p in model.parameters()}
    seen: set[int] = set()

    def pack(t: torch.Tensor) -> torch.Tensor:
        base = t._base if t._base is not None else t
        if id(base) not in params and id(base) not in seen and id(t) not in params:
            seen.add(id(base))
            keep.append(base)  # hold it so ids are not reused during this step
            acts[current[0]] += t.numel() * t.element_size()
        return t

    keep: list[torch.Tensor] = []
    handles = []
    for i, (_, mod) in enumerate(units):
        handles.append(mod.register_forward_pre_hook(lambda *_, i=i: current.__setitem__(0, i)))
        handles.append(mod.register_forward_hook(
            lambda *_: current.__setitem__(0, len(units))))
    # Two passes: forward alone, then forward + backward in one counter (backward FLOPs are
    # attributed to modules only when their forward ran under the same counter).
    fwd, both = FlopCounterMode(display=False), FlopCounterMode(display=False)
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), fwd:
            model(inputs)
    finally:
        for h in handles:
            h.remove()
    keep.clear()
    with both:
        model(inputs).float().sum().backward()
    model.zero_grad(set_to_none=True)
    fwd_by = _by_module(fwd, names)
    bwd_by = [b - f for b, f in zip(_by_module(both, names), fwd_by, strict=True)]
    total_f, total_b = _total(fwd), _total(both) - _total(fwd)
    out_units = tuple(
        UnitCost(name, sum(p.numel() for p in mod.parameters()), fwd_by[i], bwd_by[i], acts[i])
        for i, (name, mod) in enumerate(units))
    n_params = sum(p.numel() for p in model.parameters())
    shared = UnitCost("shared", n_params - sum(u.params for u in out_units),
                      total_f - sum(fwd_by), total_b - sum(bwd_by), acts[-1])
    return ModelCosts(out_units, shared, int(inputs.shape[0]), seq)


def _total(mode: FlopCounterMode) -> int:
    return int(sum(mode.get_flop_counts().get("Global", {}).values()))


def _by_module(mode: FlopCounterMode, names: list[str]) -> list[int]:
    """FLOPs per unit: the counter keys modules as ``ClassName.qualified.name``."""
    counts = mode.get_flop_counts()
    out = []
    for name in names:
        key = next((k for k in counts if k.partition(".")[2] == name), None)
        out.append(int(sum(counts[key].values())) if key is not None else 0)
    return out


def recipe_costs(recipe: Any, *, batch: int | None = None, seq: int | None = None,
                 model_args: dict[str, Any] | None = None) -> ModelCosts:
    """``measure_costs`` of a recipe's model on the meta device at ``batch`` (default: the
    recipe's) and ``seq`` (language models; default: the recipe's)."""
    with torch.device("meta"):
        model = recipe.build_model(**(model_args or {}))
    d = recipe.defaults
    batch = batch or int(d.get("batch_size", 1))
    seq = (seq or int(d.get("seq_len", 128))) if recipe.task == "lm" else None
    costs = measure_costs(model, recipe.adapter, example_input(recipe.task, d, batch, seq),
                          seq=seq)
    return dataclasses.replace(costs, optimizer_states=recipe.optimizer_states)
