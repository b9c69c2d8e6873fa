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
  registration order (roughly the order in which backward produces gradients). Each holder set
  (and dtype) fills its own bucket of at most ``bucket_cap_bytes`` along that order, across
  layers, and buckets are listed by the position of their last piece (when backward completes
  them). Every rank derives the same list from the plan and the full model's layout, so the
  members of a group agree on each bucket's content and flat offsets. Packing by holder set,
  not only consecutive runs of one, matters at neuron level: there every layer pair interleaves
  its groups' slices with tiny shared norm weights, and runs alone gave 49 all-reduces per
  step on llama-tiny where 3 carry the same bytes.
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

With ``zero`` (ZeRO-1/2 inside holder groups, ``runtime.zero``) a bucket is reduce-scattered
instead: its flat buffer is padded to a multiple of its holder count c, holder k (its position
in the holder set) receives the averaged slice k, and the optimizer later all-gathers the
updated slice back. Buckets held alone take part too (c = 1: no collective), so that every
trainable element has exactly one shard. ZeRO-2 attaches no grad views: a parameter's gradient
is copied into its bucket when the bucket launches and freed at once, and a launched bucket's
buffer is freed when its reduce-scatter completes (at most ``ZERO2_IN_FLIGHT`` buffers in
flight), so a full gradient lives only from its first accumulation to its bucket's launch.
"""

from __future__ import annotations

import math
import weakref
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.hooks import RemovableHandle

from subnetdp.distributed import faults
from subnetdp.plan import Plan
from subnetdp.runtime.groups import HolderGroups
from subnetdp.subnet.pieces import LocalPiece, Piece
from subnetdp.torch_compat import reduce_scatter_single


@dataclass(frozen=True)
class BucketSpec:
    """A bucket of the global order: same holder set and dtype, pieces by full-model name."""

    holders: tuple[int, ...]
    pieces: tuple[Piece, ...]
    dtype: torch.dtype

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.pieces)

    @property
    def numel(self) -> int:
        return sum(p.numel for p in self.pieces)


def global_buckets(
    order: Sequence[Piece], plan: Plan, *, bucket_cap_bytes: int
) -> list[BucketSpec]:
    """The bucket list every rank derives identically from the plan and the full model's
    reduced pieces in reduction order (``subnet.pieces.reduction_order``: user-frozen
    parameters and tie aliases are not in it, so they cost no bytes anywhere). Each (holder
    set, dtype) fills its own open bucket; a full one is closed and a new one opened. The list
    is ordered by each bucket's last piece, the point in backward where it can launch."""
    everyone = tuple(range(plan.world))
    done: list[tuple[int, BucketSpec]] = []  # (index of the last piece, bucket)
    open_: dict[tuple[tuple[int, ...], torch.dtype], tuple[list[Piece], int, int]] = {}
    for i, piece in enumerate(order):
        holders = everyone if piece.unit is None else tuple(plan.holders(piece.unit))
        key = (holders, piece.dtype)
        nbytes = piece.numel * piece.dtype.itemsize
        pieces, size, last = open_.get(key, ([], 0, -1))
        if pieces and size + nbytes > bucket_cap_bytes:
            done.append((last, BucketSpec(holders, tuple(pieces), piece.dtype)))
            pieces, size = [], 0
        open_[key] = ([*pieces, piece], size + nbytes, i)
    done += [(last, BucketSpec(h, tuple(ps), dt)) for (h, dt), (ps, _, last) in open_.items()]
    return [spec for _, spec in sorted(done, key=lambda d: d[0])]


def _ready_hook(reducer: weakref.ref[HolderReducer], pid: int
                ) -> Callable[[torch.Tensor], None]:
    def hook(_: torch.Tensor) -> None:
        r = reducer()
        if r is not None:
            r.ready(pid)

    return hook


def _remove_all(handles: Sequence[RemovableHandle]) -> None:
    for h in handles:
        h.remove()


ZERO_COLLECTIVE = "reduce_scatter+all_gather"  # CommStats.collective under ZeRO
ZERO2_IN_FLIGHT = 2  # ZeRO-2: launched buckets whose full buffer may still exist


class BufferPool:
    """ZeRO-2's short-lived full-bucket buffers, recycled: at most ``ZERO2_IN_FLIGHT + 1``
    exist at once (launched buckets awaiting their collective and the one being filled), each
    of ``numel`` elements (the largest bucket within the bucket cap), so a step allocates
    nothing new (on CPU, fresh pages every step cost time) and they take a bounded few caps.
    A bucket above the cap (one large parameter, e.g. an embedding) gets a buffer of its own,
    freed after use: pooling it would keep several of that size alive."""

    def __init__(self, numel: int) -> None:
        self.numel = numel
        self._free: list[torch.Tensor] = []

    def take(self, numel: int, like: torch.Tensor) -> torch.Tensor:
        """A tensor of ``numel`` elements of ``like``'s dtype and device; contents stale."""
        if numel > self.numel:
            return torch.empty(numel, dtype=like.dtype, device=like.device)
        for i, t in enumerate(self._free):
            if t.dtype == like.dtype and t.device == like.device:
                return self._free.pop(i)[:numel]
        return torch.empty(self.numel, dtype=like.dtype, device=like.device)[:numel]

    def give(self, t: torch.Tensor) -> None:
        base = t if t._base is None else t._base
        if base.numel() == self.numel:
            self._free.append(base)


@dataclass
class ZeroShard:
    """This rank's slice of a bucket under ZeRO: holder ``k`` of ``c`` owns the flat elements
    ``[k * size, (k + 1) * size)`` of the buffer padded to ``c * size``; ``grad`` receives the
    averaged slice (padding included: it is zero). ZeRO-1 keeps the buffer, so ``grad`` is
    its slice k (an in-place reduce-scatter); ZeRO-2 frees it, ``grad`` is its own tensor."""

    c: int
    k: int
    size: int
    grad: torch.Tensor | None = None

    def own_grad(self) -> torch.Tensor:
        assert self.grad is not None
        return self.grad

    @property
    def start(self) -> int:
        return self.k * self.size

    @property
    def padded(self) -> int:
        return self.c * self.size


@dataclass
class _Bucket:
    spec: BucketSpec
    params: list[nn.Parameter]
    locs: list[LocalPiece]  # where each piece sits in its local parameter
    group: dist.ProcessGroup | None
    offsets: list[int]
    buffer: torch.Tensor | None = None
    ready: list[bool] = field(default_factory=list)
    pending: int = 0
    work: dist.Work | None = None
    shard: ZeroShard | None = None  # under ZeRO

    @property
    def nbytes(self) -> int:
        return self.spec.numel * self.spec.dtype.itemsize

    def ensure_buffer(self, pool: BufferPool | None = None) -> None:
        if self.buffer is None:  # allocated on first use; every slice is written before use
            p0 = self.params[0]
            n = self.spec.numel if self.shard is None else self.shard.padded
            self.buffer = (pool.take(n, p0) if pool is not None  # ZeRO-2: recycled
                           else torch.empty(n, dtype=p0.dtype, device=p0.device))
            self.buffer[self.spec.numel :].zero_()  # ZeRO padding: zero, and counted nowhere
            if self.shard is not None and self.shard.grad is None:  # ZeRO-1
                lo = self.shard.start
                self.shard.grad = self.buffer[lo : lo + self.shard.size]

    def slot(self, i: int) -> torch.Tensor:
        """Piece i's region of the flat buffer, shaped like the piece."""
        assert self.buffer is not None
        piece = self.spec.pieces[i]
        return self.buffer[self.offsets[i] : self.offsets[i] + piece.numel].view(piece.shape)

    def is_view(self, i: int) -> bool:
        """Whole parameters live in the buffer (``.grad`` is a view of it); slices of a
        narrowed parameter cannot, they are copied in at launch and out at the end."""
        return self.locs[i].is_whole


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
    reductions: int = 0  # backward passes whose gradients were averaged (not under no_sync)
    # backward masking: parameter values sent from owners to non-holders (see runtime.refresh)
    last_refresh_bytes: int = 0
    total_refresh_bytes: int = 0
    collective: str = "all_reduce"  # "fsdp": all-gathers + reduce-scatters (runtime.fsdp)


class HolderReducer:
    """Averages each held parameter's gradient over its holders (see the Note above)."""

    def __init__(
        self,
        params: Mapping[str, nn.Parameter],
        local: Mapping[str, Sequence[LocalPiece]],
        order: Sequence[Piece],
        plan: Plan,
        *,
        rank: int,
        groups: HolderGroups,
        bucket_cap_bytes: int = 25 * 2**20,
        external: Sequence[nn.Parameter] = (),
        zero: int = 0,
    ) -> None:
        """``params``: this rank's trainable tensors by local name; ``local``: where their
        pieces sit (``subnet.pieces.local_pieces``), same keys; ``order``: the full model's
        parameter pieces in reduction order, identical on every rank. Gradients of
        ``external`` parameters are not produced by autograd but filled by their owner (the
        wrapper), which then calls ``mark_ready``. ``zero``: 1 or 2 reduce-scatters each
        bucket over its holders (module doc); 0 all-reduces."""
        self.rank, self.zero = rank, zero
        self.stats = CommStats(collective=ZERO_COLLECTIVE if zero else "all_reduce")
        self.buckets: list[_Bucket] = []
        where = {lp.piece.name: (key, lp) for key, lps in local.items() for lp in lps}
        self.specs = global_buckets(order, plan, bucket_cap_bytes=bucket_cap_bytes)
        for spec in self.specs:
            if rank not in spec.holders or (len(spec.holders) < 2 and not zero):
                continue  # not ours, or held alone: nothing to average
            missing = [n for n in spec.names if n not in where]
            if missing:
                raise RuntimeError(f"rank {rank} holds {spec.holders} but lacks {missing[:3]}")
            locs = [where[n][1] for n in spec.names]
            offsets = [0]
            for piece in spec.pieces[:-1]:
                offsets.append(offsets[-1] + piece.numel)
            ps = [params[where[n][0]] for n in spec.names]
            c = len(spec.holders)
            group = groups.group(spec.holders) if c > 1 else None
            bucket = _Bucket(spec, ps, locs, group, offsets)
            if zero:
                size = math.ceil(spec.numel / c)
                bucket.shard = ZeroShard(c, spec.holders.index(rank), size)
                if zero == 2:
                    bucket.shard.grad = torch.zeros(size, dtype=ps[0].dtype,
                                                    device=ps[0].device)
            self.buckets.append(bucket)
        # A narrowed parameter has pieces in several buckets: its hook marks all of them.
        members: dict[int, tuple[nn.Parameter, list[tuple[_Bucket, int]]]] = {}
        for b in self.buckets:
            for i, p in enumerate(b.params):
                members.setdefault(id(p), (p, []))[1].append((b, i))
        external_ids = {id(p) for p in external}
        self._entries = {pid: entries for pid, (_, entries) in members.items()}
        # [Note: hooks hold their owner weakly] A parameter keeps its hooks in C++, where
        # gc cannot follow them: a hook holding the reducer would keep the reducer, its
        # buckets and every parameter alive forever (parameter -> hook -> reducer ->
        # parameter). It holds a weak reference, and the reducer's end removes the hooks.
        me = weakref.ref(self)
        handles = [p.register_post_accumulate_grad_hook(_ready_hook(me, pid))
                   for pid, (p, _) in members.items()
                   if p.requires_grad and pid not in external_ids]
        weakref.finalize(self, _remove_all, handles)
        self.enabled = True  # False inside no_sync(): gradients just accumulate locally
        self._in_backward = False
        self._next = 0
        self._pending = 0  # pieces still awaited in this backward, over all buckets
        # ZeRO-2: buckets each parameter's gradient still has to be copied into, and the
        # launched buckets whose reduce-scatter may still be running
        self._copies_left: dict[int, int] = {}
        self._in_flight: deque[_Bucket] = deque()
        capped = [b.shard.padded for b in self.buckets
                  if b.shard is not None and b.nbytes <= bucket_cap_bytes]
        self.pool = BufferPool(max(capped, default=0)) if zero == 2 else None

    # -- before forward -------------------------------------------------------------------
    def attach_grad_views(self) -> None:
        """Point every whole parameter's ``.grad`` at its bucket slot so backward accumulates
        straight into the buffer (not under ZeRO-2: its full buffers are short-lived)."""
        if self.zero == 2:
            return
        for b in self.buckets:
            b.ensure_buffer()
            for i, p in enumerate(b.params):
                if p.grad is None and b.is_view(i):
                    view = b.slot(i)
                    view.zero_()
                    p.grad = view

    # -- during backward ------------------------------------------------------------------
    def mark_ready(self, p: nn.Parameter) -> None:
        """An external parameter's gradient is complete for this backward."""
        if id(p) in self._entries:
            self.ready(id(p))

    def ready(self, pid: int) -> None:
        """The gradient of the parameter with id ``pid`` is complete: mark its pieces, and
        launch the buckets this completes."""
        if not self.enabled:
            return
        if not self._in_backward:
            self._start_backward()
        complete = False
        for bucket, i in self._entries[pid]:
            if not bucket.ready[i]:
                bucket.ready[i] = True
                bucket.pending -= 1
                self._pending -= 1
                complete |= bucket.pending == 0
        if complete:
            launched = self._launch_ready()
            if self._pending > 0:
                self.stats.last_step_overlapped += launched

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
        if self.zero == 2:
            self._copies_left = {}
            for b in self.buckets:
                for p in b.params:
                    self._copies_left[id(p)] = self._copies_left.get(id(p), 0) + 1
        torch.autograd.Variable._execution_engine.queue_callback(self._finish)

    def _launch_ready(self) -> int:
        """Launch, in global order, every bucket whose gradients are all ready; return the
        number of collectives issued."""
        issued = 0
        while self._next < len(self.buckets) and self.buckets[self._next].pending == 0:
            issued += self._launch(self.buckets[self._next])
            self._next += 1
        return issued

    def _launch(self, b: _Bucket) -> bool:
        b.ensure_buffer(self.pool)
        for i, p in enumerate(b.params):
            slot = b.slot(i)
            g = p.grad
            if g is None:  # unused in this forward: contributes zero
                slot.zero_()
            elif not b.is_view(i):
                slot.copy_(b.locs[i].view(g))
            elif g.data_ptr() != slot.data_ptr():
                slot.copy_(g)
        c = len(b.spec.holders)
        if b.shard is None:
            b.work = dist.all_reduce(b.buffer, group=b.group, async_op=True)
        else:
            self._launch_shard(b)
        if c < 2:  # ZeRO's buckets held alone: nothing moves
            return False
        # ZeRO's reduce-scatter and all-gather send what the all-reduce sends (counted here)
        st = self.stats
        st.last_step_bytes += b.nbytes
        st.last_step_ring_bytes += 2 * (c - 1) / c * b.nbytes
        st.last_step_collectives += 1
        st.total_bytes += b.nbytes
        st.by_group[b.spec.holders] = st.by_group.get(b.spec.holders, 0) + b.nbytes
        return True

    def _launch_shard(self, b: _Bucket) -> None:
        """ZeRO: reduce-scatter the bucket into this rank's shard gradient."""
        assert b.shard is not None and b.buffer is not None
        grad = b.shard.own_grad()
        if b.shard.c > 1:
            b.work = reduce_scatter_single(grad, b.buffer, group=b.group, async_op=True)
        elif self.zero == 2:  # held alone (ZeRO-1's shard is then its whole buffer)
            grad.copy_(b.buffer)
        if self.zero != 2:
            return
        for p in b.params:  # the full gradient is in the buffer now: free it once copied
            self._copies_left[id(p)] -= 1
            if self._copies_left[id(p)] == 0:
                p.grad = None
        self._in_flight.append(b)
        while len(self._in_flight) > ZERO2_IN_FLIGHT:
            self._settle(self._in_flight.popleft())

    def _settle(self, b: _Bucket) -> None:
        """ZeRO: wait for the bucket's reduce-scatter and average its shard; under ZeRO-2 the
        full buffer goes."""
        assert b.shard is not None
        if b.work is not None:
            b.work.wait()
            b.work = None
        b.shard.own_grad().div_(b.shard.c)
        if self.pool is not None and b.buffer is not None:  # ZeRO-2
            self.pool.give(b.buffer)
            b.buffer = None

    def _finish(self) -> None:
        faults.point("reduce")  # a testing hook, ignored unless set (distributed/faults.py)
        # Buckets still pending had parameters that received no gradient this backward.
        for b in self.buckets[self._next :]:
            self._launch(b)
        self._next = len(self.buckets)
        if self.zero:
            self._finish_shards()
            return
        for b in self.buckets:
            assert b.work is not None and b.buffer is not None
            b.work.wait()
            b.work = None
            b.buffer.div_(len(b.spec.holders))
            for i, p in enumerate(b.params):
                if b.is_view(i):
                    p.grad = b.slot(i)
                    continue
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                b.locs[i].view(p.grad).copy_(b.slot(i))
        self._in_backward = False
        self.stats.reductions += 1

    def _finish_shards(self) -> None:
        while self._in_flight:
            self._settle(self._in_flight.popleft())
        for b in self.buckets:
            if self.zero == 1:
                self._settle(b)
            for p in b.params:  # ZeRO-1: unreduced; the optimizer sees only the shards
                p.grad = None
        self._in_backward = False
        self.stats.reductions += 1
