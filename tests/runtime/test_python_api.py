"""Issue 28, items 12-14: the Python API in a script of one's own.

``subnetdp.init_distributed`` (a device per rank), collective calls made on some ranks only
(an error naming them), no common seed needed, ``subnetdp.save``/``load`` with exact resume,
and the documented code: docs/own-model.md (every block), examples/own_model.py under torchrun
(stop at 3 + resume to 6 == 6 straight, loss by loss) and the README's API block."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import subnetdp
from subnetdp.distributed import process_group
from subnetdp.distributed.process_group import shutdown_distributed
from subnetdp.subnet.units import describe_units
from tests.dist.harness import run_workers
from tests.dist.toy import TOY_ADAPTER, Toy, toy_batch, toy_loss

pytestmark = [pytest.mark.dist, pytest.mark.timeout(600)]
ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "own_model.py"
PAGE = ROOT / "docs" / "own-model.md"


# -- item 12: init_distributed -----------------------------------------------------------------
def test_init_distributed_plain_process_gives_the_cpu() -> None:
    assert not dist.is_initialized()
    try:
        assert subnetdp.init_distributed(backend="gloo") == torch.device("cpu")
        assert (dist.get_rank(), dist.get_world_size()) == (0, 1)
        assert subnetdp.init_distributed() == torch.device("cpu")  # idempotent: group kept
    finally:
        shutdown_distributed()


def test_init_distributed_pins_the_local_rank_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under NCCL each local rank gets its own GPU (not every rank cuda:0). No GPU here: the
    group set-up and CUDA calls are recorded instead."""
    pinned: list[torch.device] = []
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setattr(process_group, "init_distributed", lambda backend, timeout: (3, 4))
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(torch.cuda, "set_device", pinned.append)
    assert subnetdp.init_distributed() == torch.device("cuda", 3)
    assert pinned == [torch.device("cuda", 3)]


# -- item 13: collective calls on some ranks ---------------------------------------------------
def _sdp(world: int, strategy: str = "b-sdp", coverage: float = 0.5,
         meta: bool = True) -> subnetdp.SubnetDataParallel:
    if meta:
        with torch.device("meta"):
            model = Toy(n_blocks=4)
    else:
        model = Toy(n_blocks=4)
    units, shared = describe_units(model, TOY_ADAPTER)
    plan = subnetdp.make_plan(world=world, units=units, coverage=coverage, shared_size=shared)
    return subnetdp.SubnetDataParallel(model, plan=plan, adapter=TOY_ADAPTER, strategy=strategy)


def _error_of(fn: Any) -> str:
    try:
        fn()
    except RuntimeError as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def _full_state_on_rank0_only(rank: int, world: int) -> str | None:
    sdp = _sdp(world)
    if rank == 0:  # the README's old comment invited this
        return _error_of(sdp.full_state_dict)
    return None  # rank 1 goes on (here: exits)


def test_full_state_dict_on_rank0_only_names_the_ranks_that_did_not_call() -> None:
    msg = run_workers(_full_state_on_rank0_only, 2)[0]
    assert msg.startswith("CollectiveCallError: full_state_dict() is collective"), msg
    assert "rank(s) [1] did not call it" in msg and "None elsewhere" in msg


def _save_on_rank0_only(rank: int, world: int, folder: str) -> str | None:
    sdp = _sdp(world)
    opt = torch.optim.AdamW(sdp.parameters())
    if rank == 0:
        return _error_of(lambda: subnetdp.save(folder, sdp, opt, step=1))
    return None


def test_save_on_rank0_only_names_the_ranks_that_did_not_call(tmp_path: Path) -> None:
    msg = run_workers(_save_on_rank0_only, 2, str(tmp_path))[0]
    assert msg.startswith("CollectiveCallError: subnetdp.save() is collective"), msg


def _waiting_check_in(rank: int, world: int) -> list[str]:
    from subnetdp.runtime.called_by_all import called_by_all

    def call(what: str, timeout: float) -> None:
        with called_by_all(what, wait=True, timeout=timeout):
            pass

    out = [_error_of(lambda: call("d()", 60.0))]  # everyone, the same call
    # both check in, to different calls: named on both
    out.append(_error_of(lambda: call("b()" if rank == 0 else "c()", 60.0)))
    if rank == 0:  # rank 1 never checks in: named when the wait ends
        out.append(_error_of(lambda: call("a()", 1.0)))
    dist.barrier()
    return out


def test_waiting_check_in_names_missing_ranks_and_other_calls() -> None:
    """The NCCL path ([Note: collective calls on some ranks]): wait in the store first, where a
    missing peer would otherwise hang a collective."""
    r0, r1 = run_workers(_waiting_check_in, 2)
    assert r0[0] == r1[0] == "no error"
    assert "b() is collective" in r0[1] and "rank 1 called c() instead" in r0[1]
    assert "c() is collective" in r1[1] and "rank 0 called b() instead" in r1[1]
    assert "a() is collective" in r0[2] and "rank(s) [1] did not call it" in r0[2]


# -- item 14: no common seed; save and load ------------------------------------------------------
def _materialised(rank: int, world: int, strategy: str) -> dict[str, torch.Tensor]:
    torch.manual_seed(rank)  # each rank materialises the model from its own seed
    sdp = _sdp(world, strategy, coverage=0.75, meta=False)
    return {k: v.clone() for k, v in sdp.module.state_dict().items()}


@pytest.mark.parametrize("strategy", ["b-sdp", "bb-sdp"])
def test_ranks_need_no_common_seed(strategy: str) -> None:
    """A model built on each rank from its own seed: every entry two ranks both hold starts
    equal (a unit's holders get its owner's values; under backward masking, where every rank
    runs every unit, the other ranks too), before the first forward."""
    a, b = run_workers(_materialised, 2, strategy)
    common = a.keys() & b.keys()
    assert any(k.startswith("blocks.") and k.endswith("weight") for k in common)
    assert [k for k in sorted(common) if not torch.equal(a[k], b[k])] == []
    if strategy == "bb-sdp":
        assert a.keys() == b.keys()  # the full model on each rank


def _train(rank: int, world: int, folder: str, steps: int, resume: bool,
           coverage: float = 0.5) -> dict[str, Any]:
    sdp = _sdp(world, "bb-sdp", coverage)
    opt = torch.optim.AdamW(sdp.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4))
    try:
        start = subnetdp.load(folder, sdp, opt, scheduler=sched) if resume else 0
    except ValueError as e:  # CheckpointError
        return {"error": str(e)}
    losses = []
    for step in range(start + 1, steps + 1):
        x, y = toy_batch(rank, step)
        loss = toy_loss(sdp(x), y)
        loss.backward()
        sdp.clip_grad_norm_(1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    subnetdp.save(folder, sdp, opt, step=steps, scheduler=sched)
    return {"start": start, "losses": losses, "state": sdp.full_state_dict()}


def test_save_load_resumes_exactly(tmp_path: Path) -> None:
    """bb-sdp with AdamW, clipping and a warm-up schedule: 3 steps, save, load into a fresh
    model and optimizer, 3 more == 6 straight (bit for bit), on every rank."""
    straight = run_workers(_train, 2, str(tmp_path / "a"), 6, False)
    run_workers(_train, 2, str(tmp_path / "b"), 3, False)
    resumed = run_workers(_train, 2, str(tmp_path / "b"), 6, True)
    assert [r["start"] for r in resumed] == [3, 3]
    for rank in range(2):
        assert resumed[rank]["losses"] == straight[rank]["losses"][3:]
    full, want = resumed[0]["state"], straight[0]["state"]
    assert full.keys() == want.keys() and all(torch.equal(full[k], want[k]) for k in full)
    # another plan (coverage 0.75) is refused on every rank, nothing loaded
    refused = run_workers(_train, 2, str(tmp_path / "b"), 8, True, 0.75)
    assert all("different plan" in r["error"] for r in refused)


# -- the documented code: docs/own-model.md, examples/own_model.py, the README block ----------
def _env() -> dict[str, str]:
    bin_dir = str(Path(sys.executable).parent)  # torchrun and subnetdp of this environment
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path),
            "PATH": bin_dir + os.pathsep + os.environ.get("PATH", "")}


def _shell(line: str, cwd: Path) -> str:
    p = subprocess.run(line, shell=True, cwd=cwd, env=_env(), capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, f"{line}\n{p.stdout}\n{p.stderr[-3000:]}"
    return p.stdout


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", PAGE.read_text(), flags=re.S)


def test_page_commands_run_the_example_and_resume_exactly(tmp_path: Path) -> None:
    """The page's shell block, line by line as written (torchrun, 2 processes, gloo): stopping
    at 3 and resuming to 6 prints the 6-step run's losses and full-model validation loss."""
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    [commands] = _blocks("bash")
    lines = [ln for ln in commands.splitlines() if ln.strip() and not ln.startswith("#")]
    assert len(lines) == 4 and "--steps 6 --ckpt runs/a" in lines[0]
    straight, first, resumed, export = (_shell(ln, tmp_path) for ln in lines)
    steps = [re.findall(r"^step (\d+) loss (\S+)$", out, flags=re.M)
             for out in (straight, first, resumed)]
    assert [int(s) for s, _ in steps[0]] == [1, 2, 3, 4, 5, 6]
    assert steps[1] + steps[2] == steps[0]  # the same float reprs: bit-identical
    val = [re.search(r"^full model: validation loss (\S+)", out, flags=re.M)
           for out in (straight, resumed)]
    assert val[0] and val[1] and val[0][1] == val[1][1]
    assert "exported step 6" in export
    # the export loads into the plain model class, as the page says
    from safetensors.torch import load_file

    spec = importlib.util.spec_from_file_location("own_model", EXAMPLE)
    assert spec is not None and spec.loader is not None
    own = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(own)
    own.ResidualMLP().load_state_dict(load_file(tmp_path / "own.safetensors"))


def test_page_python_blocks_are_the_example_or_run(tmp_path: Path) -> None:
    """Every Python block of the page is a verbatim excerpt of examples/own_model.py (run by
    the test above) or runs on its own as a one-process script."""
    source = EXAMPLE.read_text()
    # a block, and the output block right after it if any
    blocks = re.findall(r"```python\n(.*?)```\n(?:\n```text\n(.*?)```)?", PAGE.read_text(),
                        flags=re.S)
    assert len(blocks) == len(_blocks("python"))
    standalone = [(b, out) for b, out in blocks
                  if b not in source and textwrap.indent(b, "    ") not in source]
    assert standalone, "the page has a block of its own (choosing a plan)"
    for i, (block, out) in enumerate(standalone):
        script = tmp_path / f"block{i}.py"
        script.write_text(block)
        printed = _shell(f"{sys.executable} {script}", tmp_path)
        assert not out or printed == out  # the page shows what it prints
