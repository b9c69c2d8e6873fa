"""Which options a `subnetdp train` command line gives explicitly (what a resume must honour)."""

from __future__ import annotations

from subnetdp.cli import build_parser
from subnetdp.commands.train_cmd import _explicit_options


def _explicit(argv: list[str], *, keep_argv: bool = True) -> set[str]:
    args = build_parser().parse_args(argv)
    if keep_argv:
        args.argv = argv
    return _explicit_options(args)


def test_options_equal_to_their_default_still_count() -> None:
    argv = ["train", "--resume", "runs/x", "--coverage", "0.5", "--steps", "20",
            "--no-progress", "--model-arg", "dim=8", "--out", "runs/x"]
    # --coverage 0.5 is the default, yet it was given: a resumed 0.25 run must refuse it
    assert _explicit(argv) == {"coverage", "steps", "progress", "model_args", "out"}
    # without the raw command line only values that differ from the defaults are visible
    assert "coverage" not in _explicit(argv, keep_argv=False)
    assert _explicit(["train", "--resume", "runs/x"]) == set()
