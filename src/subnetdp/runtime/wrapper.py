"""``SubnetDataParallel``: a drop-in for ``DistributedDataParallel`` that trains subnetworks."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from subnetdp.plan import Plan
from subnetdp.runtime.assemble import (
    broadcast_from_owners,
    gather_full_state_dict,
    shard,
    sync_buffers,
)
from subnetdp.runtime.backends import Backend, FSDPBackend, ReducerBackend
from subnetdp.runtime.called_by_all import called_by_all
from subnetdp.runtime.checkpointing import checkpoint_blocks
from subnetdp.runtime.compile import compile_blocks
from subnetdp.runtime.fsdp import local_tensor, my_chunk
from subnetdp.runtime.grouped import group_layers
from subnetdp.runtime.groups import HolderGroups
from subnetdp.runtime.reducer import CommStats
from subnetdp.runtime.ring import GlooComms
from subnetdp.runtime.zero import ZeroOptimizer
from subnetdp.strategy import Composition, RankSpec, Strategy
from subnetdp.subnet.adapter import UnitAdapter
from subnetdp.subnet.build import drop_units, is_on_meta, materialize, narrow_tensors
from subnetdp.subnet.match import match_plan
from subnetdp.subnet.neurons import NeuronGroup
from subnetdp.subnet.pieces import full_pieces, local_pieces, local_slices
from subnetdp.subnet.scaling import scale_kept_outputs
from subnetdp.subnet.units import unit_modules


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
    remaining values are broadcast from their owners so that holders start identical (under
    backward masking the ranks that run a unit without holding it too). Either way the ranks
    need no common seed.

    Like DDP, every rank's gradient counts equally: a unit's gradient is the plain mean of its
    holders' gradients, each the mean over that rank's own batch, so ranks with unequal batch
    sizes are averaged per rank, not per sample.

    The wrapper builds the rank's subnetwork; averaging is one of two backends
    (``runtime.backends``): subnetdp's holder reducer, or FSDP2 per holder group (``fsdp``).
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        plan: Plan,
        adapter: UnitAdapter,
        strategy: str | Strategy = "b-sdp",
        device: torch.device | str | None = None,
        init_seed: int = 0,
        bucket_cap_mb: float = 25.0,
        output_scaling: str | None = None,
        refresh_every: int = 1,
        fsdp: bool = False,
        activation_checkpointing: bool = False,
        param_dtype: torch.dtype | None = None,
        reduce_dtype: torch.dtype | None = None,
        fsdp_prefetch: bool = True,
        zero: int = 0,
        spec: RankSpec | None = None,
    ) -> None:
        """``fsdp``: shard each held unit over its holders (FSDP2) and shared parameters over
        all workers (``runtime.fsdp``); ``activation_checkpointing``: recompute every block in
        backward (``runtime.checkpointing``); ``param_dtype``: compute dtype (e.g. bf16) while
        parameters, gradients and optimizer state keep the model's dtype (FSDP's
        mixed-precision policy under ``fsdp``, ``torch.autocast`` otherwise);
        ``reduce_dtype``: the dtype gradients are averaged in (FSDP only; default: fp32);
        ``fsdp_prefetch``: prefetch adjacent held blocks (FSDP only, [Note: one global order]
        in ``runtime.fsdp``); ``zero``: 1 shards optimizer state, 2 also the reduced gradients,
        over each bucket's holders ([Note: ZeRO in holder groups] in ``runtime.zero``; build
        the optimizer with ``self.optimizer``). Every rank checks that the collectives it and
        its peers will issue admit one global order (``plan.schedule``) and raises
        ``ScheduleError`` if not.

        ``spec``: the strategy and composition already checked (``parallelize``'s), in place
        of ``strategy`` and the composition keywords, with a plan already validated (every
        plan builder and reader validates): nothing is checked again."""
        super().__init__()
        checked = spec is not None
        if spec is None:  # the public keywords: decoded and checked here, once
            spec = RankSpec.of(strategy, Composition(
                fsdp=fsdp, ac=activation_checkpointing, output_scaling=output_scaling,
                refresh_every=refresh_every, bucket_cap_mb=bucket_cap_mb,
                fsdp_prefetch=fsdp_prefetch, zero=zero))
            if reduce_dtype is not None and not fsdp:
                raise ValueError("reduce_dtype needs fsdp=True (the plain reducer averages in "
                                 "the gradients' own dtype)")
        strat, comp = spec.strategy, spec.comp
        if not strat.is_sdp:
            raise ValueError("SubnetDataParallel trains subnetworks; for 'ddp' use "
                             "subnetdp.parallelize (torch DDP) or DistributedDataParallel")
        if not dist.is_initialized():
            raise RuntimeError("call torch.distributed.init_process_group before wrapping")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        if not checked or plan.world != self.world:
            plan.validate(self.world)  # a checked plan: only to say how to rebuild it
        fsdp, zero = comp.fsdp, comp.zero
        self.plan, self.adapter, self.strategy = plan, adapter, strat
        neuron_groups, local_units = self._cut_state(module, adapter)
        dev = torch.device(device) if device is not None else _default_device()
        materialised = not is_on_meta(module)
        # One process group per distinct holder set (FSDP also wants one-rank groups, so that
        # its mixed-precision policy applies to units held alone).
        self.groups = HolderGroups([*plan.holder_sets(), tuple(range(self.world))],
                                   world=self.world, singletons=fsdp)
        self.module = self._build_local(module, adapter, dev, init_seed,
                                        local_slices(self.pieces, local_units))
        self._wrap_layers(module, adapter, comp, neuron_groups)
        self.backend: Backend = self._make_backend(module, adapter, comp, param_dtype,
                                                   reduce_dtype, dev)
        self.zero = zero
        self._zero_opt: ZeroOptimizer | None = None  # the latest optimizer built under zero
        self.fsdp = fsdp
        self.refresh_every = comp.refresh_every
        self._refreshed_through = 0  # reductions already followed by a refresh
        if materialised:
            self._replace_own_init()

    def _replace_own_init(self) -> None:
        """Backward masking runs every unit; a non-holder's copy came from its own init (its
        own seed): the owners' values replace it before the first forward, as the meta
        path's name-seeded init would have made it. Not traffic of any step."""
        if self.backend.refresher is not None:
            self.backend.refresher.refresh()

    def _cut_state(
        self, module: nn.Module, adapter: UnitAdapter,
    ) -> tuple[list[NeuronGroup] | None, Sequence[int]]:
        """The full model's state cut along unit boundaries, and where this rank's pieces
        live. Returns the plan's neuron groups (None: block units) and the local units."""
        plan = self.plan
        neuron_groups = match_plan(plan, module, adapter, self.strategy)
        self.unit_names = [u.name for u in plan.units]
        self.pieces = full_pieces(module, self.unit_names, neuron_groups)
        self.full_state_keys = list(module.state_dict().keys())
        self.held_units = plan.held_units(self.rank)
        self.backward_masked = self.strategy.backward_masked
        # Forward masking keeps only held units locally; backward masking keeps the full model.
        local_units = range(plan.num_units) if self.backward_masked else self.held_units
        self.local = local_pieces(self.pieces, local_units)
        return neuron_groups, local_units

    def _wrap_layers(self, module: nn.Module, adapter: UnitAdapter, comp: Composition,
                     neuron_groups: list[NeuronGroup] | None) -> None:
        """What the local model's layers get before a backend takes them: sub-layers per
        group (FSDP), output scaling, compile and activation checkpointing per block."""
        strat = self.strategy
        if comp.fsdp and strat.splits_layers:  # one sub-layer per neuron group (FSDP needs it)
            group_layers(module, self.local)
        scaling = comp.output_scaling or strat.default_output_scaling
        self._scaling_hooks = (scale_kept_outputs(module, neuron_groups, self.held_units)
                               if scaling == "keep" and neuron_groups else [])
        blocks = [name for name, m in unit_modules(module, adapter)
                  if any(True for _ in m.parameters())]
        if comp.compile:  # inside checkpointing and every hook (runtime.compile)
            compile_blocks(module, blocks)
        if comp.ac:  # before sharding: FSDP's hooks stay outside recompute
            checkpoint_blocks(module, blocks)

    def _make_backend(self, module: nn.Module, adapter: UnitAdapter, comp: Composition,
                      param_dtype: torch.dtype | None, reduce_dtype: torch.dtype | None,
                      dev: torch.device) -> Backend:
        """FSDP2 per holder group (``fsdp``), or the holder reducer."""
        if comp.fsdp:
            return FSDPBackend(
                module, plan=self.plan, rank=self.rank, groups=self.groups, adapter=adapter,
                pieces=self.pieces, local=self.local, held=self.held_units,
                strategy=self.strategy, param_dtype=param_dtype, reduce_dtype=reduce_dtype,
                device=dev, prefetch=comp.fsdp_prefetch,
                gloo=GlooComms(comp.ring_reduce_scatter, comp.async_unshard))
        return ReducerBackend(module, plan=self.plan, rank=self.rank, groups=self.groups,
                              pieces=self.pieces, local=self.local, held=self.held_units,
                              strategy=self.strategy, bucket_cap_mb=comp.bucket_cap_mb,
                              param_dtype=param_dtype, zero=comp.zero)

    def _build_local(
        self, module: nn.Module, adapter: UnitAdapter, device: torch.device, seed: int,
        slices: Mapping[str, tuple[int, torch.Tensor]],
    ) -> nn.Module:
        """This rank's physical subnetwork: non-held blocks dropped (b-sdp), layers narrowed
        to held neuron groups (n-sdp), on ``device``, holders identical."""
        if self.strategy.drops_blocks:
            drop_units(module, adapter, self.held_units)
        on_meta = is_on_meta(module)
        if on_meta:  # name-seeded init: holders agree without any communication
            materialize(module, adapter, device=device, seed=seed, slices=slices)
        else:
            narrow_tensors(module, slices)
            module.to(device)
        if set(module.state_dict()) != set(self.local):
            raise RuntimeError("internal: the local model's state keys do not match its pieces")
        if not on_meta:
            broadcast_from_owners(module.state_dict(), self.local, self.plan, self.groups,
                                  rank=self.rank)
        return module

    # -- the DDP surface ------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.backward_masked:
            self._maybe_refresh()
        return self.backend.forward(*args, **kwargs)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally (gradient accumulation); the next backward outside
        this context reduces the accumulated sum."""
        self.backend.set_sync(False)
        try:
            yield
        finally:
            self.backend.set_sync(True)

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        """What the optimizer should train: the local model's parameters, except that under
        backward masking frozen (non-held) parameters are left out and partly held ones are
        replaced by their held slices (``runtime.masking``)."""
        del recurse, remove_duplicate
        for name, p in self.trainable.params.items():
            local = name in self.local  # a local state key, not a slice's piece name
            yield (f"{prefix}{'module' if local else 'slices'}.{name}".lstrip("."), p)

    def optimizer(
        self, optimizer_class: type[torch.optim.Optimizer], params: Iterable[Any] | None = None,
        **defaults: Any,
    ) -> torch.optim.Optimizer:
        """``optimizer_class(params, **defaults)``, ``params`` (default: ``self.parameters()``;
        parameter groups too) being this wrapper's parameters. Under ``zero`` the optimizer
        trains this rank's shards instead, with the same groups and hyperparameters, and
        all-gathers the updated shards into the parameters after every ``step()``
        ([Note: ZeRO in holder groups]); one line either way::

            opt = model.optimizer(torch.optim.AdamW, lr=3e-4, weight_decay=0.1)
        """
        chosen = self.parameters() if params is None else params
        if not self.zero:
            return optimizer_class(chosen, **defaults)
        assert isinstance(self.backend, ReducerBackend)
        self._zero_opt = ZeroOptimizer(self.backend.reducer, optimizer_class, chosen, defaults)
        return self._zero_opt.optimizer

    @property
    def _ddp_params_and_buffers_to_ignore(self) -> NoReturn:
        # torch DDP reads this attribute of the module it wraps (accelerate's prepare() wraps
        # in DDP too): DDP would broadcast rank 0's units over other ranks' different units.
        raise TypeError(
            "SubnetDataParallel is already data parallel (each unit averaged over its "
            "holders): do not wrap it in DistributedDataParallel; with accelerate, pass the "
            "optimizer and data loaders to accelerator.prepare(), not the model"
        )

    # -- what subnetdp adds (the RankModel interface, runtime.rank) ------------------------
    @property
    def model(self) -> nn.Module:
        """What to call (the wrapper itself), as for the baselines' ``RankModel``."""
        return self

    @property
    def trainable(self) -> Any:
        return self.backend.trainable

    @property
    def comm_stats(self) -> CommStats:
        return self.backend.stats

    @property
    def params_held(self) -> int:
        """Parameter elements this rank stores (under backward masking: the full model; under
        fsdp: its shards)."""
        return sum(local_tensor(p).numel() for p in self.module.parameters())

    @property
    def params_trained(self) -> int:
        """Parameter elements this rank trains (with gradients and optimizer state)."""
        return sum(local_tensor(p).numel() for p in self.trainable.params.values())

    def param_places(self) -> list[tuple[nn.Parameter, str, tuple[int, int, int] | None]]:
        """Where each trainable parameter lives in the local state: ``(param, local key,
        None)`` for a whole local entry, ``(param, local key, (dim, start, stop))`` for the
        slice parameter of a partly held one (nb-sdp) or a neuron group's part of a grouped
        layer (n-sdp/nb-sdp with fsdp). Checkpoints shard optimizer state by it."""
        out: list[tuple[nn.Parameter, str, tuple[int, int, int] | None]] = []
        parts = self.backend.part_places()
        for name, p in self.trainable.params.items():
            if name in self.local:
                out.append((p, name, None))
            elif name in parts:
                out.append((p, *parts[name]))
            else:
                piece = self.trainable.local[name][0].piece
                assert piece.dim is not None
                out.append((p, piece.key, (piece.dim, piece.start, piece.stop)))
        return out

    def plain_params(self) -> Mapping[str, torch.Tensor]:
        return self.backend.plain_params()

    def to_plain(self, t: torch.Tensor) -> torch.Tensor:
        return t.full_tensor() if isinstance(t, DTensor) else t

    def from_plain(self, p: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        if not isinstance(p, DTensor):
            return t
        return DTensor.from_local(my_chunk(t, p).clone(), p.device_mesh, p.placements,
                                  run_check=False, shape=p.shape, stride=p.stride())

    def tracked_modules(self) -> list[nn.Module]:
        """Modules whose parameters a memory tracker must count: the local model, and under
        nb-sdp the held slice parameters (views whose gradients and optimizer state live
        outside the model)."""
        extra = [nn.ParameterList(self.trainable.external)] if self.trainable.external else []
        if self.zero_copies():
            extra.append(nn.ParameterList(self.zero_copies()))
        return [self.module, *extra]

    def zero_copies(self) -> list[nn.Parameter]:
        """Under ``zero``: the optimizer's copies of the slices of non-contiguous pieces
        (narrowed layers); the other slices it trains are views of the parameters."""
        return self._zero_opt.master_params() if self._zero_opt is not None else []

    def grad_buffers(self) -> list[torch.Tensor]:
        """The reducer's flat gradient buffers (parameters' ``.grad`` are views into them)."""
        return self.backend.grad_buffers()

    @torch.no_grad()
    def refresh(self) -> int:
        """Backward masking: send each unit's current values from its owner to the workers
        that do not hold it (collective over the world). Runs by itself before the forward
        that follows every ``refresh_every``-th reduced backward; call it to refresh now.
        Returns the bytes this rank sent."""
        refresher = self.backend.refresher
        if refresher is None:
            return 0
        sent = refresher.refresh()
        self.comm_stats.last_refresh_bytes = sent
        self.comm_stats.total_refresh_bytes += sent
        self._refreshed_through = self.comm_stats.reductions
        return sent

    def _maybe_refresh(self) -> None:
        n = self.comm_stats.reductions
        if n > self._refreshed_through and n % self.refresh_every == 0:
            self.refresh()

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip gradients by the *full model's* norm and return that norm.

        A per-rank norm would differ between holders of the same unit, so they would scale the
        same averaged gradient differently and their copies would drift apart. Each parameter is
        counted once, by its owner (rank 0 for shared ones), and one scalar all-reduce over the
        world gives every rank the same norm and the same clip factor.
        """
        device = local_tensor(next(self.module.parameters())).device
        sq = self.backend.owned_grad_sq_norm(device)
        dist.all_reduce(sq)
        total = sq.sqrt()
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        all_grads = self.backend.clip_targets()
        if all_grads:
            torch._foreach_mul_(all_grads, coef.to(all_grads[0].dtype))
        return total

    def sync_buffers(self) -> None:
        """Average BatchNorm-style running statistics over holders (before eval/checkpoint)."""
        buffers = {k: b for k, b in self.module.named_buffers() if k in self.local}
        sync_buffers(buffers, self.local, self.plan, self.groups, rank=self.rank)

    def full_state_dict(self, dst: int = 0) -> dict[str, torch.Tensor] | None:
        """The full model's state dict on rank ``dst`` (None on the others), each unit from its
        owner. Collective: call it on every rank, then use the result on ``dst``; a call on
        some ranks only raises ``CollectiveCallError`` naming the others
        ([Note: collective calls on some ranks] in ``runtime.called_by_all``)."""
        with called_by_all("full_state_dict()",
                           hint=f" (it returns the state on rank {dst}, None elsewhere)"):
            self.sync_buffers()
            return gather_full_state_dict(self.shard_state(), self.pieces,
                                          self.full_state_keys, world=self.world,
                                          rank=self.rank, dst=dst)

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
        exactly once; without it, every piece it holds (trains). Values are contiguous CPU copies.
        """
        src = self.backend.local_state() if tensors is None else self.backend.plain(tensors)
        return shard(src, self.local, self.plan, rank=self.rank, owned_only=owned_only)

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
        self.backend.fill(dst, entries, self.local)


def _default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
