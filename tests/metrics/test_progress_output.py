"""What a user sees while `subnetdp train` runs (piped): lines from the launching process at
once, rank 0's build line, progress lines with lr and ETA from step 1, periodic validation
results, and "validating ..." before the final evaluation, in that order (issue 28, item 16)."""

from __future__ import annotations

from pathlib import Path

import pytest

from subnetdp.cli import main

pytestmark = pytest.mark.dist


def test_tiny_run_output_in_order(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    assert main(["train", "--recipe", "llama-tiny", "--batch-size", "2", "--seq-len", "32",
                 "--eval-batches", "2", "--nproc", "2", "--steps", "4", "--log-every", "2",
                 "--eval-every", "2", "--out", str(out)]) == 0
    lines = capfd.readouterr().out.splitlines()

    def first(text: str) -> int:
        found = [i for i, line in enumerate(lines) if text in line]
        assert found, f"no line with {text!r} in:\n" + "\n".join(lines)
        return found[0]

    order = [first("b-sdp on llama-tiny: 2 workers, 4 steps"),
             first("checking the model, plan and data"),
             first("starting 2 workers"),
             first("[rank 0] building the model and plan"),
             first("[rank 0] b-sdp step 1/4 | loss"),
             first("[rank 0] validation at step 2/4: val_loss"),
             first("[rank 0] b-sdp step 4/4"),
             first("[rank 0] validating the full model (2 batches)"),
             first("val_loss")]  # the summary
    assert order[:-1] == sorted(order[:-1]) and order[0] == 0
    steps = [line for line in lines if "b-sdp step" in line]
    assert len(steps) == 3  # steps 1, 2 and 4
    for line in steps:
        assert " | lr " in line and " | ETA " in line, line
