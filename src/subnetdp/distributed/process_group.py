"""The process group inside a worker: ``init_distributed()`` creates the default group (gloo on
CPU, NCCL on CUDA) and returns ``(rank, world_size)``, under a launcher or as a one-process
group in a plain script; ``shutdown_distributed()`` destroys it.

[Note: split communicators]
On CUDA the default group is created with ``device_id`` (after ``torch.cuda.set_device``), which
makes torch initialise its NCCL communicator eagerly and bound to that GPU. Every later
``dist.new_group`` (one per holder set, ``runtime.groups``) is then an ``ncclCommSplit`` of it
instead of a fresh ``ncclCommInitRank`` with its own rendezvous through the store: faster with
many groups, and with ``NCCL_COMM_SPLIT_SHARE_RESOURCES=1`` in the workers' environment the
children share the world communicator's buffers (less memory per group, traded against
concurrency between parent and children: the user's choice, not a default). Without
``device_id`` each group would be a separate, lazily created communicator.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator
from datetime import timedelta

import torch
import torch.distributed as dist

__all__ = ["LAUNCHER_VARS", "default_env", "gloo_loopback", "init_distributed", "init_group",
           "one_process_group", "set_threads", "shutdown_distributed", "under_launcher"]

LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


def under_launcher() -> bool:
    """True when a launcher (torchrun, ``launch``) already started this process as a worker."""
    return all(v in os.environ for v in LAUNCHER_VARS)


def gloo_loopback() -> dict[str, str]:
    """``GLOO_SOCKET_IFNAME`` for the loopback interface: local workers talk over it. Else gloo
    binds to what the host name resolves to, which fails or stalls where /etc/hosts or DNS
    does not know the host."""
    names = [name for _, name in socket.if_nameindex() if name in ("lo", "lo0")]
    return {"GLOO_SOCKET_IFNAME": names[0]} if names else {}


@contextlib.contextmanager
def default_env(**defaults: str) -> Iterator[None]:
    """Set env vars that are unset, for the children to inherit, and undo it afterwards."""
    added = [k for k in defaults if k not in os.environ]
    for k in added:
        os.environ[k] = defaults[k]
    try:
        yield
    finally:
        for k in added:
            os.environ.pop(k, None)


def set_threads() -> int:
    """This process's intra-op threads: ``OMP_NUM_THREADS``, 1 when unset, as every worker of
    ``train`` computes (``launch``, torchrun). torch's own default, one per core, spins
    against every other process on a shared machine: ``eval`` took 40x longer on a busy
    2-core machine. Returns the count."""
    threads = int(os.environ.get("OMP_NUM_THREADS", 1))
    torch.set_num_threads(threads)
    return threads


def init_distributed(backend: str | None = None,
                     timeout: float | None = None) -> tuple[int, int]:
    """Create the default process group in a worker and return ``(rank, world_size)``.

    ``backend=None`` picks NCCL when CUDA is available (and pins the worker to GPU
    ``LOCAL_RANK``), else gloo. ``timeout``: seconds the rendezvous and the group's collectives
    wait for a peer (None: torch's default, 30 min on CPU). Outside any launcher this makes a
    one-process group, so the same training code also runs as a plain script. Idempotent.
    """
    set_threads()
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    backend, device_id = _backend(backend)
    wait = None if timeout is None else timedelta(seconds=timeout)
    if under_launcher():
        # env:// rendezvous set up by the launcher. [Note: split communicators]
        dist.init_process_group(backend=backend, timeout=wait, device_id=device_id)
    else:
        one_process_group(backend, timeout=wait, device_id=device_id)
    return dist.get_rank(), dist.get_world_size()


def _backend(backend: str | None) -> tuple[str, torch.device | None]:
    """The backend (None: NCCL when CUDA is available, else gloo) and, for NCCL, this
    worker's device (``LOCAL_RANK``), made current."""
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    device_id = None
    if backend == "nccl":
        device_id = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device_id)
    return backend, device_id


def init_group(store: dist.Store, *, rank: int, world: int, backend: str | None,
               timeout: float) -> None:
    """The default group of ``world`` ranks over ``store`` (a ``PrefixStore`` of its own: a
    group re-formed in the same processes never reads an earlier group's keys)."""
    set_threads()
    backend, device_id = _backend(backend)
    dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout), device_id=device_id)


def one_process_group(backend: str, *, timeout: timedelta | None = None,
                      device_id: torch.device | None = None) -> None:
    """The default group of a world of one, for a process that no launcher started."""
    # An in-memory store: no port to pick and nothing shared with other runs.
    with default_env(**gloo_loopback()):
        dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0,
                                world_size=1, timeout=timeout, device_id=device_id)


def shutdown_distributed() -> None:
    """Destroy the default process group if one exists (NCCL warns when it is left alive)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
