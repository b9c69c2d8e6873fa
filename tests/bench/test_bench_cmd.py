"""Issue 19's bench rough edges: a step table without ddp, comm at the default --seq-len on a
short-context recipe, --model-arg for the benchmarks."""

from __future__ import annotations

import json

import pytest

from subnetdp import cli
from subnetdp.bench.report import step_table
from subnetdp.commands import bench_cmd


def _row(median: float, ratio: float | None) -> dict[str, object]:
    return {"median_step_s": median, "step_ratio_to_ddp": ratio,
            "measured_peak_bytes": 2**20, "comm": {"comm/bytes_per_step": 1e6}}


def test_step_table_without_ddp_has_no_ratio() -> None:
    # `bench step --strategies b-sdp` used to raise TypeError formatting the missing ratio
    table = step_table({"rows": {"b-sdp": _row(0.5, None), "n-sdp": _row(0.25, None)}})
    assert "| b-sdp | 0.500 | - | 1.0 |" in table
    assert "| ddp" not in table


def _comm_json(argv: list[str], capsys: pytest.CaptureFixture[str]) -> dict[str, object]:
    capsys.readouterr()
    assert cli.main(["bench", "comm", "--nproc", "2", "--json", *argv]) == 0
    return json.loads(capsys.readouterr().out)


def test_bench_comm_ignores_the_sequence(capsys: pytest.CaptureFixture[str]) -> None:
    # llama-tiny's context is 256 tokens; the default --seq-len 2048 used to be refused
    default = _comm_json([], capsys)
    short = _comm_json(["--seq-len", "32"], capsys)
    assert default["worst"] == short["worst"]


def test_bench_model_arg_changes_the_model(capsys: pytest.CaptureFixture[str]) -> None:
    # ddp: every block's gradient is all-reduced, so fewer blocks send fewer bytes
    full = _comm_json(["--strategy", "ddp"], capsys)
    half = _comm_json(["--strategy", "ddp", "--model-arg", "n_layers=4"], capsys)
    ratio = (half["worst"]["comm/bytes_per_step"]  # type: ignore[index]
             / full["worst"]["comm/bytes_per_step"])  # type: ignore[index]
    assert 0.3 < ratio < 0.8  # fewer blocks, same embeddings


def test_bench_step_spec_carries_model_args() -> None:
    args = cli.build_parser().parse_args(["bench", "step", "--nproc", "2", "--strategies",
                                          "b-sdp", "--model-arg", "dim=32",
                                          "--model-arg", "n_heads=2"])
    spec = bench_cmd._spec(args, "b-sdp", in_list=True)
    assert dict(spec.model_args) == {"dim": 32, "n_heads": 2}
