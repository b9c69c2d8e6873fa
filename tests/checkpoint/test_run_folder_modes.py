"""Files a run and its exports write get the user's umask (issue 28 item 9): under umask 022
every file is 0644 and every folder 0755, so teammates on a shared filesystem read runs and
load exports; under 077 they stay the owner's (0600/0700). On 40e75c9 config.json,
summary.json (mkstemp), checkpoint shards and exports (safetensors) and the workers' log
folder (torch's mkdtemp) were owner-only whatever the umask."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]

TINY = ["--recipe", "llama-tiny", "--strategy", "ddp", "--nproc", "2", "--batch-size", "2",
        "--seq-len", "32", "--eval-batches", "1", "--memory-step", "-1", "--no-progress",
        "--steps", "2", "--ckpt-every", "2", "--model-arg", "n_layers=2", "--model-arg", "dim=32",
        "--model-arg", "ffn_hidden=64"]


def _cli(umask: int, *commands: list[str]) -> None:
    """``subnetdp ARGV`` for each ARGV of ``commands`` in turn, in one process started under
    ``umask`` (it is process-wide: the test process's own stays as it is). That process starts
    the workers' fork server, so they run under it too; one process for the train and both
    exports spares two start-ups (about 3 s of CPU each)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    script = ("import json, sys\nfrom subnetdp.cli import main\n"
              "for argv in json.loads(sys.argv[1]):\n"
              "    code = main(argv)\n"
              "    if code:\n"
              "        sys.exit(code)\n")
    done = subprocess.run([sys.executable, "-c", script, json.dumps(commands)], env=env,
                          preexec_fn=lambda: os.umask(umask), capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.parametrize(("umask", "file_mode", "dir_mode"), [(0o022, 0o644, 0o755),
                                                              (0o077, 0o600, 0o700)])
def test_run_and_exports_follow_the_umask(tmp_path: Path, umask: int, file_mode: int,
                                          dir_mode: int) -> None:
    run, export, hf = tmp_path / "run", tmp_path / "model.safetensors", tmp_path / "hf"
    _cli(umask, ["train", *TINY, "--out", str(run)], ["export", str(run), "--out", str(export)],
         ["export", str(run), "--format", "hf", "--out", str(hf)])
    written = [run, hf, *run.rglob("*"), *hf.rglob("*"), export]
    assert any(p.suffix == ".safetensors" for p in run.rglob("*"))
    assert {"config.json", "summary.json"} <= {p.name for p in run.iterdir()}
    wrong = [f"{p.relative_to(tmp_path)} {oct(stat.S_IMODE(p.stat().st_mode))}"
             for p in written
             if stat.S_IMODE(p.stat().st_mode) != (dir_mode if p.is_dir() else file_mode)]
    assert not wrong, wrong
