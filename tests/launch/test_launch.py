"""launch(): local gloo workers through torch's elastic launcher, return values, failures."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from subnetdp.distributed.launch import WorkerFailedError, launch
from subnetdp.distributed.process_group import (
    init_distributed,
    shutdown_distributed,
    under_launcher,
)

pytestmark = [pytest.mark.dist, pytest.mark.timeout(120)]


def _all_reduce_worker(offset: float) -> tuple[int, int, float, int, bool]:
    rank, world = init_distributed("gloo")
    t = torch.tensor([rank + offset])
    dist.all_reduce(t)
    threads = torch.get_num_threads()
    shutdown_distributed()
    return rank, world, float(t.item()), threads, under_launcher()


def _failing_worker() -> int:
    rank, _ = init_distributed("gloo")
    if rank == 1:
        raise ValueError("deliberate failure on rank 1")
    return rank


def test_launch_two_workers_all_reduce() -> None:
    handler = signal.getsignal(signal.SIGINT)
    t0 = time.perf_counter()
    out = launch(_all_reduce_worker, (10.0,), nproc=2, run_id="test_launch")
    print(f"launch overhead, 2 workers (forkserver): {time.perf_counter() - t0:.2f}s")
    assert out == {
        0: (0, 2, 21.0, 1, True),  # (0+10) + (1+10); OMP_NUM_THREADS=1 applied in workers
        1: (1, 2, 21.0, 1, True),
    }
    # The elastic agent's side effects on this process are undone.
    assert signal.getsignal(signal.SIGINT) == handler
    assert not under_launcher() and "TORCHELASTIC_SIGNALS_TO_HANDLE" not in os.environ


def _env_worker(names: tuple[str, ...]) -> dict[str, str | None]:
    init_distributed("gloo")  # over the loopback interface
    dist.barrier()
    shutdown_distributed()
    return {n: os.environ.get(n) for n in names}


def test_workers_see_the_launch_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each launch's workers see this process's environment as it is at that launch (a fork
    server's children would otherwise see it as it was at the server's start), with the
    agent's own variables intact; gloo runs over loopback."""
    names = ("SUBNETDP_TEST_VAR", "MASTER_ADDR", "GLOO_SOCKET_IFNAME", "RANK")
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    first = launch(_env_worker, (names,), nproc=2, run_id="test_env_1")
    monkeypatch.setenv("SUBNETDP_TEST_VAR", "set after the first launch")
    monkeypatch.setenv("MASTER_ADDR", "192.0.2.1")  # the agent's own wins
    second = launch(_env_worker, (names,), nproc=2, run_id="test_env_2")
    assert [first[r]["SUBNETDP_TEST_VAR"] for r in (0, 1)] == [None, None]
    assert [second[r]["SUBNETDP_TEST_VAR"] for r in (0, 1)] == ["set after the first launch"] * 2
    assert {second[r]["MASTER_ADDR"] for r in (0, 1)} == {"127.0.0.1"}
    assert [second[r]["RANK"] for r in (0, 1)] == ["0", "1"]
    assert {first[r]["GLOO_SOCKET_IFNAME"] for r in (0, 1)} == {"lo"}
    assert "GLOO_SOCKET_IFNAME" not in os.environ  # the default is the workers' only


def test_launch_spawn() -> None:
    # spawn is what launch() picks once CUDA or a process group exists in the parent; one
    # worker keeps the cost to a single fresh `import torch`.
    t0 = time.perf_counter()
    out = launch(_all_reduce_worker, (1.0,), nproc=1, run_id="test_spawn", start_method="spawn")
    print(f"launch overhead, 1 worker (spawn): {time.perf_counter() - t0:.2f}s")
    assert out == {0: (0, 1, 1.0, 1, True)}


def test_launch_failure_names_rank_and_traceback() -> None:
    with pytest.raises(WorkerFailedError) as info:
        launch(_failing_worker, (), nproc=2, run_id="test_launch_fail")
    msg = str(info.value)
    assert "rank 1 (exit code 1)" in msg
    assert "ValueError: deliberate failure on rank 1" in msg
    assert "_failing_worker" in msg  # the worker's own traceback, not only the launcher's
    assert list(info.value.failures) == [1]


def test_launch_writes_worker_logs(tmp_path: Path) -> None:
    def hello() -> int:  # a closure: needs the fork start method (the default pickles fn)
        print("hello from a worker", flush=True)
        return 7

    out = launch(hello, (), nproc=1, run_id="test_logs", log_dir=str(tmp_path),
                 start_method="fork")
    assert out == {0: 7}
    logs = [p.read_text() for p in tmp_path.rglob("stdout.log")]
    assert any("hello from a worker" in t for t in logs)


def test_init_distributed_single_process_fallback() -> None:
    # Outside any launcher: a one-process group, so training code runs as a plain script.
    assert not dist.is_initialized()
    try:
        assert init_distributed("gloo") == (0, 1)
        assert init_distributed("gloo") == (0, 1)  # idempotent
    finally:
        shutdown_distributed()
    assert not dist.is_initialized()


def test_launch_rejects_bad_nproc() -> None:
    with pytest.raises(ValueError, match="nproc"):
        launch(_failing_worker, (), nproc=0, run_id="x")
