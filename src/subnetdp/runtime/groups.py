"""One process group per distinct holder set, created once, in the same order on every rank."""

from __future__ import annotations

from collections.abc import Sequence

import torch.distributed as dist
from torch.distributed import ProcessGroup


class HolderGroups:
    """Maps a holder set (sorted tuple of ranks) to the process group spanning it.

    ``dist.new_group`` is collective over the whole world: every rank must call it for every
    group, members or not, in one order. We walk the holder sets in a fixed order (the plan's
    order of first appearance) so all ranks agree. Sets of one rank need no group (nothing to
    average), and the full set reuses the default group. Each group costs a communicator (on
    GPUs, memory), which is why plan schemes keep the number of distinct holder sets small.
    """

    def __init__(
        self, holder_sets: Sequence[tuple[int, ...]], *, world: int, singletons: bool = False
    ) -> None:
        """``singletons``: also make groups for one-rank sets (FSDP needs a mesh even there)."""
        self.world = world
        self._everyone = tuple(range(world))
        self._groups: dict[tuple[int, ...], ProcessGroup | None] = {}
        self.created = 0  # new communicators made here (the default group is not counted)
        for ranks in holder_sets:
            ranks = tuple(sorted(ranks))
            if ranks in self._groups or len(ranks) < (1 if singletons else 2):
                continue
            if ranks == self._everyone:
                self._groups[ranks] = None  # default (world) group
                continue
            self._groups[ranks] = dist.new_group(list(ranks))
            self.created += 1

    def group(self, ranks: tuple[int, ...]) -> ProcessGroup | None:
        """The group for ``ranks`` (``None`` means the default group)."""
        if ranks == self._everyone:
            return None
        try:
            return self._groups[ranks]
        except KeyError:
            raise KeyError(f"no process group was created for holder set {ranks}") from None

    def __len__(self) -> int:
        return len(self._groups)
