"""Activation checkpointing per block, without renaming anything.

``torch.distributed``'s ``checkpoint_wrapper`` puts a module around each block, which adds
``_checkpoint_wrapped_module`` to every parameter name; subnetdp's plans, pieces and checkpoints
are keyed by the model's own names, so instead the block's ``forward`` is replaced (on the
instance) by one that runs the original under non-reentrant ``torch.utils.checkpoint``.

Hooks stay outside or inside exactly as before: the block's own ``__call__`` hooks (FSDP's
all-gather and reshard when the block is sharded) run around the checkpointed region, once;
hooks of modules *inside* the block (n-sdp's output scaling) run again when backward recomputes
the block, with the same inputs and the same RNG state, so they give the same values; gradient
hooks (the reducer's) fire once per backward, because recomputation accumulates no gradient.

[Note: BatchNorm under recomputation] A BatchNorm (or InstanceNorm) with running statistics
updates them, and ``num_batches_tracked``, on every training call, so recomputing the block
would count every batch twice: the exported model would differ from the run without
checkpointing. Their buffers are copied before the recomputation and put back after it.
Switching ``track_running_stats`` off while recomputing would be cheaper, but BatchNorm then
saves two tensors fewer for backward, and torch's checkpoint refuses a recomputation that
saves a different number of tensors than the forward did.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _NormBase
from torch.utils.checkpoint import checkpoint


def checkpoint_blocks(model: nn.Module, paths: Iterable[str]) -> int:
    """Run each block at ``paths`` under activation checkpointing; returns how many.

    Call it before sharding (FSDP) so that the block's all-gather happens outside the
    recomputed region. Blocks already checkpointed are left alone."""
    n = 0
    for path in paths:
        block = model.get_submodule(path)
        if getattr(block, "_subnetdp_checkpointed", False):
            continue
        block.forward = _checkpointed(block)  # type: ignore[method-assign]
        block._subnetdp_checkpointed = True  # type: ignore[assignment]
        n += 1
    return n


def _checkpointed(block: nn.Module) -> Any:
    forward = block.forward

    def contexts() -> tuple[Any, Any]:  # (first forward, recomputation)
        return nullcontext(), _statistics_kept(block)

    def run(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(forward, *args, use_reentrant=False, context_fn=contexts, **kwargs)

    return run


@contextmanager
def _statistics_kept(block: nn.Module) -> Iterator[None]:
    """The block's running statistics are as before once it has been recomputed ([Note:
    BatchNorm under recomputation])."""
    saved = [(b, b.clone()) for m in block.modules()
             if isinstance(m, _NormBase) and m.track_running_stats
             for b in m.buffers(recurse=False)]
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, value in saved:
                buffer.copy_(value)
