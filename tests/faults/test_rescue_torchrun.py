"""Rescue under ``torchrun`` on one machine ([Note: rescue]): 4 workers of a ``--min-holders 2``
run under torch's own agent, one SIGKILLed (``SUBNETDP_FAULT``) after the commit of step 4. The
agent gives the run up (``--max-restarts 0``), but the survivors have saved their contributions
under ``rescue/``; composing them (what the local launcher does, by hand here) gives the
checkpoint an uninterrupted torchrun run writes at step 4, tensor for tensor. Two launches of
4 workers: ``long`` only (``make test-faults``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from subnetdp.checkpoint.files import read_manifest, step_dir
from subnetdp.checkpoint.rescue import compose_rescue
from subnetdp.distributed import faults
from tests.faults.harness import REPO, long_faults
from tests.faults.test_rescue_oracle import TINY, _tensors


def _torchrun(args: list[str], tmp: Path,
              fault: str | None = None) -> subprocess.CompletedProcess[str]:
    # TMPDIR: the survivors' error logs of the lost peer stay in the test's folder
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1",
           "TMPDIR": str(tmp)}
    env.pop(faults.ENV, None)
    if fault:
        env[faults.ENV] = fault
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
         "-m", "subnetdp.cli", "train", *TINY, "--strategy", "b-sdp", *args],
        env=env, capture_output=True, text=True, check=False, timeout=600)


@long_faults
@pytest.mark.dist
@pytest.mark.timeout(900)
def test_torchrun_survivors_contributions_compose_to_the_reference(tmp_path: Path) -> None:
    ref, run = tmp_path / "reference", tmp_path / "killed"
    done = _torchrun(["--ckpt-every", "1", "--ckpt-keep", "9", "--out", str(ref)], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    done = _torchrun(["--min-nproc", "3", "--ckpt-every", "2", "--out", str(run)],
                     tmp_path, fault="2:4:optimizer:kill")
    assert done.returncode != 0  # torchrun's agent gives up; it does not compose
    # each survivor says it lost a peer (not "internal error", as gloo's RuntimeError was)
    assert "internal error" not in done.stderr, done.stderr[-3000:]
    assert "lost its connection to another rank" in done.stderr, done.stderr[-3000:]
    assert not step_dir(run / "checkpoints", 4).exists()
    ckpt, step, survivors = compose_rescue(run)
    assert (step, survivors) == (4, [0, 1, 3])
    assert ckpt == step_dir(run / "checkpoints", 4)
    rescued, reference = _tensors(ckpt), _tensors(step_dir(ref / "checkpoints", 4))
    assert rescued.keys() == reference.keys()
    for k, t in reference.items():  # bit for bit, in the same rank files
        assert torch.equal(rescued[k].view(-1).view(torch.uint8), t.view(-1).view(torch.uint8)), k
    ma, mb = read_manifest(ckpt), read_manifest(step_dir(ref / "checkpoints", 4))
    for key in ("step", "world", "plan", "model_state", "optimizer"):
        assert ma[key] == mb[key], key
