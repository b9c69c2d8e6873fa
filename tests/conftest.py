import contextlib
import faulthandler
import fcntl
import os
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

# One intra-op thread per process: distributed tests run several workers on 2 cores, and
# forked workers must not inherit a live OpenMP pool.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

torch.set_num_threads(1)


# pytest-timeout's signal method cannot interrupt a test stuck inside C code (a collective that
# never completes, say). A watchdog then prints every thread's stack, names the test and ends
# pytest, so a hang costs one test's limit instead of the whole CI run: a Python thread first
# (it runs whenever the stuck call released the GIL, as waits in torch do), else faulthandler's
# own thread, which needs no GIL but cannot name the test.
_WATCHDOG_GRACE_S = 60.0
_STDERR: list[int] = []


def pytest_configure(config: pytest.Config) -> None:
    # pytest captures fd 2 while a test runs and drops what it holds when the process exits
    _STDERR.append(os.dup(2))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``long`` cases (several restarts, a minute or more on 2 cores) run only with
    ``SUBNETDP_LONG_TESTS=1`` (``make test-faults``), so ``make test`` stays fast."""
    if os.environ.get("SUBNETDP_LONG_TESTS") == "1":
        return
    skip = pytest.mark.skip(reason="long case: run with SUBNETDP_LONG_TESTS=1 (make test-faults)")
    for item in items:
        if "long" in item.keywords:
            item.add_marker(skip)


@contextlib.contextmanager
def _alone_if_serial(item: pytest.Item) -> Iterator[None]:
    """Under pytest-xdist (``make test`` runs ``-n 2``), a test marked ``serial`` runs with no
    other test at the same time: it holds a lock exclusively, every other test holds it shared.
    Such a test measures time (the emulated link's added seconds), which a second worker on
    the same 2 cores would inflate. A turnstile, held briefly by every test and throughout by
    a serial one, lets a waiting serial test in before the other worker's next test."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if run is None:  # one process: tests run one at a time anyway
        yield
        return
    folder = Path(tempfile.gettempdir()) / f"subnetdp-pytest-{run}"
    folder.mkdir(exist_ok=True)
    serial = item.get_closest_marker("serial") is not None
    with open(folder / "turnstile", "a") as turnstile, open(folder / "lock", "a") as lock:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        fcntl.flock(lock, fcntl.LOCK_EX if serial else fcntl.LOCK_SH)
        if not serial:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        yield  # the locks go with the files


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    # around set-up, call and teardown, so a module fixture's set-up holds the lock too
    with _alone_if_serial(item):
        yield


def _end_hung(nodeid: str, after: float) -> None:
    line = f"\nWATCHDOG: {nodeid} still running after {after:.0f} s; ending pytest\n".encode()
    os.write(_STDERR[0], line)
    faulthandler.dump_traceback(_STDERR[0], all_threads=True)
    os.write(_STDERR[0], line)
    os._exit(1)


@pytest.fixture(autouse=True)
def _hard_deadline(request: pytest.FixtureRequest) -> Iterator[None]:
    marker = request.node.get_closest_marker("timeout")
    limit = float((marker.args[0] if marker and marker.args else
                   request.config.getoption("timeout", None)) or 900) + _WATCHDOG_GRACE_S
    timer = threading.Timer(limit, _end_hung, (request.node.nodeid, limit))
    timer.daemon = True
    timer.start()
    faulthandler.dump_traceback_later(limit + 30, exit=True, file=_STDERR[0])
    yield
    faulthandler.cancel_dump_traceback_later()
    timer.cancel()
