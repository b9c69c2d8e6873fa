"""Live tensors of this process, for the tests that check a dropped build frees everything."""

from __future__ import annotations

import gc
import time
import warnings
from collections.abc import Callable
from typing import TypeVar

import torch
from torch._subclasses.fake_tensor import FakeTensor


def nbytes(t: torch.Tensor) -> int | None:
    """The bytes of ``t``'s storage; None for a tensor without memory (the fake and functional
    tensors that tracing makes, meta tensors)."""
    if isinstance(t, FakeTensor) or t.is_meta:
        return None
    try:
        t.untyped_storage().data_ptr()
    except RuntimeError:  # "Cannot access data pointer of Tensor (e.g. FakeTensor, ...)"
        return None
    return t.untyped_storage().nbytes()


def live_tensors() -> list[torch.Tensor]:
    """Live tensors with memory, after a collection."""
    gc.collect()
    with warnings.catch_warnings():  # isinstance on torch.distributed.reduce_op warns
        warnings.simplefilter("ignore", FutureWarning)
        return [o for o in gc.get_objects()
                if isinstance(o, torch.Tensor) and nbytes(o) is not None]


def live_bytes() -> int:
    """The bytes of the live tensors' distinct storages."""
    return sum({t.untyped_storage().data_ptr(): nbytes(t) or 0 for t in live_tensors()}.values())


T = TypeVar("T")


def settled(ask: Callable[[], T], good: Callable[[T], bool]) -> T:
    """``ask()``, asked again after short waits while its answer is not ``good`` (a second at
    most): gloo's threads drop a finished collective's tensors in their own time (seen once,
    on a loaded machine: DDP's flat bucket, alive just after a step, gone a moment later)."""
    for _ in range(20):
        answer = ask()
        if good(answer):
            return answer
        del answer
        time.sleep(0.05)
    return ask()


def describe(tensors: list[torch.Tensor]) -> str:
    """How many, their bytes, and the first few: shape, dtype and what holds each."""
    held = [f"{tuple(t.shape)} {t.dtype} in "
            f"{sorted({type(r).__name__ for r in gc.get_referrers(t) if r is not tensors})}"
            for t in tensors[:5]]
    return f"{len(tensors)} tensors, {sum(nbytes(t) or 0 for t in tensors)} bytes: {held}"
