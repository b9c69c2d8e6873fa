"""Every rank sees the same run folder, checked when the workers start.

[Note: a folder all ranks share]
Rank 0 writes the run's summary, plan and metrics, but every rank writes its own checkpoint
shard into ``<out>/checkpoints``, and rank 0 publishes the checkpoint once all shards are
there. An ``--out`` on a node-local disk (``/tmp``, a local scratch) gives each node its own
folder: nothing fails until the first checkpoint, minutes or hours in, and then as a missing
shard. So at start rank 0 writes a marker holding a random token into ``out``; after a
collective that hands every rank the token (and so also orders the write before the reads),
each rank reads the marker back, and one more collective tells every rank who could not. All
ranks then stop together (``RunStoppedError``: torch elastic is not asked to restart a run that
would meet the same folder), naming the ranks and hosts, before any model is built. Rank 0
deletes the marker once every rank has read it, so a run leaves none behind.
"""

from __future__ import annotations

import secrets
import socket
from pathlib import Path

import torch.distributed as dist

from subnetdp.checkpoint.checkpointer import RunStoppedError
from subnetdp.filemode import write_atomic

__all__ = ["MARKER", "RunFolderNotSharedError", "check_shared_folder"]

MARKER = ".subnetdp.shared"


class RunFolderNotSharedError(RunStoppedError):
    """Some rank does not see the run folder rank 0 writes (a node-local ``--out``)."""


def check_shared_folder(out: Path, rank: int) -> None:
    """Collective: raise ``RunFolderNotSharedError`` on every rank unless every rank reads the
    marker rank 0 wrote into ``out`` ([Note: a folder all ranks share])."""
    token: list[str | None] = [None]
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        token[0] = mine = secrets.token_hex(16)
        write_atomic(out / MARKER, mine)
    dist.broadcast_object_list(token, src=0)
    try:
        seen = (out / MARKER).read_text() == token[0]
    except OSError:
        seen = False
    views: list[tuple[bool, str] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(views, (seen, socket.gethostname()))
    if rank == 0:
        (out / MARKER).unlink(missing_ok=True)
    blind = [f"rank {r} on {v[1]}" for r, v in enumerate(views) if v is not None and not v[0]]
    if blind:
        writer = views[0][1] if views[0] is not None else "?"
        raise RunFolderNotSharedError(
            f"--out {out}: {', '.join(blind)} cannot see the file rank 0 on {writer} wrote "
            "there at start; --out must be on a filesystem all nodes share (NFS, Lustre, a "
            "shared mount), not a node-local disk")
