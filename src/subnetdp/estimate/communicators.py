"""Device memory NCCL takes per communicator, which no tensor accounts for.

[Note: communicator memory]
NCCL allocates its own device buffers (outside torch's caching allocator, so
``torch.cuda.max_memory_allocated`` never shows them) for every peer a communicator connects,
per channel and per protocol. With NCCL's defaults:

- Simple protocol: ``NCCL_BUFFSIZE`` = 4 MiB per connection;
- LL128: 120 elements x 640 threads x 8 steps x 8 B = 4.6875 MiB;
- LL: 8 lines x 512 threads x 8 steps x 16 B = 0.5 MiB;
- a ring connects 2 peers per channel (receive from the previous rank, send to the next;
  trees reuse those connections) and NVLink/NVSwitch systems run up to
  ``NCCL_MAX_NCHANNELS`` = 32 channels;
- plus an allowance of 48 MiB for the proxy, work FIFO and device-side structures.

32 x 2 x (4 + 4.6875 + 0.5) MiB + 48 MiB = 636 MiB per communicator, within the 0.5-0.7 GB
per extra communicator reported on A100 (NVIDIA/nccl#964). It is deliberately the high end:
NCCL >= 2.22 connects lazily (``NCCL_RUNTIME_CONNECT``, only the protocols a run uses), fewer
channels run over PCIe or the network, and a communicator split from the world one with
``NCCL_COMM_SPLIT_SHARE_RESOURCES=1`` shares its parent's buffers. Where a cluster measures
less (``benchmarks/gpu_check.sh`` measures it per extra group), give that figure
(``--comm-mem-mb``); 0 leaves communicators out (a gloo run on CPUs).

``plan --memory-gb`` and ``train --memory-gb`` count them alike (``comm_mem_mb``): the value
given, else ``DEFAULT_COMM_MB`` where the collectives are NCCL's (``plan``, which plans for
GPUs; ``plan --cluster`` on GPUs; a ``train`` run on CUDA) and 0 where they are gloo's (a
``train`` run on CPUs, ``plan --cluster`` with ``gpu=cpu``: gloo allocates no device buffers).

Split communicators: the runtime creates the world communicator eagerly and every holder
group as an ``ncclCommSplit`` of it ([Note: split communicators] in
``distributed.process_group``). Whether a child shares its parent's buffers is NCCL's
``NCCL_COMM_SPLIT_SHARE_RESOURCES``, read from the workers' environment, which they inherit
from the launching shell: the estimate reads the same variable (``split_shared``), so its
default is what a run started from this environment does. Separate (the variable unset or
0): every communicator costs ``comm_mem_mb``. Shared (1): the world communicator costs
``comm_mem_mb`` and each child at most ``SHARED_CHILD_MB``: its peer buffers and proxy are
its parent's, what remains is the device-side work FIFO and structures, the 48 MiB allowance
(an upper bound, not measured here). ``communicator_bytes`` prices both.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass

MiB = 1 << 20


@dataclass(frozen=True)
class NcclBuffers:
    """NCCL's per-communicator buffers ([Note: communicator memory]); sizes in bytes."""

    channels: int = 32
    peers: int = 2
    simple: int = 4 * MiB
    ll128: int = 120 * 640 * 8 * 8
    ll: int = 8 * 512 * 8 * 16
    fixed: int = 48 * MiB

    def bytes(self) -> int:
        return self.channels * self.peers * (self.simple + self.ll128 + self.ll) + self.fixed


DEFAULT_COMM_MB = NcclBuffers().bytes() / MiB  # 636.0
# a child split from the world communicator with shared resources (module docstring)
SHARED_CHILD_MB = NcclBuffers().fixed / MiB  # 48.0
SPLIT_SHARE_VAR = "NCCL_COMM_SPLIT_SHARE_RESOURCES"


def split_shared(env: Mapping[str, str] = os.environ) -> bool:
    """Whether NCCL's split communicators share their parent's resources in workers started
    from ``env`` (NCCL's own reading of ``NCCL_COMM_SPLIT_SHARE_RESOURCES``: 1 shares)."""
    return env.get(SPLIT_SHARE_VAR, "0").strip() == "1"


def communicator_bytes(count: int, comm_mem_mb: float, *, shared: bool = False) -> int:
    """Device bytes of ``count`` communicators, the world's and ``count - 1`` split from it:
    ``comm_mem_mb`` MiB each, or with ``shared`` resources the world's and at most
    ``SHARED_CHILD_MB`` per child."""
    child = min(comm_mem_mb, SHARED_CHILD_MB) if shared else comm_mem_mb
    return round((min(count, 1) * comm_mem_mb + max(count - 1, 0) * child) * MiB)


def describe_communicators(backend: str, comm_mem_mb: float, shared: bool) -> str:
    """What an estimate assumed about communicator memory, for its printed assumptions."""
    if backend != "nccl":
        return f"{backend} ring collectives: no communicator memory"
    if comm_mem_mb == 0:
        return "NCCL ring collectives, communicators not counted (--comm-mem-mb 0)"
    # the default size is derived from NCCL's buffer settings, not measured: assumed
    mark = ", assumed" if comm_mem_mb == DEFAULT_COMM_MB else ""
    if not shared:
        return (f"NCCL ring collectives, {comm_mem_mb:g} MiB per communicator{mark} (holder "
                f"groups split from the world one with separate buffers: {SPLIT_SHARE_VAR} "
                "unset)")
    return (f"NCCL ring collectives, {comm_mem_mb:g} MiB for the world communicator{mark} + "
            f"{min(comm_mem_mb, SHARED_CHILD_MB):g} per holder group (an assumed upper bound; "
            f"{SPLIT_SHARE_VAR}=1: split with shared resources)")


def check_comm_mem_mb(mb: float) -> None:
    """``--comm-mem-mb`` as given: a finite number of MiB >= 0 (``ValueError`` otherwise)."""
    if not (math.isfinite(mb) and mb >= 0):
        raise ValueError(f"--comm-mem-mb must be >= 0 (0: communicators not counted), "
                         f"got {mb:g}")


def comm_mem_mb(given: float | None, *, nccl: bool) -> float:
    """MiB per communicator that a memory estimate counts ([Note: communicator memory]):
    ``given`` (checked) when there is one, else ``DEFAULT_COMM_MB`` when the collectives are
    NCCL's (``nccl``) and 0 when they are gloo's. ``plan`` and ``train`` both ask here."""
    if given is None:
        return DEFAULT_COMM_MB if nccl else 0.0
    check_comm_mem_mb(given)
    return float(given)
