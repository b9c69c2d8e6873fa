"""Real gloo workers against the fake-mode estimate and the analytic bytes: the estimated peak
agrees with the measured one (within 10%; on CPU it is exact without FSDP), and the bytes the
reducers count equal the analytic accounting, by process group. Compositions (SDP + FSDP2 per
holder group + activation checkpointing, mixed precision) run on 4 workers.

[Note: the ring reduce-scatter's buffer]
gloo has no native reduce-scatter (``ProcessGroupGloo::reduce_scatter_tensor_coalesced`` clones
the whole input and all-reduces the clone), so FSDP2 over gloo reduce-scatters through
``runtime.ring`` (``GlooComms``): no clone, but one chunk buffer (``recv``, 1/h of the padded
input of a group of h ranks; the partial sums accumulate in the output). NCCL reduce-scatters in
place and the fake process group installs no ring, so the estimate (made for GPUs) leaves it
out; where it is alive at the peak, the CPU measurement exceeds the estimate by at most it. The
largest is the root's (embeddings and output layer: a 4.19 MB fp32 input). Measured (the same in
every run): ``fsdp+ac`` on 2 workers +1.26 MB (5.2%), ``b-sdp+fsdp+ac`` in bf16-mixed on 4
workers +1.05 MB (7.4%), the other FSDP specs exact; with the earlier ring's second buffer they
were +3.36 MB (12.7%) and +2.10 MB (13.7%), and gloo's clone measures +3.36 MB and +4.19 MB. So
every FSDP spec passes the 10% check, and ``test_fsdp_gap_is_the_ring_reduce_scatter_buffer``
bounds every FSDP gap by the buffer.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import pytest

from subnetdp.bench.step import bench_worker, summarise
from subnetdp.estimate.comm import analytic_comm
from subnetdp.estimate.memory import (
    FsdpLayout,
    MemoryEstimate,
    estimate_memory,
    fsdp_shard_numel,
)
from subnetdp.estimate.spec import BenchSpec, make_bench_plan, meta_model
from subnetdp.subnet.units import unit_modules
from tests.dist.harness import run_workers

BASE = BenchSpec(recipe="llama-tiny", strategy="ddp", world=2, batch=2, seq=32,
                 model_args=(("n_layers", 4),))
SPECS = [BASE, BASE.replace(strategy="b-sdp", coverage=0.5), BASE.replace(strategy="n-sdp",
         coverage=0.5), BASE.replace(strategy="bb-sdp", coverage=0.5),
         BASE.replace(strategy="fsdp+ac")]
COMPOSED_BASE = BASE.replace(strategy="b-sdp", world=4, coverage=0.5)
COMPOSED = [COMPOSED_BASE.replace(ac=True), COMPOSED_BASE.replace(fsdp=True, ac=True),
            # two layers: its estimate (narrowed pieces in FSDP modules) costs 10 times a
            # block-level one, and each layer is split alike
            COMPOSED_BASE.replace(strategy="n-sdp", fsdp=True, ac=True,
                                  model_args=(("n_layers", 2),)),
            COMPOSED_BASE.replace(strategy="fsdp+ac", coverage=1.0),
            COMPOSED_BASE.replace(zero=2)]  # ZeRO-2 inside holder groups (runtime.zero)
MIXED = [COMPOSED_BASE.replace(strategy="ddp", coverage=1.0, dtype="bf16-mixed"),
         COMPOSED_BASE.replace(ac=True, dtype="bf16-mixed"),
         COMPOSED_BASE.replace(fsdp=True, ac=True, dtype="bf16-mixed")]


def _worker(rank: int, world: int, specs: list[BenchSpec]) -> dict[str, Any]:
    return bench_worker(specs, 1, 3, "cpu", rank, world)


@pytest.fixture(scope="module")
def measured() -> list[dict[str, Any]]:
    return run_workers(_worker, 2, SPECS)


def _composed_worker(rank: int, world: int) -> dict[str, dict[str, Any]]:
    """One step benchmark per dtype (its rows are keyed by label), in the same workers."""
    return {"fp32": _worker(rank, world, COMPOSED), "bf16-mixed": _worker(rank, world, MIXED)}


@pytest.fixture(scope="module")
def measured_composed() -> dict[str, list[dict[str, Any]]]:
    """4 workers; per dtype, their results by rank."""
    runs = run_workers(_composed_worker, 4)
    return {dtype: [r[dtype] for r in runs] for dtype in ("fp32", "bf16-mixed")}


@cache
def _estimate(spec: BenchSpec) -> MemoryEstimate:
    """One estimate per spec for this module: an FSDP spec's is checked twice (within 10%, and
    its gap against the ring's buffer)."""
    return estimate_memory(spec)


def _check_close(spec: BenchSpec, measured: list[dict[str, Any]]) -> None:
    est = _estimate(spec)
    for r in measured:
        meas = r["memory"][spec.label]["peak_bytes"]
        got = est.per_rank[r["rank"]].peak_bytes
        assert abs(got - meas) <= 0.10 * meas, (spec.label, got, meas)


def _ids(spec: BenchSpec) -> str:
    return f"{spec.label} {spec.dtype}"


@pytest.mark.parametrize("spec", SPECS, ids=_ids)
def test_estimate_agrees_with_measurement(measured: list[dict[str, Any]],
                                          spec: BenchSpec) -> None:
    _check_close(spec, measured)


@pytest.mark.parametrize("spec", COMPOSED + MIXED, ids=_ids)
def test_composed_estimate_agrees_with_measurement(
        measured_composed: dict[str, list[dict[str, Any]]], spec: BenchSpec) -> None:
    _check_close(spec, measured_composed[spec.dtype])


def _ring_buffer_bytes(spec: BenchSpec) -> int:
    """Bytes of ``runtime.ring``'s chunk buffer in the largest FSDP reduce-scatter: one rank's
    share (1/h) of the padded input of a group of h ranks, in the reduce dtype. The
    groups: each unit over its holders (the baselines: each block over the world), and the
    shared parameters (the root) over the world."""
    recipe, meta = meta_model(spec)
    if spec.is_sdp:
        layout = FsdpLayout(spec, make_bench_plan(spec, meta, recipe))
        groups = [(shapes, len(layout.plan.holders(u))) for u, shapes in enumerate(layout.shapes)]
        groups.append((layout.shared, spec.world))
    else:
        blocks = unit_modules(meta, recipe.adapter)
        in_block = {id(p) for _, b in blocks for p in b.parameters()}
        groups = [([tuple(p.shape) for p in b.parameters()], spec.world) for _, b in blocks]
        groups.append(([tuple(p.shape) for p in meta.parameters() if id(p) not in in_block],
                       spec.world))
    chunk = max(sum(fsdp_shard_numel(s, h, 0) for s in shapes) for shapes, h in groups if h > 1)
    return chunk * spec.reduce_bytes


@pytest.mark.parametrize("spec", [s for s in SPECS + COMPOSED + MIXED if s.uses_fsdp],
                         ids=_ids)
def test_fsdp_gap_is_the_ring_reduce_scatter_buffer(
        measured: list[dict[str, Any]], measured_composed: dict[str, list[dict[str, Any]]],
        spec: BenchSpec) -> None:
    """The FSDP estimate is never above the gloo measurement, and below it by at most
    ``runtime.ring``'s chunk buffer of one reduce-scatter (Note: the ring reduce-scatter's
    buffer)."""
    runs = measured if spec.world == 2 else measured_composed[spec.dtype]
    est = _estimate(spec)
    buffer = _ring_buffer_bytes(spec)
    for r in runs:
        gap = r["memory"][spec.label]["peak_bytes"] - est.per_rank[r["rank"]].peak_bytes
        assert 0 <= gap <= buffer, (spec.label, gap, buffer)


@pytest.mark.parametrize("spec", SPECS[:3], ids=lambda s: s.label)
def test_counted_bytes_equal_the_analytic_accounting(measured: list[dict[str, Any]],
                                                     spec: BenchSpec) -> None:
    analytic = analytic_comm(spec)
    for r in measured:
        counted = r["comm"][spec.label]
        assert counted["by_group"] == analytic[r["rank"]]["by_group"]
        assert counted["comm/bytes_per_step"] == analytic[r["rank"]]["comm/bytes_per_step"]


@pytest.mark.parametrize("spec", [s for s in COMPOSED if s.fsdp], ids=lambda s: s.label)
def test_composed_counted_bytes_equal_the_analytic_accounting(
        measured_composed: dict[str, list[dict[str, Any]]], spec: BenchSpec) -> None:
    """SDP + FSDP: the runtime counts each group's all-gathers and reduce-scatters from its
    FSDP modules; the analytic record derives them from the plan (dims divide the groups
    here, so padding adds nothing)."""
    analytic = analytic_comm(spec)
    for r in measured_composed["fp32"]:
        counted = r["comm"][spec.label]
        assert counted["comm/bytes_per_step"] == analytic[r["rank"]]["comm/bytes_per_step"]
        assert counted["by_group"].keys() == analytic[r["rank"]]["by_group"].keys()


def test_summary_reports_ratios(measured: list[dict[str, Any]]) -> None:
    out = summarise(SPECS, measured)
    assert out["rows"]["ddp"]["step_ratio_to_ddp"] == 1.0
    assert out["rows"]["b-sdp (C=0.5)"]["measured_peak_bytes"] < out["rows"]["ddp"][
        "measured_peak_bytes"]
    _counted_like_analytic(out["rows"]["fsdp+ac"]["per_rank_comm"], SPECS[-1])


def _counted_like_analytic(counted: list[dict[str, Any]], spec: BenchSpec) -> None:
    """FSDP traffic is reported by group from the sharded sizes: the analytic groups and the
    same bytes up to FSDP's dim-0 padding (the analytic figure pads, the count does not)."""
    analytic = analytic_comm(spec)
    for rank, reported in enumerate(counted):
        expected = analytic[rank]
        assert reported["by_group"].keys() == expected["by_group"].keys()
        for key in ("comm/bytes_per_step", "comm/ring_bytes_per_step"):
            assert expected[key] * 0.99 <= reported[key] <= expected[key], key


def test_composed_comm_counted(
        measured_composed: dict[str, list[dict[str, Any]]]) -> None:
    out = summarise(COMPOSED, measured_composed["fp32"])
    # activation checkpointing changes no collective: the reducer counts plain b-sdp's bytes
    ac = COMPOSED[0]
    analytic = analytic_comm(ac.replace(ac=False))
    for r in measured_composed["fp32"]:
        assert r["comm"][ac.label]["by_group"] == analytic[r["rank"]]["by_group"]
    # composed with FSDP the wrapper reports its traffic by holder group, as the FSDP2
    # baseline does over the world
    for spec in COMPOSED[1:]:
        _counted_like_analytic(out["rows"][spec.label]["per_rank_comm"], spec)
    assert (out["rows"]["b-sdp+fsdp+ac (C=0.5)"]["measured_peak_bytes"]
            < out["rows"]["b-sdp+ac (C=0.5)"]["measured_peak_bytes"])
