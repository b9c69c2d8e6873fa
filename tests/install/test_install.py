"""A new user's first minutes: `pip install .` into a fresh virtual environment, then a tiny
`subnetdp train` on a folder of text files, with nothing from the development setup visible.

The pinned CPU torch comes from this environment's own installation (linked into the new
venv's site-packages: copying the 200 MB wheel in takes minutes on a loaded 2-core machine);
everything else, subnetdp's dependencies and torch's, pip installs from pyproject.toml as it
would for a user. Runs in `make test` (marked slow: about a minute).
"""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import subprocess
import venv
from pathlib import Path

import pytest

import subnetdp

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _link_torch(site: Path) -> None:
    torch_dist = md.distribution("torch")
    tops = {str(f).split("/")[0] for f in torch_dist.files or [] if not str(f).startswith("..")}
    root = Path(str(torch_dist.locate_file("")))
    for top in sorted(tops):
        (site / top).symlink_to(root / top)


def test_pip_install_then_train_on_a_text_folder(tmp_path: Path) -> None:
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True, symlinks=True).create(env_dir)
    py = env_dir / "bin" / "python"
    site = Path(subprocess.check_output(
        [py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True
    ).strip())
    _link_torch(site)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(OMP_NUM_THREADS="1", SUBNETDP_CACHE=str(tmp_path / "cache"),
               PIP_DISABLE_PIP_VERSION_CHECK="1")
    # a copy of the tree, so that the build leaves nothing in the checkout
    src = tmp_path / "src-copy"
    files = subprocess.run(["git", "-C", str(ROOT), "ls-files", "--cached", "--others",
                            "--exclude-standard"], check=True, capture_output=True,
                           text=True).stdout.split()
    for rel in files:
        if (ROOT / rel).is_file():
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            (src / rel).write_bytes((ROOT / rel).read_bytes())
    pip = subprocess.run([py, "-m", "pip", "install", "--quiet", str(src)], env=env,
                         capture_output=True, text=True, timeout=600)
    assert pip.returncode == 0, pip.stderr[-3000:]

    text = tmp_path / "text"
    text.mkdir()
    words = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while",
             "seven", "kings", "sing"]
    for i in range(12):
        (text / f"doc{i}.txt").write_text(" ".join(words[(i + j) % len(words)]
                                                    for j in range(400)))
    out = tmp_path / "run"
    train = subprocess.run(
        [env_dir / "bin" / "subnetdp", "train", "--recipe", "llama-tiny", "--strategy", "b-sdp",
         "--nproc", "2", "--steps", "3", "--batch-size", "2", "--seq-len", "32",
         "--eval-batches", "1", "--no-progress", "--data-dir", str(text), "--out", str(out)],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert train.returncode == 0, train.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world"] == 2 and 0 < summary["val_loss"] < 20

    where = subprocess.run([py, "-c", "import subnetdp, pathlib; p = pathlib.Path("
                            "subnetdp.__file__).parent; t = p / 'evals' / 'lm_eval_tasks'; "
                            "print(p, (p / 'py.typed').exists(), subnetdp.__version__, "
                            "len(list(t.glob('*.yaml'))), (t / '_template_yaml').exists(), "
                            "(t / 'utils.py').exists())"], env=env, cwd=tmp_path,
                           capture_output=True, text=True, check=True).stdout.split()
    assert Path(where[0]).is_relative_to(env_dir) and where[1] == "True"
    assert where[2] == subnetdp.__version__
    # the lm-eval task configs (package data): lm_eval --include_path reads them there
    assert where[3:] == ["10", "True", "True"]
