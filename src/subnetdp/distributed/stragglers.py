"""A straggler watch: a rank slower than its peers, named in one line and never stopped for it.

[Note: stragglers]
A slow rank (thermal throttling, a noisy neighbour, a degraded link to its data) holds every
peer in the step's collectives: the run goes at its pace. It is stopped only when it keeps
them waiting past ``--collective-timeout`` (distributed/timeouts.py names it then). Before
that, this watch says which rank it is. A rank's *compute time* of a step runs from the
step's start to the end of its backward, before it waits for the holder groups' reductions
(``faults.reached``: the step's timeline): its peers' waiting for it falls after that point,
so each rank's figure is its own. At each log step the ranks exchange their mean over the
steps since the last one (one all-gather of ``world`` floats), and rank 0 names a rank whose
compute takes more than ``FACTOR`` times the median rank's and at least ``MIN_EXTRA_S``
longer: once when it becomes slow, once when it is no longer. A group's first
``WARMUP_STEPS`` steps are not timed. Off under ``--fsdp``, whose
forward waits for its all-gathers (a peer's wait would count as the rank's own), and for one
worker.
"""

from __future__ import annotations

import statistics

import torch

from subnetdp.distributed import faults
from subnetdp.torch_compat import all_gather_single

__all__ = ["FACTOR", "MIN_EXTRA_S", "StragglerWatch", "stragglers"]

FACTOR = 3.0
MIN_EXTRA_S = 0.5  # below this a slower rank is noise on a shared machine, not a straggler
WARMUP_STEPS = 2  # a group's first steps (allocations, a restarted rank's caches) are not timed


def stragglers(compute_s: list[float]) -> list[int]:
    """The ranks whose compute time is a straggler's ([Note: stragglers])."""
    median = statistics.median(compute_s)
    return [r for r, t in enumerate(compute_s)
            if t > FACTOR * median and t - median >= MIN_EXTRA_S]


class StragglerWatch:
    """Each step's compute time (``step_done``), exchanged at log steps (``exchange``, a
    collective: every rank calls it at the same steps)."""

    def __init__(self, rank: int, world: int, device: torch.device, *, start: int,
                 enabled: bool) -> None:
        self.rank, self.world, self.device, self.start = rank, world, device, start
        self.enabled = enabled and world > 1
        self.slow: list[int] = []
        self._sum, self._steps, self._first = 0.0, 0, 0

    def step_done(self, step: int) -> None:
        start, end = faults.reached("forward"), faults.reached("reduce")
        if not self.enabled or step <= self.start + WARMUP_STEPS or start is None or end is None:
            return
        self._first = self._first or step
        self._sum += end - start
        self._steps += 1

    def exchange(self, step: int) -> str | None:
        """The line rank 0 prints when the set of stragglers changed (None: no change, or
        another rank)."""
        if not self.enabled:
            return None
        mine = torch.tensor([self._sum / max(self._steps, 1)], dtype=torch.float64,
                            device=self.device)
        every = torch.empty(self.world, dtype=torch.float64, device=self.device)
        all_gather_single(every, mine)
        steps = f"steps {self._first}-{step}" if self._first < step else f"step {step}"
        timed = self._steps
        self._sum, self._steps, self._first = 0.0, 0, 0
        times = every.tolist()
        slow = stragglers(times) if timed else self.slow
        if slow == self.slow or self.rank != 0:
            self.slow = slow
            return None
        median = statistics.median(times)
        back = [r for r in self.slow if r not in slow]
        self.slow = slow
        if slow:
            return "; ".join(
                f"straggler: rank {r} took {times[r]:.2f} s a step to compute ({steps}), "
                f"{times[r] / median:.1f}x the median rank ({median:.2f} s); its peers wait "
                "for it (stopped only past --collective-timeout)" for r in slow)
        return f"straggler: rank(s) {back} back to the median rank's pace at {steps}"
