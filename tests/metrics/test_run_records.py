"""What a run writes and prints (issue 28 items 3 and 10): steps are counted from 1 in the
JSONL files, TensorBoard and on the console alike, and a finished run exits 0 with its summary
even when no step was timed (the untimed figures are null, not invented).

One short run (3 steps, a checkpoint at 3) and two resumes of it to step 4 serve every check.
"""

from __future__ import annotations

import contextlib
import json
import re
from pathlib import Path

import pytest

from subnetdp.cli import main
from subnetdp.metrics.sinks import rank_jsonl_path, read_jsonl, val_jsonl_path
from subnetdp.metrics.tracking import GLOBAL_AVG_LOSS

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]

TINY = ["--recipe", "llama-tiny", "--strategy", "ddp", "--nproc", "1", "--batch-size", "2",
        "--seq-len", "32", "--eval-batches", "2", "--log-every", "1",
        "--model-arg", "n_layers=2", "--model-arg", "dim=32", "--model-arg", "ffn_hidden=64"]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A 3-step run with TensorBoard and a checkpoint at step 3; its console output."""
    out = tmp_path_factory.mktemp("records") / "run"
    capture = tmp_path_factory.mktemp("console") / "stdout"
    with open(capture, "w") as f, contextlib.redirect_stdout(f):
        code = main(["train", *TINY, "--steps", "3", "--ckpt-every", "3", "--tensorboard",
                     "--out", str(out)])
    assert code == 0
    return out, capture.read_text()


def test_steps_count_from_one_everywhere(run: tuple[Path, str]) -> None:
    out, console = run
    rows = read_jsonl(rank_jsonl_path(out, 0))
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert [r["step"] for r in read_jsonl(val_jsonl_path(out))] == [3]  # after the 3rd step
    # the console's "step N" line shows the loss of the JSONL's step N
    lines = re.finditer(r"ddp step (\d+)/3 \| loss (\S+)", console)
    printed = {int(m[1]): m[2] for m in lines}
    assert printed == {r["step"]: f"{r['loss']:.4f}" for r in rows}
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(out / "tensorboard"))
    acc.Reload()
    events = acc.Scalars(GLOBAL_AVG_LOSS)
    assert [e.step for e in events] == [1, 2, 3]
    assert [e.value for e in events] == pytest.approx([r[GLOBAL_AVG_LOSS] for r in rows])
    assert [e.step for e in acc.Scalars("val_loss")] == [3]


def test_a_resume_with_no_timed_step_exits_0_with_its_summary(
    run: tuple[Path, str], capsys: pytest.CaptureFixture[str]
) -> None:
    out, _ = run
    ckpt = out / "checkpoints" / "step_00000003"
    # the reproduction: resume from step 3 to 4 with the default --memory-step 3
    assert main(["train", "--resume", str(ckpt), "--steps", "4"]) == 0
    assert json.loads((out / "summary.json").read_text())["steps"] == 4
    assert [r["step"] for r in read_jsonl(rank_jsonl_path(out, 0))] == [1, 2, 3, 4]
    capsys.readouterr()
    # the one step run is the memory step, which is not timed
    assert main(["train", "--resume", str(ckpt), "--steps", "4", "--memory-step", "4"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["val_loss"] > 0
    assert summary["step_time_s"] is None and summary["throughput(tps)"] is None
    assert summary["per_rank"][0]["peak_memory_bytes"] > 0  # measured on step 4
    printed = capsys.readouterr().out
    assert "step time          not measured" in printed and "nan" not in printed
    assert [r["step"] for r in read_jsonl(rank_jsonl_path(out, 0))] == [1, 2, 3, 4]
