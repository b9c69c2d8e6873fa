import os

import pytest

# One intra-op thread per process: distributed tests run several workers on 2 cores, and
# forked workers must not inherit a live OpenMP pool.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

torch.set_num_threads(1)


@pytest.fixture
def fork_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Local launches fork their workers, so patches made in this process reach them."""
    monkeypatch.setattr("subnetdp.train.launch.DEFAULT_START_METHOD", "fork")
