"""Local steps on holder groups: SDP x DiLoCo (``--sync-every H``).

[Note: local steps on holder groups]
DiLoCo (Douillard et al., 2023) lets each worker take H inner optimizer steps on its own data
with no gradient collective, then averages the *pseudo-gradient* d = w_sync - w (the weights at
the last sync minus now) and takes one outer step, Nesterov SGD (DiLoCo's lr 0.7, momentum 0.9):
    m <- mu * m + mean(d);   w_sync <- w_sync - lr * (mean(d) + mu * m);   w <- w_sync
which is ``torch.optim.SGD(nesterov=True)`` (its first buffer is mean(d), as m = 0 gives here).
Under SDP a worker holds only its subnetwork, so d of a piece of unit u is averaged over
holders(u) and shared pieces over the world, in the gradient reducer's holder groups and
bucket layout (``reducer.global_buckets``, issued in that one global order, so the deadlock
argument of [Note: holder averaging] holds). Every holder applies the same outer step to the
same w_sync, so holders are identical again after each sync, as after every SDP step; between
syncs they differ, and so do their inner optimizer states (each worker keeps its own, across
outer steps, as DiLoCo does). ``ddp`` with H > 1 is plain DiLoCo.

State. w_sync and m live in the *inner optimizer's* state of each trainable parameter
(``outer_anchor``, ``outer_momentum``, shaped like it), so checkpoints, ``--reshard``, elastic
shrink and rescue carry them exactly as they carry ``exp_avg``. They are put there after the
parameter's first inner update (an optimizer initialises a parameter's state only when it finds
it empty). The position in the window is the step itself. Holders differ mid-window, so a
checkpoint of such a run also keeps every rank's own copies (``Checkpointer(holders_differ=)``).

Streaming (``fragments`` F, Streaming DiLoCo): the pieces in reduction order are cut into F
runs of about equal bytes; fragment f syncs at the steps s with s = (f + 1) * H / F (mod H), so
the links carry a 1/F share every H/F steps instead of everything every H steps.

The last step of a run syncs every fragment, whatever the window: the model a run ends with
(evaluated, exported, resumed with more ``--steps``) is then its holders' common one.

Bytes are counted per collective into the rank's ``CommStats`` as the reducer counts its
buckets, at the wire dtype (``dtype``: the parameters' own, or bf16 for mean(d); the outer step
itself runs in the parameters' dtype).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from subnetdp.plan import Plan
from subnetdp.runtime.groups import HolderGroups
from subnetdp.runtime.reducer import BucketSpec, CommStats, global_buckets
from subnetdp.subnet.pieces import LocalPiece, Piece

ANCHOR, MOMENTUM = "outer_anchor", "outer_momentum"  # names in the inner optimizer's state


@dataclass(frozen=True)
class SyncLayout:
    """What an outer step averages (``RankModel.sync_layout``): this rank's trainable tensors
    by name, where their pieces sit (same keys), the full model's reduced pieces in reduction
    order (identical on every rank) and the holder groups."""

    params: Mapping[str, nn.Parameter]
    local: Mapping[str, Sequence[LocalPiece]]
    order: Sequence[Piece]
    groups: HolderGroups


@dataclass
class _Bucket:
    spec: BucketSpec
    views: list[tuple[nn.Parameter, LocalPiece]]  # this rank's tensor of each piece, and where
    group: dist.ProcessGroup | None

    @property
    def holders(self) -> int:
        return len(self.spec.holders)


def fragments_of(order: Sequence[Piece], fragments: int) -> list[list[Piece]]:
    """``order`` cut into ``fragments`` consecutive runs of about equal bytes (a piece goes
    where its middle byte falls; a piece larger than a share leaves a fragment empty)."""
    total = max(1, sum(p.numel * p.dtype.itemsize for p in order))
    out: list[list[Piece]] = [[] for _ in range(fragments)]
    seen = 0
    for p in order:
        nbytes = p.numel * p.dtype.itemsize
        out[min(fragments - 1, (2 * seen + nbytes) * fragments // (2 * total))].append(p)
        seen += nbytes
    return out


def due_fragments(step: int, every: int, fragments: int) -> list[int]:
    """The fragments whose outer step follows inner step ``step`` (counted from 1)."""
    return [f for f in range(fragments) if step % every == (f + 1) * every // fragments % every]


class LocalSteps:
    """Runs the outer loop of one rank (see the Note above). Use ``inner(model)`` around
    forward and backward (no gradient collective), ``clip`` for this rank's own gradient norm,
    and ``after_step()`` after every inner optimizer step."""

    def __init__(
        self, layout: SyncLayout, plan: Plan, opt: torch.optim.Optimizer, stats: CommStats, *,
        rank: int, every: int, start: int = 0, end: int | None = None, lr: float = 0.7,
        momentum: float = 0.9,
        dtype: torch.dtype | None = None, fragments: int = 1,
        bucket_cap_bytes: int = 25 * 2**20,
    ) -> None:
        """``every``: H; ``start``: inner steps already taken (a resume); ``end``: the run's
        last step (it syncs everything; None: none is last); ``dtype``: the wire
        dtype of the averaged pseudo-gradient (None: the parameters'); ``fragments``: F, a
        divisor of H."""
        if every < 1 or fragments < 1 or every % fragments:
            raise ValueError(f"the sync window ({every} steps) must be >= 1 and a multiple of "
                             f"the fragments ({fragments})")
        self.opt, self.stats, self.step, self.end = opt, stats, start, end
        self.every, self.lr, self.momentum, self.dtype = every, lr, momentum, dtype
        where = {lp.piece.name: (p, lp) for key, p in layout.params.items()
                 for lp in layout.local[key]}
        self.fragments: list[list[_Bucket]] = []
        for pieces in fragments_of(layout.order, fragments):
            specs = global_buckets(pieces, plan, bucket_cap_bytes=bucket_cap_bytes)
            self.fragments.append([
                _Bucket(s, [where[n] for n in s.names],
                        layout.groups.group(s.holders) if len(s.holders) > 1 else None)
                for s in specs if rank in s.holders])
        self.params = list({id(p): p for p in layout.params.values()}.values())
        # the weights at the last sync, until the optimizer has state to keep them in
        self._pending = {id(p): (p.detach().clone(), torch.zeros_like(p))
                         for p in self.params if ANCHOR not in opt.state.get(p, {})}

    @contextmanager
    def inner(self, model: nn.Module) -> Iterator[None]:
        """Forward and backward of an inner step: gradients stay local (``no_sync``)."""
        with model.no_sync():  # type: ignore[operator]
            yield

    def clip(self, max_norm: float) -> torch.Tensor:
        """Clip this rank's own gradient (an inner step is local: no collective)."""
        return torch.nn.utils.clip_grad_norm_(self.params, max_norm)

    def _state(self, p: nn.Parameter) -> tuple[torch.Tensor, torch.Tensor]:
        if id(p) in self._pending:
            return self._pending[id(p)]
        state = self.opt.state[p]
        return state[ANCHOR], state[MOMENTUM]

    def after_step(self) -> list[int]:
        """After an inner optimizer step: the outer step of every fragment due now. Returns
        those fragments."""
        self.step += 1
        for p in self.params:
            state = self.opt.state.get(p)
            if state and id(p) in self._pending:  # the optimizer has state now: keep ours in it
                state[ANCHOR], state[MOMENTUM] = self._pending.pop(id(p))
        st = self.stats
        st.last_step_bytes, st.last_step_ring_bytes, st.last_step_collectives = 0, 0.0, 0
        due = (list(range(len(self.fragments))) if self.step == self.end else
               due_fragments(self.step, self.every, len(self.fragments)))
        for f in due:
            for b in self.fragments[f]:  # in global order on every rank
                self._outer_step(b)
        if due:
            st.reductions += 1  # a sync: backward masking refreshes non-holders after it
        return due

    @torch.no_grad()
    def _outer_step(self, b: _Bucket) -> None:
        slots = [(lp.view(p), *(lp.view(t) for t in self._state(p))) for p, lp in b.views]
        flat = torch.cat([(a - w).reshape(-1) for w, a, _ in slots])
        if self.dtype is not None:
            flat = flat.to(self.dtype)
        if b.holders > 1:
            dist.all_reduce(flat, group=b.group)
            flat.div_(b.holders)
            self._count(b, flat.numel() * flat.element_size())
        offset = 0
        for w, a, m in slots:
            g = flat[offset : offset + w.numel()].view(w.shape).to(a.dtype)
            offset += w.numel()
            m.mul_(self.momentum).add_(g)
            a.add_(g.add(m, alpha=self.momentum), alpha=-self.lr)
            w.copy_(a)

    def _count(self, b: _Bucket, nbytes: int) -> None:
        st, c = self.stats, b.holders
        st.last_step_bytes += nbytes
        st.last_step_ring_bytes += 2 * (c - 1) / c * nbytes
        st.last_step_collectives += 1
        st.total_bytes += nbytes
        st.by_group[b.spec.holders] = st.by_group.get(b.spec.holders, 0) + nbytes
