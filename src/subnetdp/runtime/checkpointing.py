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
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import nn
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
        block.forward = _checkpointed(block.forward)  # type: ignore[method-assign]
        block._subnetdp_checkpointed = True  # type: ignore[assignment]
        n += 1
    return n


def _checkpointed(forward: Any) -> Any:
    def run(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return run
