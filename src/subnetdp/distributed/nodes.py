"""Which node a worker runs on, as torchrun says it (``GROUP_RANK``, ``GROUP_WORLD_SIZE``,
``LOCAL_WORLD_SIZE``), and the built-in launcher's emulated nodes that say it the same way.

[Note: emulated nodes]
``train --nnodes K`` without torchrun runs every worker on this machine but tells each one the
node it would be on: contiguous blocks of ranks (``plan.nodes.node_of``, the map torchrun and
``bench/netem.py``'s ``--nodes`` use), in the variables torchrun sets. ``LOCAL_RANK`` stays
the worker's index on this machine (its CUDA device). The plan spreads holders over these
nodes ([Note: holders across nodes] in plan/nodes.py), and a test that kills one node's ranks
rehearses the loss of a machine. With ``--max-nproc`` the launcher keeps emulating the run's
nodes after a loss: the restarted workers that rejoin fill the lost node again.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from subnetdp.distributed.process_group import under_launcher
from subnetdp.plan.nodes import node_of, node_ranks

__all__ = ["emulate_nodes", "launcher_nnodes"]


class _OnNode:
    """A worker entry point that first sets its emulated node's variables."""

    def __init__(self, fn: Callable[..., Any], nnodes: int) -> None:
        self.fn, self.nnodes = fn, nnodes
        self.__name__ = getattr(fn, "__name__", "worker")  # the elastic agent's logs
        self.__module__ = getattr(fn, "__module__", __name__)  # the fork server preloads it

    def __call__(self, *args: Any) -> Any:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        node = node_of(rank, world, self.nnodes)
        os.environ.update(GROUP_RANK=str(node), GROUP_WORLD_SIZE=str(self.nnodes),
                          LOCAL_WORLD_SIZE=str(len(node_ranks(world, self.nnodes)[node])))
        return self.fn(*args)


def emulate_nodes(fn: Callable[..., Any], nnodes: int) -> Callable[..., Any]:
    """``fn`` as the entry point of workers on ``nnodes`` emulated nodes ([Note: emulated
    nodes]); ``fn`` itself on one node, or under torchrun (its nodes are real)."""
    if nnodes == 1 or under_launcher():
        return fn
    return _OnNode(fn, nnodes)


def launcher_nnodes() -> int:
    """Under torchrun: its node count (whatever a resumed run recorded: the nodes are the
    ones running now), checked against the contiguous map the plan assumes (equal
    ``--nproc-per-node`` on every node)."""
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    nnodes = int(os.environ.get("GROUP_WORLD_SIZE", "1"))
    group = int(os.environ.get("GROUP_RANK", "0"))
    if nnodes > 1 and node_of(rank, world, nnodes) != group:
        raise ValueError(f"rank {rank} runs on node {group}, but {world} workers on {nnodes} "
                         "nodes in equal blocks put it on node "
                         f"{node_of(rank, world, nnodes)}: give every node the same "
                         "--nproc-per-node (the plan spreads holders over equal nodes)")
    return nnodes
