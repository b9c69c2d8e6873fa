"""The supported torch range: ``subnetdp.torch_compat`` runs both of its branches on the pinned
torch (the newer name hidden, as an older release lacks it), and ``import subnetdp`` refuses a
torch below the floor in one line. ``make test-torch TORCH=X`` runs this file on X as well."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import tomllib
import torch
import torch.distributed as dist

import subnetdp
from subnetdp import torch_compat
from subnetdp.runtime import ring
from tests.dist.harness import run_workers

REPO = Path(__file__).resolve().parents[2]
NEWER = ("reduce_scatter_single", "all_gather_single")  # torch 2.13's names
OLDER = ("reduce_scatter_tensor", "all_gather_into_tensor")  # the only ones before 2.13


def _collectives(rank: int, world: int) -> dict[str, dict[str, Any]]:
    """Both collectives through torch_compat, once with torch's newer names ("present", where
    this torch has them) and once with them hidden, and which torch functions ran."""
    saved = {n: getattr(dist, n) for n in NEWER + OLDER if hasattr(dist, n)}
    out: dict[str, dict[str, Any]] = {}
    for case in ("present", "hidden"):
        if case == "present" and not set(NEWER) <= set(saved):
            continue  # an older torch has the one branch, run as "hidden"
        ran: list[str] = []
        for name, fn in saved.items():
            def counted(*a: Any, _fn: Any = fn, _name: str = name, _ran: list[str] = ran,
                        **k: Any) -> Any:
                _ran.append(_name)
                return _fn(*a, **k)
            setattr(dist, name, counted)
        try:
            for name in NEWER if case == "hidden" else ():
                if hasattr(dist, name):
                    delattr(dist, name)
            mine = torch.arange(4.0 * world) * (rank + 1)
            rs = torch.full((4,), float("nan"))
            work = torch_compat.reduce_scatter_single(rs, mine, async_op=True)
            assert work is not None
            work.wait()
            ag = torch.full((3 * world,), float("nan"))
            torch_compat.all_gather_single(ag, torch.full((3,), float(rank)))
            out[case] = {"rs": rs, "ag": ag, "ran": ran}
        finally:
            for name, fn in saved.items():
                setattr(dist, name, fn)
    return out


def test_collectives_give_the_same_result_through_either_torch_name() -> None:
    results = run_workers(_collectives, 2)
    world = 2
    has_newer = all(hasattr(dist, n) for n in NEWER)
    for rank, cases in enumerate(results):
        assert set(cases) == ({"present", "hidden"} if has_newer else {"hidden"})
        # by hand: the sum over ranks r of (r+1) * arange, chunk `rank`; ranks' 3-vectors
        want_rs = torch.arange(4.0 * world)[4 * rank: 4 * rank + 4] * sum(range(1, world + 1))
        want_ag = torch.tensor([float(r) for r in range(world) for _ in range(3)])
        for case, got in cases.items():
            assert torch.equal(got["rs"], want_rs), case
            assert torch.equal(got["ag"], want_ag), case
        assert cases["hidden"]["ran"] == list(OLDER)
        if has_newer:
            assert cases["present"]["ran"] == list(NEWER)


class _Group:
    def size(self) -> int:
        return 2


class _Mesh:
    def get_group(self) -> _Group:
        return _Group()


class _Module:
    """What GlooComms.apply calls on an FSDP2 module, recorded."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def _set_unshard_async_op(self, async_op: bool) -> None:
        self.calls.append(("unshard async", async_op))


class _HookedModule(_Module):
    def set_custom_reduce_scatter(self, comm: Any) -> None:
        self.calls.append(("reduce-scatter", type(comm)))


def test_gloo_comms_install_the_ring_only_where_fsdp2_takes_a_hook(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """torch >= 2.9 takes runtime.ring's reduce-scatter; an older FSDP2 (no
    ``set_custom_reduce_scatter``) keeps gloo's and still gets asynchronous all-gathers."""
    monkeypatch.setattr(ring.dist, "get_backend", lambda pg: dist.Backend.GLOO)
    hooked, older = _HookedModule(), _Module()
    ring.GLOO_DEFAULTS.apply(hooked, _Mesh())  # type: ignore[arg-type]
    ring.GLOO_DEFAULTS.apply(older, _Mesh())  # type: ignore[arg-type]
    assert hooked.calls == [("reduce-scatter", ring.RingReduceScatter), ("unshard async", True)]
    assert older.calls == [("unshard async", True)]


def test_torch_compat_imports_without_fsdp2s_hook_interface(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Before torch 2.9 FSDP2's private ``_fsdp_api`` has no ``ReduceScatter``: torch_compat
    (and so runtime.ring) still imports, with a stand-in base class."""
    from torch.distributed.fsdp._fully_shard import _fsdp_api

    real = getattr(_fsdp_api, "ReduceScatter", None)
    try:
        if real is not None:
            monkeypatch.delattr(_fsdp_api, "ReduceScatter")
        stand_in = importlib.reload(torch_compat).ReduceScatter
        assert stand_in is not real and stand_in.__module__ == "subnetdp.torch_compat"
        with pytest.raises(NotImplementedError):
            stand_in().allocate((1,), dtype=torch.float32, device=torch.device("cpu"))
    finally:
        monkeypatch.undo()
        restored = importlib.reload(torch_compat).ReduceScatter
    assert restored is real if real is not None else restored.__module__ == stand_in.__module__


def test_launch_grace_where_launch_config_takes_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch elastic's ``shutdown_timeout`` where ``LaunchConfig`` has it; else nothing (its
    agent's fixed grace), and the config still builds."""
    from torch.distributed.launcher.api import LaunchConfig

    fields = dict(LaunchConfig.__dataclass_fields__)
    if "shutdown_timeout" in fields:
        config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=1,
                              **torch_compat.launch_grace(17))
        assert config.shutdown_timeout == 17
        fields.pop("shutdown_timeout")
        monkeypatch.setattr(LaunchConfig, "__dataclass_fields__", fields)
    assert torch_compat.launch_grace(17) == {}


MAJOR, MINOR = subnetdp.TORCH_FLOOR
FLOOR = f"{MAJOR}.{MINOR}"
REFUSAL = f"subnetdp needs torch >= {FLOOR} (found {{}}): pip install 'torch>={FLOOR}'"


@pytest.mark.parametrize(("found", "ok"), [
    ("1.13.1+cu117", False), (f"{MAJOR}.{MINOR - 1}.1+cu124", False), (None, False),
    (f"{FLOOR}.0", True), (f"{FLOOR}.1+cu126", True), (f"{MAJOR}.{MINOR + 1}.0a0+git12", True),
    (f"{MAJOR + 1}.0.0", True)])
def test_check_torch_refuses_below_the_floor(found: str | None, ok: bool) -> None:
    if ok:
        subnetdp._check_torch(found)
        return
    with pytest.raises(subnetdp.TorchTooOldError) as e:
        subnetdp._check_torch(found)
    assert str(e.value) == REFUSAL.format(found or "none")


def test_a_command_under_an_old_torch_prints_one_line(tmp_path: Path) -> None:
    """The metadata of a torch 2.5.1 first on the path: the command stops at ``import
    subnetdp``, before importing torch, with the one line and nothing else."""
    info = tmp_path / "torch-2.5.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 2.5.1\n")
    env = {"PYTHONPATH": f"{tmp_path}:{REPO / 'src'}", "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-m", "subnetdp.cli", "--version"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert done.stdout == ""
    assert done.stderr == f"error: {REFUSAL.format('2.5.1')}\n"


def test_pyproject_declares_the_floor_and_the_tested_range() -> None:
    """pyproject.toml's torch range starts at the floor that ``import subnetdp`` checks and
    admits the newest torch docs/testing.md reports tested (2.15)."""
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    floor = ".".join(map(str, subnetdp.TORCH_FLOOR))
    assert [d for d in deps if d.startswith("torch")] == [f"torch>={floor},<2.16"]
