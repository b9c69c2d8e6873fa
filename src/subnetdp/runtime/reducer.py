"""The holder-averaging gradient reducer.

[Note: holder averaging]
A parameter in unit u is held by the workers holders(u), c_u of them; every holder computes a
gradient on its own data, and the update uses their mean, g = (1/c_u) * sum_{i in holders(u)} g_i.
Shared parameters are held by everyone and averaged over the world, exactly as DDP does.
Non-holders neither contribute nor receive: they do not have the parameter at all. Since every
holder then applies the same optimizer step to the same averaged gradient, holder copies and
their optimizer states stay bit-identical without ever being broadcast.

DDP's reducer cannot express this (it divides by the world size and expects every rank to run
every parameter), so subnetdp owns its reducer:
- Buckets. Parameters are laid out in one *global* order, the reverse of the full model's
  registration order (roughly the order in which backward produces gradients), and consecutive
  parameters with the same holder set and dtype are packed into a bucket of at most
  ``bucket_cap_bytes``. Every rank derives the same list from the plan and the full model's
  layout, so the members of a group agree on each bucket's content and flat offsets.
- Overlap. A post-accumulate-grad hook marks a parameter ready; when a bucket is complete it is
  all-reduced asynchronously over its holder group while backward continues.
- No deadlock. A rank launches its buckets strictly in global order (a ready bucket waits for
  the earlier ones), so two ranks that share two groups always meet them in the same order.
- Grad views. Before forward, each parameter's ``.grad`` is set to a view of its bucket's flat
  buffer, so autograd accumulates straight into the buffer: no copy in, no copy out, and no
  second full-size gradient buffer (DDP's ``gradient_as_bucket_view``).
- Finish. An autograd-engine callback at the end of backward launches what is left, waits,
  and divides each bucket by its holder count, so ``loss.backward()`` returns averaged grads.
Gloo has no AVG reduction, hence SUM then divide (after, to keep the sum exact in fp32).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from subnetdp.plan import Plan
from subnetdp.runtime.groups import HolderGroups
from subnetdp.subnet.build import ParamInfo


@dataclass(frozen=True)
class BucketSpec:
    """A bucket of the global order: same holder set and dtype, parameters by full name."""

    holders: tuple[int, ...]
    names: tuple[str, ...]
    numels: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return sum(self.numels)


def global_buckets(
    layout: Sequence[ParamInfo], plan: Plan, *, bucket_cap_bytes: int
) -> list[BucketSpec]:
    """The bucket list every rank derives identically from the plan and the full layout."""
    everyone = tuple(range(plan.world))
    specs: list[BucketSpec] = []
    cur: list[ParamInfo] = []
    cur_holders: tuple[int, ...] = ()

    def close() -> None:
        if cur:
            specs.append(
                BucketSpec(
                    cur_holders,
                    tuple(p.name for p in cur),
                    tuple(math.prod(p.shape) for p in cur),
                    cur[0].dtype,
                )
            )
            cur.clear()

    size = 0
    for info in reversed(layout):
        holders = everyone if info.unit is None else tuple(plan.holders(info.unit))
        nbytes = math.prod(info.shape) * info.dtype.itemsize
        if cur and (
            holders != cur_holders or info.dtype != cur[0].dtype or size + nbytes > bucket_cap_bytes
        ):
            close()
            size = 0
        cur_holders = holders
        cur.append(info)
        size += nbytes
    close()
    return specs


@dataclass
class _Bucket:
    spec: BucketSpec
    params: list[nn.Parameter]
    group: dist.ProcessGroup | None
    offsets: list[int]
    buffer: torch.Tensor | None = None
    ready: list[bool] = field(default_factory=list)
    pending: int = 0
    work: dist.Work | None = None

    @property
    def nbytes(self) -> int:
        return self.spec.numel * self.spec.dtype.itemsize

    def ensure_buffer(self) -> None:
        if self.buffer is None:  # allocated once, on first use; every slice is written before use
            p0 = self.params[0]
            self.buffer = torch.empty(self.spec.numel, dtype=p0.dtype, device=p0.device)

    def view(self, i: int) -> torch.Tensor:
        assert self.buffer is not None
        p = self.params[i]
        return self.buffer[self.offsets[i] : self.offsets[i] + p.numel()].view_as(p)


@dataclass
class CommStats:
    """Bytes this rank all-reduced in the last backward, in total, per holder set."""

    last_step_bytes: int = 0
    last_step_ring_bytes: float = 0.0
    last_step_collectives: int = 0
    # collectives launched while this rank still awaited other gradients (true overlap)
    last_step_overlapped: int = 0
    total_bytes: int = 0
    by_group: dict[tuple[int, ...], int] = field(default_factory=dict)


class HolderReducer:
    """Averages each held parameter's gradient over its holders (see the Note above)."""

    def __init__(
        self,
        params: Mapping[str, nn.Parameter],
        layout: Sequence[ParamInfo],
        plan: Plan,
        *,
        rank: int,
        groups: HolderGroups,
        bucket_cap_bytes: int = 25 * 2**20,
    ) -> None:
        self.rank = rank
        self.stats = CommStats()
        self.buckets: list[_Bucket] = []
        for spec in global_buckets(layout, plan, bucket_cap_bytes=bucket_cap_bytes):
            if rank not in spec.holders or len(spec.holders) < 2:
                continue  # not ours, or held alone: nothing to average
            missing = [n for n in spec.names if n not in params]
            if missing:
                raise RuntimeError(f"rank {rank} holds {spec.holders} but lacks {missing[:3]}")
            ps = [params[n] for n in spec.names]
            offsets = [0]
            for p in ps[:-1]:
                offsets.append(offsets[-1] + p.numel())
            self.buckets.append(_Bucket(spec, ps, groups.group(spec.holders), offsets))
        self._hooks = []
        for b in self.buckets:
            for i, p in enumerate(b.params):
                if p.requires_grad:
                    self._hooks.append(p.register_post_accumulate_grad_hook(self._hook(b, i)))
        self.enabled = True  # False inside no_sync(): gradients just accumulate locally
        self._in_backward = False
        self._next = 0
        self._pending = 0  # gradients still awaited in this backward, over all buckets

    # -- before forward -------------------------------------------------------------------
    def attach_grad_views(self) -> None:
        """Point every ``.grad`` at its bucket slice so backward accumulates into the buffer."""
        for b in self.buckets:
            b.ensure_buffer()
            for i, p in enumerate(b.params):
                if p.grad is None:
                    view = b.view(i)
                    view.zero_()
                    p.grad = view

    # -- during backward ------------------------------------------------------------------
    def _hook(self, bucket: _Bucket, i: int):
        def hook(_: torch.Tensor) -> None:
            if not self.enabled:
                return
            if not self._in_backward:
                self._start_backward()
            if not bucket.ready[i]:
                bucket.ready[i] = True
                bucket.pending -= 1
                self._pending -= 1
                if bucket.pending == 0:
                    launched = self._launch_ready()
                    if self._pending > 0:
                        self.stats.last_step_overlapped += launched

        return hook

    def _start_backward(self) -> None:
        self._in_backward = True
        self._next = 0
        self.stats.last_step_bytes = 0
        self.stats.last_step_ring_bytes = 0.0
        self.stats.last_step_collectives = 0
        self.stats.last_step_overlapped = 0
        for b in self.buckets:
            b.ready = [False] * len(b.params)
            b.pending = len(b.params)
        self._pending = sum(b.pending for b in self.buckets)
        torch.autograd.Variable._execution_engine.queue_callback(self._finish)

    def _launch_ready(self) -> int:
        """Launch, in global order, every bucket whose gradients are all ready; return count."""
        first = self._next
        while self._next < len(self.buckets) and self.buckets[self._next].pending == 0:
            self._launch(self.buckets[self._next])
            self._next += 1
        return self._next - first

    def _launch(self, b: _Bucket) -> None:
        b.ensure_buffer()
        for i, p in enumerate(b.params):
            view = b.view(i)
            g = p.grad
            if g is None:  # unused in this forward: contributes zero
                view.zero_()
            elif g.data_ptr() != view.data_ptr():
                view.copy_(g)
        b.work = dist.all_reduce(b.buffer, group=b.group, async_op=True)
        c = len(b.spec.holders)
        st = self.stats
        st.last_step_bytes += b.nbytes
        st.last_step_ring_bytes += 2 * (c - 1) / c * b.nbytes
        st.last_step_collectives += 1
        st.total_bytes += b.nbytes
        st.by_group[b.spec.holders] = st.by_group.get(b.spec.holders, 0) + b.nbytes

    def _finish(self) -> None:
        # Buckets still pending had parameters that received no gradient this backward.
        for b in self.buckets[self._next :]:
            self._launch(b)
        self._next = len(self.buckets)
        for b in self.buckets:
            assert b.work is not None and b.buffer is not None
            b.work.wait()
            b.work = None
            b.buffer.div_(len(b.spec.holders))
            for i, p in enumerate(b.params):
                p.grad = b.view(i)
        self._in_backward = False

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
