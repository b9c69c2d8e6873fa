"""The run's device: which one, its matmul precision, and how batches get there."""

from __future__ import annotations

import torch

from subnetdp.train.config import TrainConfig

Batch = tuple[torch.Tensor, torch.Tensor]


def run_device(cfg: TrainConfig) -> torch.device:
    """CUDA (this worker's GPU, set by ``init_distributed``) when asked or available, else CPU.
    On CUDA, float32 matmuls and convolutions use TF32 unless ``--no-tf32``: ~8x the fp32
    matmul rate on Ampere and later, at a 10-bit mantissa (PyTorch's own default is off)."""
    if cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available()):
        torch.backends.cuda.matmul.allow_tf32 = cfg.tf32
        torch.backends.cudnn.allow_tf32 = cfg.tf32
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def device_name(requested: str) -> str:
    """``cpu`` or ``cuda`` for ``--device auto|cpu|cuda`` in this process; ``cuda`` on a
    machine without CUDA is refused (``ValueError``) before any work."""
    if requested == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device cuda: CUDA is not available on this machine (torch "
                         f"{torch.__version__}); use --device cpu or auto")
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return requested


def to_device(batch: Batch, device: torch.device) -> Batch:
    """Copy a CPU batch to ``device``. To CUDA through pinned memory, so that the copy is
    asynchronous (``non_blocking``) and the host can prepare the next step meanwhile; a
    pageable source would make the copy synchronous."""
    if device.type != "cuda":
        return batch[0].to(device), batch[1].to(device)
    x, y = (t if t.is_pinned() else t.pin_memory() for t in batch)
    return x.to(device, non_blocking=True), y.to(device, non_blocking=True)
