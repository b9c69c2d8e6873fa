"""The supported torch range: ``subnetdp.torch_compat`` runs both of its branches on the pinned
torch (the newer name hidden, as an older release lacks it), and ``import subnetdp`` refuses a
torch below the floor in one line. ``make test-torch TORCH=X`` runs this file on X as well."""

from __future__ import annotations

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
from subnetdp.estimate.spec import BenchSpec, build_rank, lm_step
from tests.dist.harness import run_workers

REPO = Path(__file__).resolve().parents[2]
NEWER = ("reduce_scatter_single", "all_gather_single")  # torch 2.13's names
OLDER = ("reduce_scatter_tensor", "all_gather_into_tensor")  # the only ones before 2.13
MODEL = (("dim", 16), ("ffn_hidden", 24), ("max_seq_len", 16), ("n_heads", 2),
         ("n_layers", 2), ("vocab_size", 61))


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
            collectives = list(ran)
            # ZeRO-2 in one holder group of both ranks: its reduce-scatter and all-gather
            spec = BenchSpec("llama-tiny", "b-sdp", world, 2, 16, zero=2, model_args=MODEL)
            built = build_rank(spec)
            g = torch.Generator().manual_seed(rank)
            losses = [lm_step(built, torch.randint(0, 61, (2, 17), generator=g))
                      for _ in range(2)]
            out[case] = {"rs": rs, "ag": ag, "ran": collectives, "losses": losses,
                         "zero ran": sorted(set(ran[len(collectives):]))}
        finally:
            for name, fn in saved.items():
                setattr(dist, name, fn)
    return out


def test_collectives_give_the_same_result_through_either_torch_name() -> None:
    """torch_compat's collectives by hand, and a ZeRO-2 step (the reducer's reduce-scatter,
    the optimizer's all-gather) that trains the same without torch 2.13's names."""
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
        assert cases["hidden"]["zero ran"] == sorted(OLDER)  # no caller asks for a newer name
        if has_newer:
            assert cases["present"]["ran"] == list(NEWER)
            assert cases["present"]["zero ran"] == sorted(NEWER)
            assert cases["present"]["losses"] == cases["hidden"]["losses"]  # bit for bit


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
