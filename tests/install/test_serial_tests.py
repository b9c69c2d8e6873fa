"""The lock that keeps a ``serial`` test alone under pytest-xdist (tests/conftest.py)."""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass

import pytest

from tests.conftest import _alone_if_serial


@dataclass
class _Item:
    serial: bool

    def get_closest_marker(self, name: str) -> object | None:
        return object() if name == "serial" and self.serial else None


def _entered_while(holder: _Item, other: _Item) -> bool:
    """Whether ``other`` enters while ``holder`` is inside (two workers' tests)."""
    entered = threading.Event()

    def run_other() -> None:
        with _alone_if_serial(other):  # type: ignore[arg-type]
            entered.set()

    with _alone_if_serial(holder):  # type: ignore[arg-type]
        thread = threading.Thread(target=run_other)
        thread.start()
        inside = entered.wait(timeout=1.0)
    thread.join(timeout=10)
    assert entered.is_set() and not thread.is_alive()  # it does get in afterwards
    return inside


def test_a_serial_test_runs_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTEST_XDIST_TESTRUNUID", f"selftest-{uuid.uuid4().hex}")
    plain, serial = _Item(False), _Item(True)
    assert _entered_while(plain, plain)
    assert not _entered_while(serial, plain)
    assert not _entered_while(plain, serial)
    assert not _entered_while(serial, serial)


def test_a_waiting_serial_test_goes_before_the_next_plain_one(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTEST_XDIST_TESTRUNUID", f"selftest-{uuid.uuid4().hex}")
    order: list[str] = []

    def run(item: _Item, name: str) -> None:
        with _alone_if_serial(item):  # type: ignore[arg-type]
            order.append(name)

    with _alone_if_serial(_Item(False)):  # type: ignore[arg-type]
        waiting = threading.Thread(target=run, args=(_Item(True), "serial"))
        waiting.start()
        time.sleep(0.3)  # the serial test is now queued behind this one
        later = threading.Thread(target=run, args=(_Item(False), "plain"))
        later.start()
        time.sleep(0.3)
    waiting.join(timeout=10)
    later.join(timeout=10)
    assert order == ["serial", "plain"]
