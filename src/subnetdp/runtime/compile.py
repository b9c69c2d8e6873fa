"""``--compile``: ``torch.compile`` per block, torchtitan style, without renaming anything.

Each block's ``forward`` is replaced (on the instance, like ``runtime.checkpointing``) by its
compiled version; wrapping the module instead (``torch.compile(block)``) would add ``_orig_mod``
to every parameter name that plans, pieces and checkpoints key on. Applied before activation
checkpointing, which then runs (and recomputes) the compiled forward: torchtitan compiles
around the checkpoint instead, but dynamo refuses the ``context_fn`` that keeps BatchNorm
statistics ([Note: BatchNorm under recomputation]). Both come before any data-parallel
wrapper, so FSDP's and the reducer's hooks, which run in the block's ``__call__``, stay
outside the compiled code.

[Note: no recompilation]
Dynamo caches one graph per code object, guarded on what it read. Blocks of one model share
``forward``'s code and, with torch's inlining of ``nn.Module`` (the default since 2.5),
their parameters are graph inputs rather than guarded constants, so all blocks of one shape
share one graph. A rank's held blocks (b-sdp), narrowed layers (n-sdp) and frozen copies
(backward masking) are fixed for the whole run, so after the first step nothing a guard
reads changes: no recompilation. ``tests/composition/test_compile.py`` counts them.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

BACKEND = "inductor"  # torch.compile's default; the tests use aot_eager (no C++ compiler)


def compile_blocks(model: nn.Module, paths: Iterable[str]) -> int:
    """Compile the ``forward`` of each block at ``paths``; returns how many (already compiled
    blocks are left alone)."""
    n = 0
    for path in paths:
        block = model.get_submodule(path)
        if getattr(block, "_subnetdp_compiled", False):
            continue
        block.forward = torch.compile(block.forward, backend=BACKEND)  # type: ignore[method-assign]
        block._subnetdp_compiled = True  # type: ignore[assignment]
        n += 1
    return n
