"""``bench step --sync-every H`` (issue 46): the step benchmark times local steps as whole sync
windows, so the same path (``--link``, ``--nodes``) times them on emulated networks.

One launch of 2 forked workers runs ddp (plain DiLoCo), b-sdp and b-sdp with 2 fragments at
H = 4 and ddp at H = 4 with bf16 outer gradients, 3 warm-up steps and one timed window:
the timed window syncs each unit exactly once (the counted bytes are the H = 1 reduction's
over H, halved in bf16, whatever the fragments; no gradient collective), and the step time
is the window's mean."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import pytest

from subnetdp import cli
from subnetdp.bench.step import bench_worker, run_step_bench, summarise, windows
from subnetdp.estimate.comm import analytic_comm, worst_comm
from subnetdp.estimate.spec import BenchSpec
from tests.dist.harness import run_workers

H = 4
BASE = BenchSpec(recipe="llama-tiny", strategy="ddp", world=2, batch=2, seq=32,
                 model_args=(("n_layers", 2),), sync_every=H)
SPECS = [BASE, BASE.replace(strategy="b-sdp", coverage=0.5),
         BASE.replace(strategy="b-sdp", coverage=0.5, sync_fragments=2),
         BASE.replace(strategy="ddp", outer_dtype="bf16")]


def _worker(rank: int, world: int) -> dict[str, Any]:
    out = bench_worker(SPECS[:3], H, 3, "cpu", rank, world)
    # the bf16 spec shares ddp's label: a second benchmark in the same workers
    out["bf16"] = bench_worker(SPECS[3:], H, 3, "cpu", rank, world)["comm"]
    return out


@pytest.fixture(scope="module")
def measured() -> list[dict[str, Any]]:
    return run_workers(_worker, 2)


def test_labels_name_the_window() -> None:
    assert [s.label for s in SPECS] == ["ddp H=4", "b-sdp (C=0.5) H=4", "b-sdp (C=0.5) H=4/2",
                                        "ddp H=4"]


def test_timed_window_syncs_each_unit_once(measured: list[dict[str, Any]]) -> None:
    for spec in SPECS:
        every_step = worst_comm(analytic_comm(spec.replace(sync_every=1, sync_fragments=1,
                                                              outer_dtype=None)))
        halved = 2 if spec.outer_dtype == "bf16" else 1
        for r in measured:
            got = r["bf16"]["ddp H=4"] if halved == 2 else r["comm"][spec.label]
            want = {g: v["payload"] / H / halved for g, v in every_step["by_group"].items()}
            assert {g: v["payload"] for g, v in got["by_group"].items()} == pytest.approx(
                want), spec.label


def test_step_time_is_the_windows_mean(measured: list[dict[str, Any]]) -> None:
    assert windows([1.0, 1.0, 1.0, 5.0, 2.0, 2.0, 2.0, 2.0], 4) == [2.0, 2.0]
    rows = summarise(SPECS[:3], measured)["rows"]
    for spec in SPECS[:3]:
        per_rank = [statistics.fmean(r["times"][spec.label]) for r in measured]
        assert rows[spec.label]["median_step_s"] == pytest.approx(statistics.median(per_rank))
        assert rows[spec.label]["slowest_rank_median_s"] == pytest.approx(max(per_rank))
    # the outer state (weights at the last sync, momentum) is optimizer state: AdamW's two
    # buffers and the outer step's two, per parameter of this rank
    ddp = rows["ddp H=4"]["measured_breakdown"]
    assert ddp["optimizer"] >= 4 * ddp["params"]


def test_bad_windows_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match="multiple of --sync-fragments"):
        BASE.replace(sync_fragments=3)
    with pytest.raises(ValueError, match="--fsdp shards a unit"):
        BASE.replace(strategy="b-sdp", coverage=0.5, fsdp=True)
    with pytest.raises(ValueError, match=r"--steps \(6\) must be a multiple of --sync-every"):
        run_step_bench([BASE], steps=6)
    assert cli.main(["bench", "memory", "--sync-every", "4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "bench memory does not model local steps" in err[0], err



DOCUMENTED = ("subnetdp bench step --nproc 4 --batch-size 4 --seq-len 128 --strategies ddp,b-sdp "
              "--coverage 0.5 --sync-every 32 --steps 32 --link 20mbit --nodes 2")


def test_bench_step_flags_reach_the_spec() -> None:
    """docs/benchmarks.md's ``bench step --sync-every`` line (shown, not run: it needs root)
    makes the specs the campaign times (benchmarks/local_steps.py); fragments and the wire
    dtype reach them too."""
    from subnetdp.commands import bench_cmd

    page = (Path(__file__).resolve().parents[2] / "docs" / "benchmarks.md").read_text()
    assert DOCUMENTED in page
    for extra, label in (([], ""), (["--sync-fragments", "4", "--outer-dtype", "bf16"], "/4")):
        args = cli.build_parser().parse_args([*DOCUMENTED.split()[1:], *extra])
        specs = [bench_cmd._spec(args, s, in_list=True) for s in args.strategies]
        assert [s.label for s in specs] == [f"ddp H=32{label}", f"b-sdp (C=0.5) H=32{label}"]
        assert {s.outer_dtype for s in specs} == {"bf16" if extra else None}
