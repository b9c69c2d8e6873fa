"""What a run's floating-point results depend on besides its seed: ``summary.json``'s
``numerics``.

[Note: figures that repeat on one machine]
A run is bit-for-bit deterministic on its machine (data, initialisation and reductions follow
the seed and the world size), but its last bits follow the CPU kernels torch dispatches to:
ATen's vectorised kernels pick the widest instruction set the CPU has (AVX512, AVX2, ...;
``ATEN_CPU_CAPABILITY`` caps it), MKL's matrix products pick their own code branch
(``MKL_CBWR`` fixes one), and a kernel's thread count changes how it splits its sums. Over
hundreds of steps those bits grow into the third decimal of a validation loss (the demo's DDP
loss: 4.8088 to 4.8115 across instruction sets, docs/benchmarks.md#demo-kernels). So the run
records what it computed with; two runs whose records match give the same figures.
"""

from __future__ import annotations

import os
import platform
import re
from typing import Any

import torch

__all__ = ["KERNEL_ENV", "numerics"]

# Environment variables that change which kernels run (torch, MKL, oneDNN, OpenMP)
KERNEL_ENV = ("ATEN_CPU_CAPABILITY", "MKL_CBWR", "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA",
              "OMP_NUM_THREADS", "MKL_NUM_THREADS")


def numerics(device: torch.device) -> dict[str, Any]:
    """The kernels this process computes with: CPU and its instruction set as torch uses it,
    the CPU's vector extensions (MKL picks its branch from them: two AVX512 CPUs of different
    generations take different ones), threads, library builds, the variables that steer them
    (only those set), and the GPU."""
    config = torch.__config__.show()
    model, flags = _cpu()
    return {
        "cpu": model,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_vector_flags": flags,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "mkl": _version(r"Math Kernel Library Version ([\d.]+)", config),
        "onednn": _version(r"MKL-DNN (v\S+)", config),
        "env": {k: os.environ[k] for k in KERNEL_ENV if k in os.environ},
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
    }


def _cpu() -> tuple[str, list[str]]:
    """The CPU's model name and vector extensions (``/proc/cpuinfo`` on Linux; elsewhere the
    platform's word and no flags)."""
    model, flags = "", list[str]()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and not model:
                    model = value.strip()
                elif key.strip() == "flags" and not flags:
                    flags = sorted(x for x in value.split() if x.startswith(_VECTOR))
    except OSError:
        pass
    return model or platform.processor() or platform.machine(), flags


_VECTOR = ("avx", "amx", "fma", "sse", "neon", "sve", "asimd")


def _version(pattern: str, config: str) -> str | None:
    m = re.search(pattern, config)
    return m[1] if m else None
