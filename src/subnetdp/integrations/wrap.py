"""What both integrations do the same way: the strategy and plan options decoded once, the
model's block list found, one rank's ``SubnetDataParallel`` built over the process group the
framework made.

Options are the CLI's, typed: ``strategy`` is a ``RankSpec`` or a strategy name (``b-sdp``,
``n-sdp``, ...) with an optional ``Composition``; ``plan`` a ``PlanSpec`` (coverage, scheme,
plan file, ...; default: the CLI's coverage 0.5) or a ready ``Plan``. The blocks are found by
``auto_adapter`` (the longest ``ModuleList``, or the path ``blocks`` names) unless an
``adapter`` is given (n-sdp needs one that declares neuron pairs).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from subnetdp.plan import Plan
from subnetdp.runtime.wrapper import SubnetDataParallel
from subnetdp.strategy import Composition, PlanSpec, RankSpec, Strategy
from subnetdp.subnet.adapter import UnitAdapter
from subnetdp.subnet.auto import auto_adapter
from subnetdp.subnet.planning import build_plan

DEFAULT_PLAN = PlanSpec(coverage=0.5)  # the CLI's default coverage


@dataclass(frozen=True)
class SDPOptions:
    """An integration's SDP options, checked at construction (before any worker trains)."""

    spec: RankSpec
    plan: PlanSpec | Plan = DEFAULT_PLAN
    blocks: str | tuple[str, ...] | None = None
    adapter: UnitAdapter | None = None
    seed: int = 0

    @classmethod
    def of(cls, strategy: RankSpec | Strategy | str = "b-sdp", *,
           comp: Composition | None = None, plan: PlanSpec | Plan | None = None,
           blocks: str | list[str] | tuple[str, ...] | None = None,
           adapter: UnitAdapter | None = None, seed: int = 0,
           framework: str) -> SDPOptions:
        spec = strategy if isinstance(strategy, RankSpec) else RankSpec.of(strategy, comp)
        if not spec.strategy.is_sdp:
            raise ValueError(f"{spec.label()} is not an SDP strategy; use {framework}'s own "
                             "DDP or FSDP for a baseline")
        if spec.comp.fsdp or spec.comp.zero:
            raise ValueError(f"SDP under {framework} supports the holder reducer only: drop "
                             "fsdp/zero from the composition (subnetdp train has them)")
        if spec.comp.dtype != "fp32":
            raise ValueError(f"set the precision through {framework} (its mixed-precision "
                             f"option), not Composition(dtype={spec.comp.dtype!r})")
        if blocks is not None and adapter is not None:
            raise ValueError("give blocks= (auto_adapter's block list) or adapter=, not both")
        return cls(spec, DEFAULT_PLAN if plan is None else plan,
                   tuple(blocks) if isinstance(blocks, list) else blocks, adapter, seed)

    def wrap(self, module: nn.Module, device: torch.device) -> SubnetDataParallel:
        """This rank's ``SubnetDataParallel`` over ``module`` (modified in place: the blocks
        this rank does not hold are dropped). Collective: every rank calls it."""
        adapter = self.adapter or auto_adapter(
            module, list(self.blocks) if isinstance(self.blocks, tuple) else self.blocks)
        world = dist.get_world_size()
        if isinstance(self.plan, Plan):
            plan = self.plan
            plan.validate(world)
        else:
            plan = build_plan(module, adapter, self.spec.strategy, self.plan, world=world)
        return SubnetDataParallel(module, plan=plan, adapter=adapter, spec=self.spec,
                                  device=device, init_seed=self.seed)
