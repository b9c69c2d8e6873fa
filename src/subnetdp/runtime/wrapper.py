"""``SubnetDataParallel``: a drop-in for ``DistributedDataParallel`` that trains subnetworks."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from subnetdp.plan import Plan, PlanError, Unit
from subnetdp.runtime.assemble import gather_full_state_dict, sync_buffers
from subnetdp.runtime.groups import HolderGroups
from subnetdp.runtime.reducer import CommStats, HolderReducer
from subnetdp.subnet.adapter import UnitAdapter
from subnetdp.subnet.build import drop_units, is_on_meta, materialize, param_layout
from subnetdp.subnet.units import describe_units, unit_index

STRATEGIES = ("b-sdp",)


class SubnetDataParallel(nn.Module):
    """Wrap a model so this rank trains only the units the plan gives it.

    Usage mirrors DDP::

        with torch.device("meta"):
            model = Llama(cfg)                      # nothing allocated yet
        model = SubnetDataParallel(model, plan=plan, adapter=LLAMA_ADAPTER)
        opt = torch.optim.AdamW(model.parameters())  # only held + shared parameters
        loss = loss_fn(model(x), y); loss.backward()  # grads come back holder-averaged
        opt.step()

    A meta-device model is materialised with only the held units, each initialised from a seed
    derived from its name so that all holders agree (and the full model equals the union of
    the pieces). A model that is already materialised has its non-held units dropped, and its
    remaining values are broadcast from their owners so that holders start identical.
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        plan: Plan,
        adapter: UnitAdapter,
        strategy: str = "b-sdp",
        device: torch.device | str | None = None,
        init_seed: int = 0,
        bucket_cap_mb: float = 25.0,
    ) -> None:
        super().__init__()
        if strategy not in STRATEGIES:
            raise ValueError(
                f"strategy {strategy!r} is not available in SubnetDataParallel; "
                f"choose one of {STRATEGIES} (use torch DDP for 'ddp')"
            )
        if not dist.is_initialized():
            raise RuntimeError("call torch.distributed.init_process_group before wrapping")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        plan.validate(self.world)
        units, _ = describe_units(module, adapter)
        _check_plan_matches(plan, units, type(module).__name__)
        self.plan, self.adapter, self.strategy = plan, adapter, strategy
        self.layout = param_layout(module, adapter)
        self.unit_names = [u.name for u in units]
        self.full_state_keys = list(module.state_dict().keys())
        self.held_units = plan.held_units(self.rank)

        drop_units(module, adapter, self.held_units)
        if device is None:
            device = _default_device()
        if is_on_meta(module):
            materialize(module, adapter, device=device, seed=init_seed)
            needs_broadcast = False
        else:
            module.to(device)
            needs_broadcast = True
        self.module = module

        everyone = tuple(range(self.world))
        self.groups = HolderGroups([*plan.holder_sets(), everyone], world=self.world)
        if needs_broadcast:
            self._broadcast_from_owners()
        # Each parameter's owner: lowest-ranked holder of its unit, rank 0 for shared ones.
        owner = {i.name: 0 if i.unit is None else plan.owner(i.unit) for i in self.layout}
        self._owned_params = [p for n, p in module.named_parameters() if owner[n] == self.rank]
        self.reducer = HolderReducer(
            dict(module.named_parameters()),
            self.layout,
            plan,
            rank=self.rank,
            groups=self.groups,
            bucket_cap_bytes=int(bucket_cap_mb * 2**20),
        )

    # -- the DDP surface ------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if torch.is_grad_enabled() and self.reducer.enabled:
            self.reducer.attach_grad_views()
        return self.module(*args, **kwargs)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally (gradient accumulation); the next backward outside
        this context reduces the accumulated sum."""
        prev, self.reducer.enabled = self.reducer.enabled, False
        try:
            yield
        finally:
            self.reducer.enabled = prev

    # -- what subnetdp adds ---------------------------------------------------------------
    @property
    def comm_stats(self) -> CommStats:
        return self.reducer.stats

    @property
    def params_held(self) -> int:
        return sum(p.numel() for p in self.module.parameters())

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip gradients by the *full model's* norm and return that norm.

        A per-rank norm would differ between holders of the same unit, so they would scale the
        same averaged gradient differently and their copies would drift apart. Each parameter is
        counted once, by its owner (rank 0 for shared ones), and one scalar all-reduce over the
        world gives every rank the same norm and the same clip factor.
        """
        grads = [p.grad for p in self._owned_params if p.grad is not None]
        device = next(self.module.parameters()).device
        sq = torch.zeros((), dtype=torch.float32, device=device)
        if grads:
            norms = torch._foreach_norm(grads)
            sq = torch.stack([n.float() for n in norms]).square().sum()
        dist.all_reduce(sq)
        total = sq.sqrt()
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        all_grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        if all_grads:
            torch._foreach_mul_(all_grads, coef.to(all_grads[0].dtype))
        return total

    def sync_buffers(self) -> None:
        """Average BatchNorm-style running statistics over holders (before eval/checkpoint)."""
        sync_buffers(self.module, self.plan, self.unit_names, self.groups, rank=self.rank)

    def full_state_dict(self, dst: int = 0) -> dict[str, torch.Tensor] | None:
        """The full model's state dict on rank ``dst``, each unit from its owner. Collective."""
        self.sync_buffers()
        return gather_full_state_dict(
            self.module, self.plan, self.unit_names, self.full_state_keys, rank=self.rank, dst=dst
        )

    # -- shards (checkpoints) --------------------------------------------------------------
    def shard_state(
        self, tensors: Mapping[str, torch.Tensor] | None = None, *, owned_only: bool = True
    ) -> dict[str, torch.Tensor]:
        """This rank's pieces of the full model, keyed in *full-model* coordinates.

        ``tensors`` maps local state keys (``self.module.state_dict()`` keys) to tensors of the
        same local shape (default: the module's own state; pass e.g. ``{name: exp_avg}`` to
        shard optimizer state the same way). A piece key is the state key for a whole entry,
        or ``f"{key}@{dim}:{start}:{stop}"`` for a slice of the full entry along ``dim`` (n-sdp).
        With ``owned_only`` only pieces this rank owns are returned (units whose lowest-ranked
        holder it is; shared entries on rank 0), so the ranks' shards cover the full model
        exactly once. Values are contiguous CPU copies.
        """
        src = dict(self.module.state_dict()) if tensors is None else dict(tensors)
        out = {}
        for key, value in src.items():
            u = unit_index(key, self.unit_names)
            if owned_only and (self.rank != 0 if u is None else self.plan.owner(u) != self.rank):
                continue
            out[key] = value.detach().to("cpu", copy=True).contiguous()
        return out

    @torch.no_grad()
    def load_shard_state(
        self,
        entries: Mapping[str, torch.Tensor],
        into: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        """Fill this rank's local tensors from full-coordinate pieces (the union of shards
        written by ``shard_state``). ``into`` maps local state keys to the tensors to fill
        (default: the module's own state). Raises ``KeyError`` naming the missing pieces."""
        dst = dict(self.module.state_dict()) if into is None else dict(into)
        missing = [k for k in dst if k not in entries]
        if missing:
            raise KeyError(f"the shards lack {len(missing)} pieces this rank holds, e.g. "
                           f"{missing[:3]}; the checkpoint is incomplete or from another plan")
        for key, t in dst.items():
            t.copy_(entries[key])

    # -- internals ------------------------------------------------------------------------
    def _broadcast_from_owners(self) -> None:
        """Make holder copies identical for a model materialised independently per rank."""
        per_unit: dict[int | None, list[torch.Tensor]] = {}
        for name, t in [*self.module.named_parameters(), *self.module.named_buffers()]:
            per_unit.setdefault(unit_index(name, self.unit_names), []).append(t)
        with torch.no_grad():
            for u in [None, *range(self.plan.num_units)]:
                holders = tuple(range(self.world)) if u is None else self.plan.holders(u)
                if self.rank not in holders or len(holders) < 2:
                    continue
                src = 0 if u is None else self.plan.owner(u)
                for t in per_unit.get(u, []):
                    dist.broadcast(t, src=src, group=self.groups.group(tuple(holders)))


def _default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _check_plan_matches(plan: Plan, units: list[Unit], model_name: str) -> None:
    if len(units) != plan.num_units:
        raise PlanError(
            f"the plan has {plan.num_units} units but {model_name} declares "
            f"{len(units)}; build the plan from this model (make_plan(units=describe_units(...)))"
        )
    sizes = [u.size for u in units]
    plan_sizes = [u.size for u in plan.units]
    if plan_sizes != sizes and any(s != 1 for s in plan_sizes):
        raise PlanError(
            "the plan's unit sizes do not match the model's parameter counts; "
            "rebuild the plan from this model"
        )
