"""Backward masking's refresh: owners send their units' new values to the non-holders.

Under bb-sdp / nb-sdp every worker runs the full model forward, but only a unit's holders
update it. After an optimizer step each unit's new values go from its owner (lowest-ranked
holder) to every worker that does not hold it, so all full copies agree again. Holders need
nothing: they applied the same step to the same averaged gradient.

Traffic is point to point (no process group per receiver set): for each (owner, receiver)
pair, the owner packs every piece it owes that receiver, in the full model's piece order, into
one buffer, so both sides agree on the layout without exchanging it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist

from subnetdp.plan import Plan
from subnetdp.subnet.pieces import LocalPiece


class Refresher:
    """Sends and receives parameter pieces of units between owners and non-holders."""

    def __init__(
        self,
        params: Mapping[str, torch.Tensor],
        local: Mapping[str, Sequence[LocalPiece]],
        plan: Plan,
        *,
        rank: int,
    ) -> None:
        """``params``: this rank's full-size parameters; ``local``: their index map."""
        self.rank = rank
        self.sends: dict[int, list[torch.Tensor]] = {}
        self.recvs: dict[int, list[torch.Tensor]] = {}
        everyone = range(plan.world)
        for key, t in params.items():
            for lp in local[key]:
                u = lp.piece.unit
                if u is None or lp.piece.frozen:  # frozen: never changes, nothing to send
                    continue
                holders = set(plan.holders(u))
                owner = plan.owner(u)
                if rank == owner:
                    for dst in everyone:
                        if dst not in holders:
                            self.sends.setdefault(dst, []).append(lp.view(t))
                elif rank not in holders:
                    self.recvs.setdefault(owner, []).append(lp.view(t))

    @property
    def bytes_sent(self) -> int:
        return sum(v.numel() * v.element_size() for vs in self.sends.values() for v in vs)

    @property
    def bytes_received(self) -> int:
        return sum(v.numel() * v.element_size() for vs in self.recvs.values() for v in vs)

    @torch.no_grad()
    def refresh(self) -> int:
        """Exchange the pieces; returns the bytes this rank sent."""
        exchange(self.sends, self.recvs)
        return self.bytes_sent


@torch.no_grad()
def exchange(
    sends: Mapping[int, Sequence[torch.Tensor]],
    recvs: Mapping[int, Sequence[torch.Tensor]],
    wire_dtype: torch.dtype | None = None,
) -> None:
    """One batch of point-to-point transfers: to each peer, its tensors packed in order into
    one buffer; from each peer, one buffer unpacked into ``recvs[peer]`` (views, written in
    place). Both sides list the same shapes in the same order. ``wire_dtype``: the buffers'
    dtype (default: the tensors' own)."""
    ops, incoming = [], []
    for dst, tensors in sorted(sends.items()):
        if sum(t.numel() for t in tensors):
            dtype = wire_dtype or tensors[0].dtype
            buf = torch.cat([t.detach().reshape(-1).to(dtype) for t in tensors])
            ops.append(dist.P2POp(dist.isend, buf, dst))
    for src, views in sorted(recvs.items()):
        n = sum(v.numel() for v in views)
        if n:
            buf = torch.empty(n, dtype=wire_dtype or views[0].dtype, device=views[0].device)
            ops.append(dist.P2POp(dist.irecv, buf, src))
            incoming.append((buf, views))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    for buf, views in incoming:
        offset = 0
        for v in views:
            v.copy_(buf[offset : offset + v.numel()].view_as(v))
            offset += v.numel()
