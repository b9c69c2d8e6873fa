"""tests/gpu: NCCL and CUDA checks, skipped cleanly where there is no CUDA (CI, laptops).

Every test here is marked ``gpu``; on a machine without CUDA each is reported as skipped with
the reason, so `make test` collects the layer and runs nothing of it. On a GPU machine:
``pytest tests/gpu`` (multi-rank tests need as many GPUs as ranks, NCCL refuses two ranks on
one device, and skip otherwise).
"""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip = pytest.mark.skip(reason="needs CUDA (tests/gpu)")
    for item in items:
        if "tests/gpu/" in item.nodeid.replace("\\", "/"):
            item.add_marker(pytest.mark.gpu)
            if not torch.cuda.is_available():
                item.add_marker(skip)
