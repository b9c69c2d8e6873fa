"""One rank's trainable model, whatever the strategy: the interface train, bench and
checkpoints read (``RankModel``), and its two baseline implementations.

``SubnetDataParallel`` implements it for every SDP strategy; ``TorchDDPRank`` (torch DDP,
the fair configuration: see [Note: the fair DDP baseline]) and ``FSDPRank`` (FSDP2 over the
world) for the baselines. ``subnetdp.parallelize`` builds all three.

[Note: the fair DDP baseline]
torch DDP's default (``gradient_as_bucket_view=False``) keeps each gradient twice: in
``param.grad`` and in the flat bucket it all-reduces. subnetdp's reducer lets autograd write
straight into the bucket (one copy), so comparing it with DDP's default would credit SDP with a
whole extra gradient copy that has nothing to do with subnetworks. Every DDP that subnetdp
builds therefore uses ``gradient_as_bucket_view=True``; torch's default exists only as the
explicitly labelled extra baseline ``ddp (default buckets)``.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from subnetdp.runtime.backends import on_backward_end
from subnetdp.runtime.fsdp import GroupTraffic, local_full_state, local_tensor
from subnetdp.runtime.groups import HolderGroups
from subnetdp.runtime.local_steps import SyncLayout
from subnetdp.runtime.reducer import CommStats
from subnetdp.strategy import Strategy
from subnetdp.subnet.pieces import full_pieces, local_pieces, reduction_order

ParamPlace = tuple[nn.Parameter, str, tuple[int, int, int] | None]


class RankModel(Protocol):
    """What a rank trains and what the harness reads from it."""

    strategy: Strategy

    @property
    def model(self) -> nn.Module:
        """Call it: forward runs this rank's model; ``loss.backward()`` reduces gradients."""

    @property
    def module(self) -> nn.Module:
        """The local model without the data-parallel wrapper."""

    @property
    def comm_stats(self) -> CommStats:
        """Bytes counted by the reducer (all-reduces) or from FSDP's per-step traffic."""

    @property
    def params_held(self) -> int: ...

    @property
    def params_trained(self) -> int: ...

    def parameters(self) -> Any:
        """What the optimizer trains (frozen parameters excluded)."""

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip by the full model's gradient norm (the same on every rank) and return it."""

    def optimizer(self, optimizer_class: type[torch.optim.Optimizer],
                  params: Iterable[Any] | None = None, **defaults: Any) -> torch.optim.Optimizer:
        """``optimizer_class(params or self.parameters(), **defaults)``, sharded where the
        composition says so (``zero``)."""

    def grad_buffers(self) -> list[torch.Tensor]:
        """Flat gradient buffers outside ``param.grad`` (memory tracking)."""

    def tracked_modules(self) -> list[nn.Module]: ...

    def sync_buffers(self) -> None: ...

    def full_state_dict(self, dst: int = 0) -> dict[str, torch.Tensor] | None:
        """The full model's state on rank ``dst`` (None elsewhere). Collective."""

    def shard_state(
        self, tensors: Mapping[str, torch.Tensor] | None = None, *, owned_only: bool = True
    ) -> dict[str, torch.Tensor]:
        """This rank's pieces of the full model's state (or of ``tensors``, keyed like the
        local state), in full-model names; with ``owned_only`` the ranks' shards cover the
        full model exactly once."""

    def load_shard_state(
        self, entries: Mapping[str, torch.Tensor], into: Mapping[str, torch.Tensor] | None = None
    ) -> None: ...

    def param_places(self) -> list[ParamPlace]:
        """Each trainable parameter's place in the local state: ``(param, key, slice)``."""

    def plain_params(self) -> Mapping[str, torch.Tensor]:
        """Tensors shaped like each local parameter in the plain (unsharded, ungrouped)
        layout, keyed as ``param_places`` keys them: templates for optimizer state."""

    def to_plain(self, t: torch.Tensor) -> torch.Tensor:
        """A parameter-shaped tensor (e.g. ``exp_avg``) whole: FSDP shards are gathered
        (collective over the parameter's mesh; call in parameter order)."""

    def from_plain(self, p: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """``t`` (shaped like ``p`` whole) stored the way ``p`` is: this rank's FSDP shard."""

    def sync_layout(self) -> SyncLayout:
        """What an outer step of local steps averages (``runtime.local_steps``)."""


class _WholeModelRank:
    """What the two baselines share: every rank's state is the full model's."""

    strategy: Strategy

    def __init__(self, module: nn.Module, model: nn.Module, comm: CommStats) -> None:
        self._module, self._model, self._comm = module, model, comm

    @property
    def model(self) -> nn.Module:
        return self._model

    @property
    def module(self) -> nn.Module:
        return self._module

    @property
    def comm_stats(self) -> CommStats:
        return self._comm

    @property
    def params_held(self) -> int:
        return sum(local_tensor(p).numel() for p in self._module.parameters())

    @property
    def params_trained(self) -> int:
        return sum(local_tensor(p).numel() for p in self.parameters())

    def parameters(self) -> list[nn.Parameter]:
        return [p for p in self._module.parameters() if p.requires_grad]

    def optimizer(self, optimizer_class: type[torch.optim.Optimizer],
                  params: Iterable[Any] | None = None, **defaults: Any) -> torch.optim.Optimizer:
        return optimizer_class(self.parameters() if params is None else params, **defaults)

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        norm = torch.nn.utils.clip_grad_norm_(self.parameters(), max_norm)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm

    def grad_buffers(self) -> list[torch.Tensor]:
        return []  # gradients live in param.grad (DDP: views of its buckets)

    def tracked_modules(self) -> list[nn.Module]:
        return [self._module]

    def sync_buffers(self) -> None:
        pass  # identical on every rank (DDP broadcasts rank 0's buffers before each forward)

    def param_places(self) -> list[ParamPlace]:
        return [(p, k, None) for k, p in self._module.named_parameters() if p.requires_grad]

    def plain_params(self) -> Mapping[str, torch.Tensor]:
        return dict(self._module.named_parameters())

    def to_plain(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def from_plain(self, p: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return t

    def sync_layout(self) -> SyncLayout:
        """Every parameter whole and shared: averaged over the world (plain DiLoCo)."""
        pieces = full_pieces(self._module, [])
        params = {k: p for k, p in self._module.named_parameters() if p.requires_grad}
        local = local_pieces(pieces, [])
        return SyncLayout(params, {k: local[k] for k in params}, reduction_order(pieces),
                          HolderGroups([], world=dist.get_world_size()))


class TorchDDPRank(_WholeModelRank):
    """torch ``DistributedDataParallel`` over the full model, its bytes counted by a comm hook
    that then does exactly what DDP's default does (divide by the world size, all-reduce)."""

    def __init__(
        self, module: nn.Module, *, strategy: Strategy, device: torch.device,
        bucket_cap_mb: float, bucket_view: bool = True, find_unused_parameters: bool = False,
        zero_optimizer: bool = False,
    ) -> None:
        """``zero_optimizer``: the optimizer is torch's ``ZeroRedundancyOptimizer`` (ZeRO-1:
        each rank keeps the optimizer state of its partition of the parameters)."""
        ddp = nn.parallel.DistributedDataParallel(
            module, device_ids=[device.index] if device.type == "cuda" else None,
            bucket_cap_mb=bucket_cap_mb,
            gradient_as_bucket_view=bucket_view,  # [Note: the fair DDP baseline]
            find_unused_parameters=find_unused_parameters,
        )
        super().__init__(module, ddp, CommStats())
        self.strategy, self.zero_optimizer = strategy, zero_optimizer
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        # DDP's flat buckets, by index, as its reducer hands them to the hook: allocated in C++
        # before any step, a memory tracker sees them only if told (grad_buffers). Weak: DDP
        # replaces its buckets once (rebuilt in gradient order after the first step), and a
        # strong reference would keep the old ones alive beside the new.
        self._buckets: dict[int, weakref.ref[torch.Tensor]] = {}
        ddp.register_comm_hook(None, self._make_hook())

    def _make_hook(self) -> Any:
        everyone = tuple(range(self.world))
        stats, buckets, counted = self._comm, self._buckets, self.world > 1

        # No annotations on purpose: DDP checks them at registration and rejects the strings
        # that `from __future__ import annotations` turns them into.
        def hook(_state, bucket):  # type: ignore[no-untyped-def]
            buf = bucket.buffer()
            buckets[bucket.index()] = weakref.ref(buf)
            if counted:
                nbytes = buf.numel() * buf.element_size()
                stats.total_bytes += nbytes
                stats.by_group[everyone] = stats.by_group.get(everyone, 0) + nbytes
            return default_hooks.allreduce_hook(None, bucket)  # type: ignore[arg-type]

        return hook

    def optimizer(self, optimizer_class: type[torch.optim.Optimizer],
                  params: Iterable[Any] | None = None, **defaults: Any) -> torch.optim.Optimizer:
        chosen = self.parameters() if params is None else params
        if not self.zero_optimizer:
            return optimizer_class(chosen, **defaults)
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(chosen, optimizer_class=optimizer_class, **defaults)

    def grad_buffers(self) -> list[torch.Tensor]:
        """DDP's buckets (known after the first backward). With bucket views they are the
        gradients' storage; with torch's default they are a second copy beside ``.grad``."""
        return [b for ref in self._buckets.values() if (b := ref()) is not None]

    def full_state_dict(self, dst: int = 0) -> dict[str, torch.Tensor] | None:
        if self.rank != dst:
            return None
        return {k: v.detach().to("cpu", copy=True) for k, v in self._module.state_dict().items()}

    def shard_state(
        self, tensors: Mapping[str, torch.Tensor] | None = None, *, owned_only: bool = True
    ) -> dict[str, torch.Tensor]:
        if owned_only and self.rank != 0:  # everyone holds everything: rank 0 owns it all
            return {}
        src = self._module.state_dict() if tensors is None else tensors
        return {k: v.detach().to("cpu", copy=True).contiguous() for k, v in src.items()}

    @torch.no_grad()
    def load_shard_state(
        self, entries: Mapping[str, torch.Tensor], into: Mapping[str, torch.Tensor] | None = None
    ) -> None:
        dst = self._module.state_dict() if into is None else into
        missing = [k for k in dst if k not in entries]
        if missing:
            raise KeyError(f"the checkpoint lacks {len(missing)} entries, e.g. {missing[:3]}")
        for key, t in dst.items():
            t.copy_(entries[key])


class FSDPRank(_WholeModelRank):
    """FSDP2 over the world (ZeRO-3), the traffic of every synced backward counted from the
    sharded sizes (``traffic``) and the gathered and reduced dtypes."""

    def __init__(
        self, module: nn.Module, *, strategy: Strategy, traffic: list[GroupTraffic],
        param_bytes: int, reduce_bytes: int,
    ) -> None:
        super().__init__(module, module, CommStats(collective="fsdp"))
        self.strategy = strategy
        self.rank = dist.get_rank()
        self._traffic = [(t.ranks, t.bytes(param_bytes, reduce_bytes)) for t in traffic]
        module.register_forward_hook(self._count_after_backward)

    def _count_after_backward(self, _: nn.Module, __: Any, out: Any) -> None:
        if torch.is_grad_enabled():
            on_backward_end(out, self._count)

    def _count(self) -> None:
        stats = self._comm
        stats.reductions += 1
        step = 0
        for ranks, b in self._traffic:
            if b:
                stats.by_group[ranks] = stats.by_group.get(ranks, 0) + b
                step += b
        stats.last_step_bytes = step
        stats.total_bytes += step

    def full_state_dict(self, dst: int = 0) -> dict[str, torch.Tensor] | None:
        state = local_full_state(self._module)  # collective: every rank gathers
        if self.rank != dst:
            return None
        return {k: v.detach().to("cpu", copy=True) for k, v in state.items()}

    def shard_state(
        self, tensors: Mapping[str, torch.Tensor] | None = None, *, owned_only: bool = True
    ) -> dict[str, torch.Tensor]:
        raise NotImplementedError("checkpoints of FSDP runs are not built yet")

    def load_shard_state(
        self, entries: Mapping[str, torch.Tensor], into: Mapping[str, torch.Tensor] | None = None
    ) -> None:
        raise NotImplementedError("checkpoints of FSDP runs are not built yet")
