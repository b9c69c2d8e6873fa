"""Metrics: measured memory per step, JSONL/JSON sinks, and rank 0's progress display.

``subnetdp.metrics.sinks`` and ``subnetdp.metrics.progress`` import no torch (import them
directly in light tools); ``memory`` loads torch's MemTracker only when a measurement runs.
"""

from subnetdp.metrics.memory import MemoryReport, measure_step_memory, process_peak_rss_bytes
from subnetdp.metrics.progress import Progress
from subnetdp.metrics.sinks import JsonlSink, read_jsonl, write_json_atomic

__all__ = [
    "JsonlSink",
    "MemoryReport",
    "Progress",
    "measure_step_memory",
    "process_peak_rss_bytes",
    "read_jsonl",
    "write_json_atomic",
]
