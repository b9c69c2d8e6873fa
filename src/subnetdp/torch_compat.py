"""The torch calls that differ between the releases subnetdp supports, or that reach into
torch's private modules, in one place.

Supported: torch 2.9 to 2.15 (``subnetdp/__init__.py`` refuses an older torch at import;
``make test-torch TORCH=X`` runs the core of the suite on X; docs/testing.md says why older
ones are out). A name that one release has and another lacks is looked up when it is called, by
feature, never by version number, so a back-port needs nothing here and a test can hide the
newer name.

- ``reduce_scatter_single`` and ``all_gather_single`` are torch 2.13's names (it deprecates
  ``reduce_scatter_tensor``); before 2.13 only ``reduce_scatter_tensor`` and
  ``all_gather_into_tensor`` exist, with the same arguments.
- ``ReduceScatter``, the interface of FSDP2's reduce-scatter hook
  (``FSDPModule.set_custom_reduce_scatter``, ``runtime.ring``), is exported by no public
  module; it is the same from 2.9 to 2.15.
- ``LaunchConfig(shutdown_timeout=)`` (the workers' grace between SIGTERM and SIGKILL) first
  ships in torch 2.12; before it torch elastic's grace is a fixed 30 s.
- ``_abort_process_group`` (a rank's groups aborted under it: the fault injector's ``abort``)
  is private in every supported release.
- ``hook_fsdp_on_first`` moves FSDP2's forward hooks of a grouped ``fully_shard`` onto its
  first module: the state (``FSDPModule._get_fsdp_state``), its ``_pre_forward`` and
  ``_post_forward`` and their handles are private in every release (checked on 2.13;
  ``tests/runtime/test_grouped_fused.py`` fails on a release that renames them).
- The default process group and store, the registry of every group and a group's timeout are
  private names of ``distributed_c10d`` (unchanged from 2.9 to 2.15).

Private names imported inside functions elsewhere, for their import cost, and unchanged from
2.9 to 2.15: ``torch.distributed._tools.mem_tracker`` (``metrics.memory``), the fake process
group's ``FakeStore`` (``estimate.memory``, ``bench.step``), ``torch._subclasses``' fake
tensors (``estimate``, ``runtime.fsdp``); also ``torch.utils._pytree`` (``runtime.backends``).
"""

from __future__ import annotations

import contextlib
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

__all__ = ["ReduceScatter", "abort_process_group", "all_gather_single", "default_group",
           "default_store", "hook_fsdp_on_first", "launch_grace", "reduce_scatter_single",
           "set_group_timeouts", "set_unshard_async"]


def reduce_scatter_single(output: torch.Tensor, input: torch.Tensor,
                          op: Any = dist.ReduceOp.SUM, group: dist.ProcessGroup | None = None,
                          async_op: bool = False) -> dist.Work | None:
    """``output`` = chunk ``group rank`` of the ``op``-reduction of every rank's ``input``."""
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(output, input, op=op, group=group, async_op=async_op)


def all_gather_single(output: torch.Tensor, input: torch.Tensor,
                      group: dist.ProcessGroup | None = None,
                      async_op: bool = False) -> dist.Work | None:
    """``output`` = every rank's ``input`` concatenated in group-rank order."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(output, input, group=group, async_op=async_op)


def set_unshard_async(module: Any, async_op: bool) -> None:
    """FSDP2's switch for asynchronous all-gathers (documented, but private in every release
    from 2.9 to 2.15)."""
    module._set_unshard_async_op(async_op)


def hook_fsdp_on_first(module: Any, first: Any) -> None:
    """A grouped ``fully_shard([first, *rest])`` (``module``, its returned FSDP module) with
    its forward hooks on ``first`` only, as ``fully_shard(first)`` registers them: calling
    ``first`` gathers the group and ends its forward, and ``rest`` run as plain modules on the
    gathered parameters (which FSDP installs on them), without a hook call each."""
    state = module._get_fsdp_state()
    state._pre_forward_hook_handle.remove()  # one handle for every module's pre and post hook
    state._pre_forward_hook_handle = first.register_forward_pre_hook(
        state._pre_forward, prepend=True, with_kwargs=True)
    state._post_forward_hook_handle = first.register_forward_hook(state._post_forward)


def launch_grace(seconds: int) -> dict[str, Any]:
    """``LaunchConfig``'s keyword for the workers' grace between SIGTERM and SIGKILL, where
    this torch has one (else its agent waits a fixed 30 s)."""
    from torch.distributed.launcher.api import LaunchConfig

    fields = LaunchConfig.__dataclass_fields__
    return {"shutdown_timeout": seconds} if "shutdown_timeout" in fields else {}


def abort_process_group() -> None:
    """Abort this rank's process groups, as a communicator's watchdog does (private
    ``_abort_process_group`` from 2.9 to 2.15; else destroyed, which ends them the same way
    for gloo)."""
    abort = getattr(c10d, "_abort_process_group", None)
    if abort is None:
        dist.destroy_process_group()
        return
    abort()


def default_group() -> dist.ProcessGroup:
    return c10d._get_default_group()


def default_store() -> dist.Store:
    """The default group's store (the rendezvous store every rank reaches)."""
    return c10d._get_default_store()


def set_group_timeouts(wait: timedelta) -> None:
    """Every process group this rank belongs to now waits at most ``wait`` for a peer; a
    backend without timeouts keeps its own."""
    for group in list(c10d._world.pg_map):
        if c10d._rank_not_in_group(group):
            continue
        with contextlib.suppress(ValueError, RuntimeError):  # a backend without timeouts
            c10d._set_pg_timeout(wait, group)
