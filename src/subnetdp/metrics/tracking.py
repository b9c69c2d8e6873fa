"""Experiment tracking: the metric names of a run, and rank 0's optional TensorBoard and W&B
sinks next to the per-rank JSONL files.

One meaning per name, in ``metrics/rank<r>.jsonl``, the sinks and ``summary.json`` alike
(names as in torchtitan):

- ``loss``: this rank's training loss at the step (JSONL only);
- ``loss_metrics/global_avg_loss``: the mean of ``loss`` over all ranks at the step;
- ``grad_norm``: the full model's gradient norm before clipping (with ``--grad-clip``);
- ``lr``: the learning rate the step used;
- ``throughput(tps)``: tokens (images) per second *per device* (summary: at the median step);
- ``mfu(%)``: model FLOPs per second of this device over its peak, when both are known;
- ``memory/max_active(GiB)``: the most tensor memory this rank held so far (CUDA: the
  allocator's peak; CPU: the measured step's peak, from that step on);
- ``val_loss`` (``val_ppl``, ``val_accuracy``): the assembled full model on the validation set,
  every ``--eval-every`` steps and at the end.

Steps are counted from 1 (torchtitan) in the JSONL files, the sinks, the console and ``plot``:
step N is the line written after N steps. The sinks see only numbers, on rank 0, at log steps
([Note: log steps] in train/trainer.py).
They are optional extras: a missing package is refused before any worker starts
(``check_sinks``). W&B runs offline unless ``WANDB_MODE`` says otherwise, so a run never needs
the network; ``wandb sync`` uploads it later.
"""

from __future__ import annotations

import importlib.util
import math
import os
from pathlib import Path
from typing import Any

__all__ = [
    "GLOBAL_AVG_LOSS",
    "GRAD_NORM",
    "MAX_ACTIVE",
    "MFU",
    "VAL_LOSS",
    "Tracker",
    "check_sinks",
    "peak_flops",
]

GLOBAL_AVG_LOSS = "loss_metrics/global_avg_loss"
GRAD_NORM = "grad_norm"
MAX_ACTIVE = "memory/max_active(GiB)"
MFU = "mfu(%)"
VAL_LOSS = "val_loss"

_INSTALL = {"tensorboard": "pip install 'subnetdp[tensorboard]'",
            "wandb": "pip install 'subnetdp[wandb]'"}

# Dense bf16 peak FLOP/s by CUDA device name (the vendors' datasheets, without sparsity);
# anything else needs --peak-tflops for mfu(%).
_PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10G": 125.0,
                "L4": 121.0}


def check_sinks(*, tensorboard: bool, wandb: bool) -> None:
    """Refuse a sink whose package is missing, with the install command (launching process)."""
    for name, wanted in (("tensorboard", tensorboard), ("wandb", wandb)):
        if wanted and importlib.util.find_spec(name) is None:
            raise ValueError(f"--{name} needs the {name} package: `{_INSTALL[name]}`, or drop "
                             f"--{name}")


def peak_flops(device_name: str | None, peak_tflops: float | None) -> float | None:
    """The device's peak FLOP/s: ``peak_tflops`` when given, else from the CUDA device name
    (None when unknown, e.g. on CPU: then no ``mfu(%)``)."""
    if peak_tflops is not None:
        return peak_tflops * 1e12
    if device_name is None:
        return None
    for key, tflops in _PEAK_TFLOPS.items():
        if key in device_name:
            return tflops * 1e12
    return None


class Tracker:
    """Rank 0's TensorBoard / W&B sinks; a no-op when neither is on (or on other ranks)."""

    def __init__(self, run_dir: str | os.PathLike[str], *, tensorboard: bool = False,
                 wandb_project: str | None = None, config: dict[str, Any] | None = None,
                 enabled: bool = True) -> None:
        self._tb: Any = None
        self._wandb: Any = None
        if not enabled:
            return
        run_dir = Path(run_dir)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(run_dir / "tensorboard"))
        if wandb_project is not None:
            import wandb

            self._wandb = wandb.init(
                project=wandb_project, name=run_dir.name, dir=str(run_dir), config=config,
                mode=os.environ.get("WANDB_MODE", "offline"),  # type: ignore[arg-type]
                resume="allow", id=_wandb_id(run_dir))

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        """Finite numbers of ``metrics`` at ``step`` (anything else is left to the JSONL)."""
        nums = {k: float(v) for k, v in metrics.items()
                if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)}
        if not nums:
            return
        if self._tb is not None:
            for k, v in nums.items():
                self._tb.add_scalar(k, v, step)
        if self._wandb is not None:
            self._wandb.log(nums, step=step)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


def _wandb_id(run_dir: Path) -> str:
    """One W&B run per run folder, so a resumed run continues the same W&B run."""
    import hashlib

    return hashlib.sha1(str(run_dir.resolve()).encode()).hexdigest()[:16]
