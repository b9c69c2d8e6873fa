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


def test_a_bare_checkout_uses_python3_and_says_when_it_has_no_torch(tmp_path: Path) -> None:
    """No .venv beside the script: python3 from PATH; one without torch gets one line."""
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "gpu_check.sh").write_text(SCRIPT.read_text())
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    shim = bin_dir / "python3"
    shim.write_text("#!/bin/sh\necho \"ModuleNotFoundError: No module named 'torch'\" >&2\n"
                    "exit 1\n")
    shim.chmod(0o755)
    r = subprocess.run(["bash", str(tmp_path / "benchmarks" / "gpu_check.sh")],
                       capture_output=True, text=True,
                       env={"OUT": str(tmp_path / "out"), "PATH": f"{bin_dir}:/usr/bin:/bin"})
    assert r.returncode == 2
    assert r.stderr.strip() == ("gpu_check: python3 cannot import torch: run make setup, or set "
                                "PY to a python with a CUDA build of torch (exit 2)")
