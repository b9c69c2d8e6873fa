"""Measured memory of one training step, by category, on every device that holds tensors.

``measure_step_memory(step, modules=[model], optimizers=[opt])`` runs ``step()`` under torch's
``MemTracker`` (a ``TorchDispatchMode`` that sees every tensor allocated by an op and frees it on
the storage's death) and reports the peak of live tensor bytes with the breakdown at that peak:
parameters, buffers, gradients, optimizer state, activations, backward temporaries, other.
Unlike ``torch.cuda.max_memory_allocated`` it works on CPU too, so gloo runs can be compared
with the analytic per-worker budget; unlike RSS it excludes allocator caches and the Python heap.

What it cannot see: tensors created *before* the step and never touched by an op during it
(pass modules/optimizers so their tensors are counted), and C++ buffers that no dispatched op
touches. DDP's gradient buckets are touched by the copy into them, so they are counted.
"""

from __future__ import annotations

import resource
import sys
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from torch import nn
from torch.optim import Optimizer

__all__ = ["CATEGORIES", "MemoryReport", "measure_step_memory", "process_peak_rss_bytes"]

T = TypeVar("T")

GiB = float(1 << 30)

# MemTracker's category names (``_MemRefType`` values) -> our short keys.
_CATEGORY_OF = {
    "Parameter": "params",
    "Buffer": "buffers",
    "Gradient": "grads",
    "Optstate": "optimizer",
    "Activation": "activations",
    "Temp": "temporaries",
    "Other": "other",
}
CATEGORIES: tuple[str, ...] = (*_CATEGORY_OF.values(), "total")


@dataclass(frozen=True)
class MemoryReport:
    """Peak live-tensor bytes of one measured step.

    ``peak_bytes``/``breakdown`` are for ``device``: the CUDA device with the highest peak when
    any tensors were on CUDA, else the CPU. ``per_device`` has the breakdown at each device's
    own peak (keys like ``"cpu"``, ``"cuda:0"``). ``cuda_max_allocated`` is the caching
    allocator's own peak for the step (None unless CUDA was in use); it includes allocator
    rounding and workspaces that MemTracker does not see.
    """

    peak_bytes: int
    breakdown: dict[str, int]
    device: str
    per_device: dict[str, dict[str, int]] = field(default_factory=dict)
    cuda_max_allocated: int | None = None
    process_peak_rss: int = 0

    def to_dict(self) -> dict[str, Any]:
        """Flat metrics in torchtitan style (GiB) plus the raw byte fields, JSON-ready."""
        out: dict[str, Any] = {"memory/peak_active(GiB)": self.peak_bytes / GiB}
        for cat in CATEGORIES[:-1]:
            out[f"memory/{cat}(GiB)"] = self.breakdown.get(cat, 0) / GiB
        if self.cuda_max_allocated is not None:
            out["memory/cuda_max_allocated(GiB)"] = self.cuda_max_allocated / GiB
        out["memory/peak_rss(GiB)"] = self.process_peak_rss / GiB
        out["peak_bytes"] = self.peak_bytes
        out["breakdown"] = dict(self.breakdown)
        out["device"] = self.device
        out["per_device"] = {d: dict(b) for d, b in self.per_device.items()}
        out["cuda_max_allocated"] = self.cuda_max_allocated
        return out


class _NoHook:
    def remove(self) -> None:
        pass


def make_tracker() -> Any:
    """A ``MemTracker`` that also works on models with frozen parameters, and keeps only the
    global peak.

    MemTracker installs a gradient hook on every parameter it meets, which raises for a
    parameter with ``requires_grad=False`` (backward masking freezes the units a worker does
    not hold). Frozen parameters never get a gradient, so they are given a no-op handle
    instead. Its per-module peaks, which nobody here reads, walk every tracked module on every
    op (a quarter of a fake-mode estimate's time), so each op updates the global peak alone.
    Everything else is MemTracker's own accounting.
    """
    from torch.distributed._tools.mem_tracker import MemTracker

    class _Tracker(MemTracker):  # type: ignore[misc]
        def _track_module_params_and_buffers(
            self, module: nn.Module, install_grad_hooks: bool = True
        ) -> tuple[int, int]:
            for p in module.parameters():
                if not p.requires_grad and p not in self._param_to_grad_hook_handles:
                    self._param_to_grad_hook_handles[p] = (_NoHook(), _NoHook())
            return super()._track_module_params_and_buffers(module, install_grad_hooks)

        def _update_peak_stats(self, peak_state: Any) -> None:
            # MemTracker._update_peak_stats (torch 2.13) without its per-module part
            for dev, snap in self._curr_mem_snap.items():
                if self._peak_mem.get(dev, 0) < snap["Total"]:
                    self._peak_mem[dev] = snap["Total"]
                    self._peak_mem_snap[dev] = dict(snap)  # a flat dict of ints: deepcopy's copy

    return _Tracker()


def measure_step_memory(
    fn: Callable[[], T],
    *,
    modules: Sequence[nn.Module] = (),
    optimizers: Sequence[Optimizer] = (),
    grad_tensors: Sequence[torch.Tensor] = (),
) -> tuple[T, MemoryReport]:
    """Run ``fn()`` (one full training step) and return its result with its memory report.

    Pass the model(s) and optimizer(s) so that tensors that already exist (parameters, optimizer
    state, gradients kept from before) are counted in their category from the start; gradients
    and optimizer state created during the step are categorised by MemTracker's hooks.
    ``grad_tensors`` are gradient storage that exists before the step but is attached to
    parameters only during it (e.g. subnetdp's reducer buckets, whose views become ``.grad``),
    counted as gradients from the start.
    Each call uses a fresh tracker, so repeated calls measure independently, and the tracker's
    hooks are removed on exit (the next step runs at full speed).
    """
    from torch.distributed._tools.mem_tracker import _MemRefType

    # Only touch CUDA when the program already uses it: initialising a CUDA context just to
    # read a zero would cost time and memory in CPU-only (gloo) workers on a GPU machine.
    use_cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    if use_cuda:
        # The allocator's peak is updated when ops are launched, so no synchronize is needed.
        torch.cuda.reset_peak_memory_stats()

    tracker = make_tracker()
    tracker.track_external(*modules, *optimizers)
    for t in grad_tensors:
        tracker._update_and_maybe_create_winfos(t, _MemRefType.GRAD)
    try:
        with tracker, warnings.catch_warnings():
            # nb-sdp frees a parameter's full gradient inside its own post-accumulate hook, so
            # MemTracker's hook after it finds None and warns; nothing is lost (the slices it
            # moved into are counted as gradients).
            warnings.filterwarnings("ignore", message="Expected a tensor or a traceable")
            result = fn()
        peak = tracker.get_tracker_snapshot("peak")
    finally:
        # The tracker keeps weak references with callbacks on every storage it saw; drop them
        # now rather than waiting for the cycle collector.
        tracker._WINFO.clear()
        tracker.memory_tracking.clear()

    cuda_peak: int | None = None
    if use_cuda:
        cuda_peak = int(torch.cuda.max_memory_allocated())

    per_device = {str(dev): _breakdown(snap) for dev, snap in peak.items()}
    device = _main_device(per_device)
    breakdown = per_device.get(device, dict.fromkeys(CATEGORIES, 0))
    report = MemoryReport(
        peak_bytes=breakdown["total"],
        breakdown=breakdown,
        device=device,
        per_device=per_device,
        cuda_max_allocated=cuda_peak,
        process_peak_rss=process_peak_rss_bytes(),
    )
    return result, report


def _breakdown(snap: dict[Any, int]) -> dict[str, int]:
    out = dict.fromkeys(CATEGORIES, 0)
    for key, nbytes in snap.items():
        # Keys are ``_MemRefType`` members (a str Enum) plus the plain string "Total".
        name = getattr(key, "value", key)
        out[_CATEGORY_OF.get(name, "total" if name == "Total" else "other")] += int(nbytes)
    return out


def _main_device(per_device: dict[str, dict[str, int]]) -> str:
    cuda = {d: b["total"] for d, b in per_device.items() if d.startswith("cuda")}
    if cuda:
        return max(cuda, key=lambda d: cuda[d])
    return "cpu"


def process_peak_rss_bytes() -> int:
    """Peak resident set size of this process so far, in bytes (whole process, never reset)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports KiB, macOS bytes.
    return int(rss) if sys.platform == "darwin" else int(rss) * 1024
