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

The optimizer works on *segments*: leaf parameters that are views of a flat ``master`` copy of
the rank's slice, one per run of consecutive pieces in one parameter group (so per-group
hyperparameters such as weight decay apply exactly as without ZeRO); their ``.grad`` are views
of the reduced shard. Before each step the master is refreshed from the parameters (so a
checkpoint load, or any write to the parameters, is seen); after it the masters are
all-gathered into the parameters, bucket by bucket in the reducer's global order (the same
order on every rank, so groups that share ranks never cross).

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


@dataclass
class _Segment:
    param: nn.Parameter  # what the optimizer trains: a view of its bucket's master
    group: int  # its parameter group
    start: int  # bucket coordinates (flat, unpadded)
    stop: int


@dataclass
class _Run:
    piece: int  # index into the bucket's pieces
    start: int  # bucket coordinates of the part of the piece in this rank's slice
    stop: int


class _Shard:
    """One bucket's slice on this rank: master values, segments, and the pieces it cuts."""

    def __init__(self, bucket: _Bucket, group_of: Mapping[int, int]) -> None:
        assert bucket.shard is not None
        self.bucket, self.info = bucket, bucket.shard
        p0 = bucket.params[0]
        self.master = torch.zeros(self.info.size, dtype=p0.dtype, device=p0.device)
        lo = self.info.start
        hi = min(lo + self.info.size, bucket.spec.numel)
        self.runs: list[_Run] = []
        self.segments: list[_Segment] = []
        for i, piece in enumerate(bucket.spec.pieces):
            off = bucket.offsets[i]
            a, z = max(off, lo), min(off + piece.numel, hi)
            if a >= z:
                continue
            self.runs.append(_Run(i, a, z))
            g = group_of.get(id(bucket.params[i]))
            if g is None:
                continue  # not given to the optimizer: never updated
            last = self.segments[-1] if self.segments else None
            if last is not None and last.group == g and last.stop == a:
                last.stop = z
            else:
                self.segments.append(_Segment(nn.Parameter(torch.empty(0)), g, a, z))
        for s in self.segments:
            s.param = nn.Parameter(self.master[s.start - lo : s.stop - lo])

    def piece_flat(self, i: int) -> torch.Tensor:
        """Piece i of the bucket's parameters, flat (a copy when it is not contiguous)."""
        b = self.bucket
        return b.locs[i].view(b.params[i].detach()).reshape(-1)

    @torch.no_grad()
    def load_master(self) -> None:
        lo = self.info.start
        for r in self.runs:
            off = self.bucket.offsets[r.piece]
            self.master[r.start - lo : r.stop - lo].copy_(
                self.piece_flat(r.piece)[r.start - off : r.stop - off])

    def attach_grads(self) -> None:
        lo = self.info.start
        for s in self.segments:
            s.param.grad = self.info.grad[s.start - lo : s.stop - lo]

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
        self.param_groups = [[p for p in group["params"]] for group in groups]
        self.shards = [_Shard(b, group_of) for b in reducer.buckets]
        for sh in self.shards:
            sh.load_master()
        segs = [s for sh in self.shards for s in sh.segments]
        self.optimizer = optimizer_class(
            [{**{k: v for k, v in group.items() if k != "params"},
              "params": [s.param for s in segs if s.group == g]}
             for g, group in enumerate(groups)], **defaults)
        self.optimizer._subnetdp_zero = self  # type: ignore[attr-defined]
        self._seen = reducer.stats.reductions
        self.optimizer.register_step_pre_hook(lambda *_: self._before_step())
        self.optimizer.register_step_post_hook(lambda *_: self._after_step())

    def segment_params(self) -> list[nn.Parameter]:
        return [s.param for sh in self.shards for s in sh.segments]

    def _before_step(self) -> None:
        if self.reducer.stats.reductions > self._seen:  # fresh shard gradients since the last
            self._seen = self.reducer.stats.reductions
            for sh in self.shards:
                sh.attach_grads()
        for sh in self.shards:
            sh.load_master()

    @torch.no_grad()
    def _after_step(self) -> None:
        """All-gather every bucket's updated slice into the parameters, in global order; at
        most ``ZERO2_IN_FLIGHT`` gather buffers exist at once unless ZeRO-1 keeps the full
        gradient buffers anyway (they are free between backwards: the output goes there)."""
        pending: deque[tuple[_Shard, torch.Tensor, Any]] = deque()
        for sh in self.shards:
            full, work = self._gather(sh, sh.master, reuse=True)
            pending.append((sh, full, work))
            while len(pending) > ZERO2_IN_FLIGHT:
                self._write_back(*pending.popleft())
        while pending:
            self._write_back(*pending.popleft())

    def _gather(self, sh: _Shard, part: torch.Tensor, *, reuse: bool) -> tuple[torch.Tensor, Any]:
        if sh.info.c == 1:
            return part, None
        buf = sh.bucket.buffer
        full = (buf if reuse and buf is not None and buf.numel() == sh.info.padded
                else part.new_empty(sh.info.padded))
        work = dist.all_gather_single(full, part, group=sh.bucket.group, async_op=True)
        return full, work

    @staticmethod
    def _write_back(sh: _Shard, full: torch.Tensor, work: Any) -> None:
        if work is not None:
            work.wait()
        b = sh.bucket
        sh.scatter_full(full, {i: p.data for i, p in enumerate(b.params)})

    def grads(self) -> list[torch.Tensor]:
        """The reduced shard gradients (padding zero): what clipping scales and counts."""
        return [sh.info.grad for sh in self.shards]

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
            b, lo = sh.bucket, sh.info.start
            for k in keys:
                part = torch.zeros_like(sh.master)
                for s in sh.segments:
                    v = self.optimizer.state.get(s.param, {}).get(k)
                    if v is not None:
                        part[s.start - lo : s.stop - lo].copy_(v)
                full, work = self._gather(sh, part, reuse=False)
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
        opt_state = self.optimizer.state
        for sh in self.shards:
            b = sh.bucket
            for s in sh.segments:
                entries: dict[str, torch.Tensor] = {}
                for r in sh.runs:
                    if r.stop <= s.start or r.start >= s.stop:
                        continue
                    p, off = b.params[r.piece], b.offsets[r.piece]
                    for k, v in state.get(p, {}).items():
                        if not (torch.is_tensor(v) and v.ndim > 0 and v.shape == p.shape):
                            entries.setdefault(k, v.clone())
                            continue
                        dst = entries.setdefault(k, torch.zeros_like(s.param))
                        flat = b.locs[r.piece].view(v).reshape(-1)
                        dst[r.start - s.start : r.stop - s.start].copy_(
                            flat[r.start - off : r.stop - off])
                opt_state[s.param] = entries


def zero_of(opt: torch.optim.Optimizer) -> ZeroOptimizer | None:
    """The ZeRO side of an optimizer built by ``SubnetDataParallel.optimizer``, if any."""
    return getattr(opt, "_subnetdp_zero", None)


def _as_groups(params: Iterable[Any]) -> list[dict[str, Any]]:
    items = list(params)
    if items and isinstance(items[0], dict):
        return [{**g, "params": list(g["params"])} for g in items]
    return [{"params": items}]
