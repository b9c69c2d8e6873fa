"""Real gloo workers against the fake-mode estimate and the analytic bytes: the estimated peak
agrees with the measured one (within 10%; on CPU it is exact without FSDP), and the bytes the
reducers count equal the analytic accounting, by process group. Compositions (SDP + FSDP2 per
holder group + activation checkpointing, mixed precision) run on 4 workers.

[Note: gloo's reduce-scatter clone]
gloo has no native reduce-scatter: ``ProcessGroupGloo::reduce_scatter_tensor_coalesced`` clones
the whole input, all-reduces the clone and copies this rank's chunk out, so every FSDP2
reduce-scatter on CPU holds one extra unsharded-gradient-sized buffer until it completes. NCCL
reduce-scatters in place and the fake process group allocates nothing, so the estimate (made
for GPUs) leaves it out; when the largest reduce-scatter (the root's: embeddings and output
layer) is at the peak, the CPU measurement exceeds the estimate by up to that buffer (about 11%
on these tiny models, where the embeddings are a large share). So FSDP's 10% check is a non-strict
xfail on gloo, and ``test_fsdp_gap_is_gloo_reduce_scatter_clone`` bounds the gap by the clone.
"""

from __future__ import annotations

import math
from functools import cache
from typing import Any

import pytest

from subnetdp.bench.step import bench_worker, summarise
from subnetdp.estimate.comm import analytic_comm
from subnetdp.estimate.memory import MemoryEstimate, estimate_memory
from subnetdp.estimate.spec import BenchSpec, meta_model
from subnetdp.subnet.units import unit_modules
from tests.dist.harness import run_workers

BASE = BenchSpec(recipe="llama-tiny", strategy="ddp", world=2, batch=2, seq=32,
                 model_args=(("n_layers", 4),))
SPECS = [BASE, BASE.replace(strategy="b-sdp", coverage=0.5), BASE.replace(strategy="n-sdp",
         coverage=0.5), BASE.replace(strategy="bb-sdp", coverage=0.5),
         BASE.replace(strategy="fsdp+ac")]
GLOO_RS_CLONE = pytest.mark.xfail(reason="gloo's reduce-scatter clones its input; NCCL and the "
                                  "estimate do not (Note: gloo's reduce-scatter clone)",
                                  strict=False)
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


@pytest.fixture(scope="module")
def measured_composed() -> dict[str, list[dict[str, Any]]]:
    """4 workers; one run per dtype (a step benchmark's rows are keyed by label)."""
    return {"fp32": run_workers(_worker, 4, COMPOSED),
            "bf16-mixed": run_workers(_worker, 4, MIXED)}


@cache
def _estimate(spec: BenchSpec) -> MemoryEstimate:
    """One estimate per spec for this module: an FSDP spec's is checked twice (within 10%, and
    its gap against gloo's clone)."""
    return estimate_memory(spec)


def _check_close(spec: BenchSpec, measured: list[dict[str, Any]]) -> None:
    est = _estimate(spec)
    for r in measured:
        meas = r["memory"][spec.label]["peak_bytes"]
        got = est.per_rank[r["rank"]].peak_bytes
        assert abs(got - meas) <= 0.10 * meas, (spec.label, got, meas)


def _xfail_fsdp(specs: list[BenchSpec]) -> list[Any]:
    return [pytest.param(s, marks=GLOO_RS_CLONE, id=f"{s.label} {s.dtype}") if s.uses_fsdp
            else pytest.param(s, id=f"{s.label} {s.dtype}") for s in specs]


@pytest.mark.parametrize("spec", _xfail_fsdp(SPECS))
def test_estimate_agrees_with_measurement(measured: list[dict[str, Any]],
                                          spec: BenchSpec) -> None:
    _check_close(spec, measured)


@pytest.mark.parametrize("spec", _xfail_fsdp(COMPOSED + MIXED))
def test_composed_estimate_agrees_with_measurement(
        measured_composed: dict[str, list[dict[str, Any]]], spec: BenchSpec) -> None:
    _check_close(spec, measured_composed[spec.dtype])


def _largest_reduce_scatter_bytes(spec: BenchSpec) -> int:
    """Bytes of the largest FSDP reduce-scatter input: any unit over the world (an upper bound
    for a holder group) or the root's shared parameters, padded, in the reduce dtype."""
    recipe, meta = meta_model(spec)
    blocks = unit_modules(meta, recipe.adapter)
    in_block = {id(p) for _, b in blocks for p in b.parameters()}

    def padded(params: Any) -> int:
        return sum(-(-p.shape[0] // spec.world) * spec.world * math.prod(p.shape[1:])
                   for p in params)

    root = padded(p for p in meta.parameters() if id(p) not in in_block)
    unit = max(padded(b.parameters()) for _, b in blocks)
    return max(root, unit) * spec.reduce_bytes


@pytest.mark.parametrize("spec", [s for s in SPECS + COMPOSED + MIXED if s.uses_fsdp],
                         ids=lambda s: f"{s.label} {s.dtype}")
def test_fsdp_gap_is_gloo_reduce_scatter_clone(
        measured: list[dict[str, Any]], measured_composed: dict[str, list[dict[str, Any]]],
        spec: BenchSpec) -> None:
    """The FSDP estimate is never above the gloo measurement, and below it by at most gloo's
    clone of one reduce-scatter input (Note: gloo's reduce-scatter clone)."""
    runs = measured if spec.world == 2 else measured_composed[spec.dtype]
    est = _estimate(spec)
    clone = _largest_reduce_scatter_bytes(spec)
    for r in runs:
        gap = r["memory"][spec.label]["peak_bytes"] - est.per_rank[r["rank"]].peak_bytes
        assert 0 <= gap <= clone, (spec.label, gap, clone)


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
