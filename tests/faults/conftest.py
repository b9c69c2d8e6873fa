"""``long`` fault cases (several restarts, a minute or more on 2 cores) run only with
``SUBNETDP_LONG_TESTS=1`` (``make test-faults``), so ``make test`` stays fast."""

from __future__ import annotations

import os

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("SUBNETDP_LONG_TESTS") == "1":
        return
    skip = pytest.mark.skip(reason="long fault case: run with SUBNETDP_LONG_TESTS=1")
    for item in items:
        if "long" in item.keywords:
            item.add_marker(skip)
