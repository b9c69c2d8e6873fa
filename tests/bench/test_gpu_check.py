"""benchmarks/gpu_check.sh is valid bash and, without CUDA, says so and does nothing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.sh"


def test_script_parses() -> None:
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: run the script itself")
def test_without_cuda_it_refuses_cleanly(tmp_path: Path) -> None:
    r = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True,
                       env={"PY": sys.executable, "OUT": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 2
    assert "no CUDA device" in r.stderr
