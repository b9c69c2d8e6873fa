"""ZeRO-1/2 inside holder groups: the optimizer's side (the reducer's is in ``runtime.reducer``).

[Note: ZeRO in holder groups]
Every holder of a unit applies the same step to the same averaged gradient ([Note: holder
averaging]), so each of the c holders of a bucket may as well compute only one c-th of it:
the reducer reduce-scatters the bucket over its holders instead of all-reducing it, holder k
keeps the optimizer state of slice k only, updates it, and the updated slices are all-gathered
back into every holder's parameters after ``optimizer.step()``. A ring reduce-scatter and a
ring all-gather each send (c - 1)/c of the bucket per rank, together exactly what the ring
all-reduce sends, so the optimizer state (ZeRO-1) and the reduced gradient (ZeRO-2) shrink c
times at the same traffic. Shared parameters are held by everyone: sharded over the world.

The optimizer works on *segments*, one per piece cut by the rank's slice: leaf parameters
that are flat views of the piece's own parameter (so ``step()`` updates the slice in place and
no copy of it exists), or, where the piece is not contiguous (a narrowed layer's neuron group),
a ``master`` copy refreshed from the parameter before each step (a checkpoint load, or any
write to the parameters, is seen). Each segment sits in its parameter's group, so per-group
hyperparameters such as weight decay apply exactly as without ZeRO; its ``.grad`` is a view of
the reduced shard. After the step each bucket's slices are all-gathered in place into a full
buffer (ZeRO-1: the gradient buffer, spent by then) and copied into the parameters, bucket by
bucket in the reducer's global order (the same on every rank, so groups that share ranks never
cross).

Checkpoints keep the plain per-parameter layout (``plain_state``/``load_plain_state``), so a
checkpoint moves freely between runs with and without ZeRO.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from subnetdp.runtime.reducer import ZERO2_IN_FLIGHT, HolderReducer, _Bucket
from subnetdp.torch_compat import all_gather_single


@dataclass
class _Segment:
    """What the optimizer trains of one piece in this rank's slice: a flat view of the
    parameter itself when the piece is a whole contiguous tensor (updated in place), else a
    ``master`` copy of the run (a narrowed layer's piece is not contiguous)."""

    param: nn.Parameter
    piece: int  # index into the bucket's pieces
    group: int | None  # its parameter group (None: not given to the optimizer)
    start: int  # bucket coordinates (flat, unpadded) of the run
    stop: int
    master: bool


class _Shard:
    """One bucket's slice on this rank: its segments, one per piece it cuts."""

    def __init__(self, bucket: _Bucket, group_of: Mapping[int, int]) -> None:
        assert bucket.shard is not None
        self.bucket, self.info = bucket, bucket.shard
        lo = self.info.start
        hi = min(lo + self.info.size, bucket.spec.numel)
        self.segments: list[_Segment] = []
        for i, piece in enumerate(bucket.spec.pieces):
            off = bucket.offsets[i]
            a, z = max(off, lo), min(off + piece.numel, hi)
            if a >= z:
                continue
            p = bucket.params[i]
            flat = bucket.locs[i].is_whole and p.is_contiguous()
            data = (p.detach().view(-1)[a - off : z - off] if flat
                    else torch.zeros(z - a, dtype=p.dtype, device=p.device))
            self.segments.append(_Segment(nn.Parameter(data), i, group_of.get(id(p)), a, z,
                                          master=not flat))
        self.load_masters()

    def piece_flat(self, i: int) -> torch.Tensor:
        """Piece i of the bucket's parameters, flat (a copy when it is not contiguous)."""
        b = self.bucket
        return b.locs[i].view(b.params[i].detach()).reshape(-1)

    @torch.no_grad()
    def load_masters(self) -> None:
        for s in self.segments:
            if s.master:
                off = self.bucket.offsets[s.piece]
                s.param.copy_(self.piece_flat(s.piece)[s.start - off : s.stop - off])

    def attach_grads(self) -> None:
        lo, grad = self.info.start, self.info.own_grad()
        for s in self.segments:
            s.param.grad = grad[s.start - lo : s.stop - lo]

    @torch.no_grad()
    def fill(self, part: torch.Tensor, key: str | None = None,
             state: Mapping[Any, Mapping[str, torch.Tensor]] | None = None) -> None:
        """Write this rank's slice into ``part`` (flat, padded): the segments' values, or with
        ``key`` their optimizer state ``state[segment][key]`` (zero where there is none)."""
        lo = self.info.start
        for s in self.segments:
            dst = part[s.start - lo : s.stop - lo]
            if key is None:
                dst.copy_(s.param.detach())
            elif state is not None and (v := state.get(s.param, {}).get(key)) is not None:
                dst.copy_(v)
            else:
                dst.zero_()

    @torch.no_grad()
    def scatter_full(self, full: torch.Tensor, into: Mapping[int, torch.Tensor]) -> None:
        """Copy the bucket's full flat ``full`` into ``into[i]`` (tensors shaped like piece i's
        parameter) for every piece i."""
        b = self.bucket
        for i, piece in enumerate(b.spec.pieces):
            off = b.offsets[i]
            b.locs[i].view(into[i]).copy_(full[off : off + piece.numel].view(piece.shape))


class ZeroOptimizer:
    """The sharded side of one optimizer built by ``SubnetDataParallel.optimizer`` under
    ``zero`` (see the Note above): segments, step hooks, and the plain view for checkpoints."""

    def __init__(self, reducer: HolderReducer, optimizer_class: type[torch.optim.Optimizer],
                 params: Iterable[Any], defaults: Mapping[str, Any]) -> None:
        groups = _as_groups(params)
        known = {id(p) for b in reducer.buckets for p in b.params}
        group_of: dict[int, int] = {}
        for g, group in enumerate(groups):
            for p in group["params"]:
                if id(p) not in known:
                    raise ValueError("with zero, the optimizer's parameters must come from "
                                     "model.parameters() (the wrapper's trainable parameters)")
                group_of[id(p)] = g
        self.reducer = reducer
        self.param_groups = [list(group["params"]) for group in groups]
        self.shards = [_Shard(b, group_of) for b in reducer.buckets]
        segs = [s for sh in self.shards for s in sh.segments]
        self.optimizer = optimizer_class(
            [{**{k: v for k, v in group.items() if k != "params"},
              "params": [s.param for s in segs if s.group == g]}
             for g, group in enumerate(groups)], **defaults)
        self.optimizer._subnetdp_zero = self  # type: ignore[attr-defined]
        self._seen = reducer.stats.reductions
        self.optimizer.register_step_pre_hook(lambda *_: self._before_step())
        self.optimizer.register_step_post_hook(lambda *_: self._after_step())

    def master_params(self) -> list[nn.Parameter]:
        """Segments with storage of their own (the others are views of the parameters)."""
        return [s.param for sh in self.shards for s in sh.segments if s.master]

    def _before_step(self) -> None:
        if self.reducer.stats.reductions > self._seen:  # fresh shard gradients since the last
            self._seen = self.reducer.stats.reductions
            for sh in self.shards:
                sh.attach_grads()
        for sh in self.shards:  # the parameters may have been written (a checkpoint load)
            sh.load_masters()

    @torch.no_grad()
    def _after_step(self) -> None:
        """All-gather every bucket's updated slice into the parameters, in global order, in
        place in a full-size buffer: ZeRO-1's gradient buffer (its content is spent; all
        launched at once), under ZeRO-2 a fresh one, at most ``ZERO2_IN_FLIGHT`` at a time."""
        pending: deque[tuple[_Shard, torch.Tensor, Any]] = deque()
        window = ZERO2_IN_FLIGHT if self.reducer.zero == 2 else len(self.shards)
        for sh in self.shards:
            pending.append((sh, *self._gather(sh, reuse=True)))
            while len(pending) > window:
                self._write_back(*pending.popleft())
        while pending:
            self._write_back(*pending.popleft())
        if self.reducer.zero == 1:  # the shard gradients were slices of what now holds values
            for s in (s for sh in self.shards for s in sh.segments):
                s.param.grad = None

    def _gather(self, sh: _Shard, *, reuse: bool,
                key: str | None = None) -> tuple[torch.Tensor, Any]:
        """The bucket's full (padded) flat values (or optimizer state ``key``, see
        ``_Shard.fill``) on every holder, and the all-gather's work (None when held alone)."""
        b, info = sh.bucket, sh.info
        buf, pool = b.buffer, self.reducer.pool
        if reuse and buf is not None and buf.numel() == info.padded:
            full = buf
        elif reuse and pool is not None:  # ZeRO-2; stale padding is never copied out
            full = pool.take(info.padded, b.params[0])
        else:
            full = b.params[0].new_zeros(info.padded)
        part = full[info.start : info.start + info.size]
        sh.fill(part, key, self.optimizer.state)
        if info.c == 1:
            return full, None
        work = all_gather_single(full, part, group=b.group, async_op=True)
        return full, work

    def _write_back(self, sh: _Shard, full: torch.Tensor, work: Any) -> None:
        if work is not None:
            work.wait()
        b = sh.bucket
        sh.scatter_full(full, {i: p.data for i, p in enumerate(b.params)})
        if self.reducer.pool is not None and full is not b.buffer:
            self.reducer.pool.give(full)

    def grads(self) -> list[torch.Tensor]:
        """The reduced shard gradients (padding zero): what clipping scales and counts."""
        return [sh.info.own_grad() for sh in self.shards]

    # -- the plain per-parameter view (checkpoints) ----------------------------------------
    def _state_keys(self) -> tuple[list[str], dict[str, torch.Tensor]]:
        """State shaped like the parameter, and scalar state (``step``), agreed by all ranks
        (a rank may have no segment of its own). Collective over the world."""
        like: set[str] = set()
        scalar: dict[str, torch.Tensor] = {}
        for s in (s for sh in self.shards for s in sh.segments):
            for k, v in self.optimizer.state.get(s.param, {}).items():
                if torch.is_tensor(v) and v.ndim > 0 and v.shape == s.param.shape:
                    like.add(k)
                elif k not in scalar:
                    scalar[k] = torch.as_tensor(v).detach().cpu().clone()
        views: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(views, (sorted(like), scalar))
        keys = sorted({k for ks, _ in views for k in ks})
        scalars: dict[str, torch.Tensor] = {}
        for _, sc in views:
            for k, v in sc.items():
                scalars.setdefault(k, v)
        return keys, scalars

    def plain_state(self) -> dict[nn.Parameter, dict[str, torch.Tensor]]:
        """Every trained parameter's optimizer state whole, as a plain optimizer would hold it
        (each bucket's slices all-gathered over its holders). Collective."""
        keys, scalars = self._state_keys()
        out: dict[nn.Parameter, dict[str, torch.Tensor]] = {}
        trained = {id(p) for group in self.param_groups for p in group}
        for sh in self.shards:
            b = sh.bucket
            for k in keys:
                full, work = self._gather(sh, reuse=False, key=k)
                if work is not None:
                    work.wait()
                into = {}
                for i, p in enumerate(b.params):
                    if id(p) in trained:
                        into[i] = out.setdefault(p, {}).setdefault(
                            k, torch.zeros_like(p, memory_format=torch.contiguous_format))
                    else:
                        into[i] = torch.empty_like(p)  # not trained: dropped
                sh.scatter_full(full, into)
        for p in out:
            out[p].update({k: v.clone() for k, v in scalars.items()})
        return out

    @torch.no_grad()
    def load_plain_state(self, state: Mapping[nn.Parameter, Mapping[str, torch.Tensor]]) -> None:
        """The inverse of ``plain_state`` (no communication: every holder has it all)."""
        for sh in self.shards:
            b = sh.bucket
            for s in sh.segments:
                p, off = b.params[s.piece], b.offsets[s.piece]
                entries: dict[str, torch.Tensor] = {}
                for k, v in state.get(p, {}).items():
                    if torch.is_tensor(v) and v.ndim > 0 and v.shape == p.shape:
                        flat = b.locs[s.piece].view(v).reshape(-1)
                        entries[k] = flat[s.start - off : s.stop - off].clone()
                    else:
                        entries[k] = torch.as_tensor(v).clone()
                if entries:
                    self.optimizer.state[s.param] = entries


def zero_of(opt: torch.optim.Optimizer) -> ZeroOptimizer | None:
    """The ZeRO side of an optimizer built by ``SubnetDataParallel.optimizer``, if any."""
    return getattr(opt, "_subnetdp_zero", None)


def _as_groups(params: Iterable[Any]) -> list[dict[str, Any]]:
    items = list(params)
    if items and isinstance(items[0], dict):
        return [{**g, "params": list(g["params"])} for g in items]
    return [{"params": items}]
