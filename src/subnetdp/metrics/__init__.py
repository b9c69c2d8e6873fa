"""Metrics: measured memory per step, JSONL/JSON sinks, rank 0's progress display, and
readable tables of run summaries.

Only ``memory`` needs torch, and it is imported on first use of its names, so ``sinks``,
``progress`` and ``report`` stay light for tools that only read summaries and metrics files.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from subnetdp.metrics.progress import Progress
from subnetdp.metrics.sinks import JsonlSink, read_jsonl, write_json_atomic

if TYPE_CHECKING:
    from subnetdp.metrics.memory import MemoryReport, measure_step_memory, process_peak_rss_bytes

__all__ = [
    "JsonlSink",
    "MemoryReport",
    "Progress",
    "measure_step_memory",
    "process_peak_rss_bytes",
    "read_jsonl",
    "write_json_atomic",
]

_MEMORY = frozenset({"MemoryReport", "measure_step_memory", "process_peak_rss_bytes"})


def __getattr__(name: str) -> Any:
    if name in _MEMORY:
        from subnetdp.metrics import memory

        return getattr(memory, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
