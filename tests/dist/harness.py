"""Run a function in N gloo worker processes and collect what each returns.

Workers are forked (fast: no re-import of torch) and rendezvous through a FileStore in a
temporary directory, so tests never need a free TCP port.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch._dynamo  # a worker's first optimizer step imports it (seconds of CPU): imported
import torch.distributed as dist  # here once, every forked worker inherits it instead

from subnetdp.distributed.process_group import gloo_loopback


def _worker(
    rank: int, world: int, tmp: str, fn: Callable[..., Any], args: tuple, queue: Any
) -> None:
    gc.freeze()  # never collect what was inherited (see launch.py, fork and the GC)
    torch.set_num_threads(1)
    os.environ.update({**gloo_loopback(), **os.environ})  # as local launches: no host lookup
    try:
        store = dist.FileStore(os.path.join(tmp, "store"), world)
        dist.init_process_group("gloo", rank=rank, world_size=world, store=store)
        try:
            result = fn(rank, world, *args)
        finally:
            if dist.is_initialized():  # the function may have shut it down itself
                dist.destroy_process_group()
        # Results travel through a file: tensors sent over a queue would be shared-memory
        # handles that die with this process.
        torch.save(result, os.path.join(tmp, f"result{rank}.pt"))
        queue.put((rank, True, None))
    except BaseException:  # report any failure to the parent instead of hanging it
        queue.put((rank, False, traceback.format_exc()))


def run_workers(fn: Callable[..., Any], world: int, *args: Any, timeout: float = 240) -> list[Any]:
    """``fn(rank, world, *args)`` on ``world`` processes; returns the results by rank."""
    gc.collect()
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [
            ctx.Process(target=_worker, args=(r, world, tmp, fn, args, queue))
            for r in range(world)
        ]
        for p in procs:
            p.start()
        results: dict[int, Any] = {}
        errors = []
        try:
            for _ in range(world):
                rank, ok, value = queue.get(timeout=timeout)
                if ok:
                    path = os.path.join(tmp, f"result{rank}.pt")
                    results[rank] = torch.load(path, weights_only=False)
                else:
                    errors.append(f"rank {rank} failed:\n{value}")
                    break
        finally:
            for p in procs:
                p.join(timeout=5 if errors else 30)
                if p.is_alive():
                    p.kill()
        if errors:
            raise RuntimeError("\n".join(errors))
    return [results[r] for r in range(world)]
