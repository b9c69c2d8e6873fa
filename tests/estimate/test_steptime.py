"""The step-time model (estimate.steptime), the cluster description (estimate.cluster) and the
strategy advisor (estimate.advisor, ``subnetdp plan --cluster``)."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

from subnetdp.cli import main
from subnetdp.estimate.advisor import (
    PROGRESS_STEPS,
    advise,
    analytic_peak,
    candidates,
    left_out,
)
from subnetdp.estimate.cluster import DEVICES, Cluster, Link, parse_cluster, parse_rate
from subnetdp.estimate.comm import analytic_comm
from subnetdp.estimate.spec import BenchSpec
from subnetdp.estimate.steptime import (
    Collective,
    _phase_time,
    bucket_exposed,
    collectives,
    pipelined,
    predict_step,
    rank_flops,
    with_local_steps,
)
from subnetdp.models import get_recipe
from subnetdp.subnet.costs import recipe_costs

TINY = {"recipe": "llama-tiny", "world": 4, "batch": 2, "seq": 32,
        "model_args": (("n_layers", 4),)}
# every strategy and composition the benchmarks build (labels as parse_label reads them)
LABELS = ("ddp", "ddp+ac", "fsdp", "fsdp+ac", "ddp+zero1", "ddp+zero2", "b-sdp", "n-sdp",
          "bb-sdp", "nb-sdp", "b-sdp+ac", "b-sdp+fsdp", "b-sdp+fsdp+ac", "n-sdp+fsdp",
          "bb-sdp+fsdp", "b-sdp+zero1", "b-sdp+zero2")


@pytest.mark.parametrize("label", LABELS)
def test_model_bytes_are_the_counted_bytes(label: str) -> None:
    """Per rank and group, the model's ring bytes are estimate.comm's (checked against the
    runs' counters in test_measured), for every strategy."""
    spec = BenchSpec(strategy=label, coverage=0.5, **TINY)  # type: ignore[arg-type]
    colls, records = collectives(spec), analytic_comm(spec)
    for rank, rec in enumerate(records):
        by_group: dict[str, float] = {}
        for c in colls[rank]:
            if c.kind == "send":  # backward masking's refresh: point to point, not counted
                continue
            key = ",".join(map(str, c.group))
            by_group[key] = by_group.get(key, 0.0) + c.ring_bytes
        assert by_group == pytest.approx({k: g["ring"] for k, g in rec["by_group"].items()},
                                         rel=1e-12)
        assert sum(c.ring_bytes for c in colls[rank] if c.kind != "send") == pytest.approx(
            rec["comm/ring_bytes_per_step"], rel=1e-12)


def _one_node(bw: float, *, shared: bool, alpha: float = 0.0) -> Cluster:
    return Cluster(1, 4, DEVICES["h100"], Link(bw, alpha), shared_intra=shared)


def test_ring_formulas_by_hand() -> None:
    world = (0, 1, 2, 3)
    ar = [[Collective("all_reduce", world, 1000.0, 1, "backward")] for _ in world]
    ag = [[Collective("all_gather", world, 1000.0, 1, "forward")] for _ in world]
    rs = [[Collective("reduce_scatter", world, 1000.0, 1, "backward")] for _ in world]
    # all-reduce: each rank sends 2·3/4·1000 = 1500 B; a per-rank link of 1e6 B/s: 1.5 ms
    assert _phase_time(_one_node(1e6, shared=False), ar, {}) == pytest.approx(1.5e-3)
    # one link shared by the 4 ranks carries 4 × 1500 B: 6 ms
    assert _phase_time(_one_node(1e6, shared=True), ar, {}) == pytest.approx(6e-3)
    # all-gather: 3/4·1000 = 750 B per rank
    assert _phase_time(_one_node(1e6, shared=False), ag, {}) == pytest.approx(0.75e-3)
    # gloo's reduce-scatter is an all-reduce on the wire: twice, and 2(h-1) latency steps
    assert _phase_time(_one_node(1e6, shared=False), rs, {"reduce_scatter": 2.0}) == \
        pytest.approx(1.5e-3)
    # latency: 2(h-1) = 6 steps of α for an all-reduce, h-1 = 3 for an all-gather
    assert _phase_time(_one_node(1e12, shared=False, alpha=1e-3), ar, {}) == \
        pytest.approx(6e-3, rel=1e-6)
    assert _phase_time(_one_node(1e12, shared=False, alpha=1e-3), ag, {}) == \
        pytest.approx(3e-3, rel=1e-6)
    # 2 nodes x 2 ranks, one NIC each: the ring 0→1→2→3→0 crosses out of each node once, so
    # each NIC carries one rank's 1500 B (at 1e3 B/s: 1.5 s); the fast local links do not count
    two = Cluster(2, 2, DEVICES["h100"], Link(1e12), Link(1e3))
    assert _phase_time(two, ar, {}) == pytest.approx(1.5)
    # two groups over the same NIC serialise: (0,2) and (1,3) each cross both ways
    pairs = [[Collective("all_reduce", (r % 2, r % 2 + 2), 1000.0, 1, "backward")]
             for r in world]
    assert _phase_time(two, pairs, {}) == pytest.approx(2 * 1000 / 1e3)


def test_overlap_rule() -> None:
    # one bucket: nothing hides; many small buckets behind long compute: one bucket's share
    assert pipelined(1.0, 5.0, 1) == 1.0
    assert pipelined(1.0, 5.0, 4) == pytest.approx(0.25)
    # communication longer than compute: all but (n-1)/n of the compute is exposed
    assert pipelined(3.0, 1.0, 2) == pytest.approx(1.5 + 0.5 * 2.0)
    assert pipelined(0.0, 1.0, 3) == 0.0


def test_buckets_launch_when_ready() -> None:
    """A bucket leaves when backward has produced it and the link is free: DDP's small first
    bucket hides, its last one (ready when backward ends) is exposed whole."""
    assert bucket_exposed(1.0, 5.0, [(0.1, 0.1), (1.0, 0.9)]) == pytest.approx(0.9)
    # equal buckets ready at 1/4, 2/4, 3/4, 1 of a long backward: the last one's share
    assert bucket_exposed(1.0, 5.0, [(i / 4, 1.0) for i in (1, 2, 3, 4)]) == \
        pytest.approx(0.25)
    # communication longer than backward: the link is never idle after the first bucket
    assert bucket_exposed(3.0, 1.0, [(0.5, 1.0), (1.0, 1.0)]) == pytest.approx(0.5 + 3.0 - 1.0)
    assert bucket_exposed(0.0, 1.0, [(1.0, 1.0)]) == 0.0


def test_ddp_exposes_its_last_bucket() -> None:
    """torch DDP's buckets on a slow link: the first 1 MiB hides behind backward, the rest (the
    tied embedding's gradient is ready only at the end) is on the critical path."""
    spec = BenchSpec(strategy="ddp", **TINY)  # type: ignore[arg-type]
    costs = recipe_costs(get_recipe("llama-tiny"), batch=2, seq=32,
                         model_args={"n_layers": 4})
    cluster = _one_node(1e7, shared=True)
    rate = (costs.shared.flops + sum(u.flops for u in costs.units)) / 10.0  # a 10 s step
    t = predict_step(spec, cluster, rate=rate, costs=costs)
    comm = t.comm_s["backward reduce"]
    payload = analytic_comm(spec)[0]["by_group"]["0,1,2,3"]["payload"]
    assert t.exposed_s["backward reduce"] == pytest.approx(comm * (1 - 2**20 / payload))


def test_fsdp_blocks_on_gloo() -> None:
    """FSDP2 issues its collectives with async_op=False: on gloo (no streams) every one waits,
    so the step is compute + all of FSDP's link time; gloo's reduce-scatter is an all-reduce
    (twice the ring bytes). On NCCL the prefetched gathers and the reduce-scatters pipeline.
    runtime.ring's ring reduce-scatter moves the ring bytes, and its async gathers pipeline."""
    spec = BenchSpec(strategy="fsdp", ring_reduce_scatter=False, async_unshard=False,
                     **TINY)  # type: ignore[arg-type]
    cluster = _one_node(1e7, shared=True)
    ring = analytic_comm(spec)[0]["comm/ring_bytes_per_step"]
    wire = sum(c.ring_bytes * (2 if c.kind == "reduce_scatter" else 1)
               for c in collectives(spec)[0])
    assert ring < wire < 2 * ring
    gloo = predict_step(spec, cluster, rate=1e9, backend="gloo")
    assert gloo.exposed_comm_s == pytest.approx(4 * wire / 1e7, rel=1e-9)
    assert gloo.step_s == pytest.approx(gloo.compute_s + gloo.exposed_comm_s)
    nccl = predict_step(spec, cluster, rate=1e9, backend="nccl")
    assert nccl.exposed_comm_s < 4 * ring / 1e7
    ours = predict_step(spec.replace(ring_reduce_scatter=True, async_unshard=True), cluster,
                        rate=1e9, backend="gloo")
    assert sum(ours.comm_s.values()) == pytest.approx(4 * ring / 1e7, rel=1e-9)
    assert 4 * ring / 1e7 - ours.compute_s <= ours.exposed_comm_s < 4 * ring / 1e7


def test_shaped_link_bursts_after_idle_gaps() -> None:
    """A token bucket of B bytes passes B at once after each idle gap, refilled at the rate."""
    world = (0, 1, 2, 3)
    ag = [[Collective("all_gather", world, 1000.0, 2, "forward", True)] for _ in world]
    shaped = Cluster(1, 4, DEVICES["cpu"], Link(1e6, 0.0, burst=400.0), shared_intra=True)
    # 4 ranks x 750 B = 3000 B on the link; 2 gaps of 1 s: 800 B pass at once
    assert _phase_time(shaped, ag, {}, gaps=2, gap_s=1.0) == pytest.approx(2200 / 1e6)
    # gaps too short to refill: 2 x 1e6 B/s x 1e-4 s
    assert _phase_time(shaped, ag, {}, gaps=2, gap_s=1e-4) == pytest.approx(2800 / 1e6)
    assert _phase_time(shaped, ag, {}) == pytest.approx(3000 / 1e6)


def test_compute_follows_counted_flops() -> None:
    spec = BenchSpec(strategy="ddp", **TINY)  # type: ignore[arg-type]
    costs = recipe_costs(get_recipe("llama-tiny"), batch=2, seq=32,
                         model_args={"n_layers": 4})
    full = costs.shared.flops + sum(u.flops for u in costs.units)
    assert rank_flops(spec, costs, None)[0].total == full
    cluster = _one_node(1e30, shared=False)
    t = predict_step(spec, cluster, rate=1e9, costs=costs)
    assert t.compute_s == pytest.approx(full / 1e9)
    # ac recomputes each block's forward once more
    ac = predict_step(spec.replace(strategy="ddp+ac"), cluster, rate=1e9, costs=costs)
    assert ac.compute_s - t.compute_s == pytest.approx(
        sum(u.fwd_flops for u in costs.units) / 1e9)
    # b-sdp at C=0.5 runs half the blocks; bb-sdp runs them all forward, less backward
    half = predict_step(spec.replace(strategy="b-sdp", coverage=0.5), cluster, rate=1e9,
                        costs=costs)
    bb = predict_step(spec.replace(strategy="bb-sdp", coverage=0.5), cluster, rate=1e9,
                      costs=costs)
    units = sum(u.flops for u in costs.units)
    assert half.compute_s == pytest.approx((full - units / 2) / 1e9)
    assert half.compute_s < bb.compute_s < t.compute_s


def test_slow_link_step_is_compute_plus_bytes() -> None:
    """ddp has one bucket here: nothing overlaps, the step is compute + bytes / bandwidth
    (4 ranks on one shared link)."""
    spec = BenchSpec(strategy="ddp", **TINY)  # type: ignore[arg-type]
    t = predict_step(spec, _one_node(1e6, shared=True), rate=1e12)
    ring = analytic_comm(spec)[0]["comm/ring_bytes_per_step"]
    assert t.step_s == pytest.approx(t.compute_s + 4 * ring / 1e6, rel=1e-3)


@pytest.mark.parametrize("label", ["ddp", "b-sdp"])
def test_local_steps_amortise_the_counted_bytes(label: str) -> None:
    """--sync-every H: each rank's bytes per step are the synchronous step's x wire / H (the
    runs count the same: tests/runtime/test_local_steps.py), the step is compute plus the
    whole sync / H (blocking, 4 ranks on one shared link), fragments add only latency."""
    spec = BenchSpec(strategy=label, coverage=0.5, **TINY)  # type: ignore[arg-type]
    cluster = _one_node(1e6, shared=True)
    sync = predict_step(spec, cluster, rate=1e12, overlap=False)
    t = with_local_steps(sync, spec, cluster, every=32, wire_ratio=0.5)
    ring = [r["comm/ring_bytes_per_step"] for r in analytic_comm(spec)]
    assert t.ring_bytes == pytest.approx([b * 0.5 / 32 for b in ring], rel=1e-12)
    assert t.compute_s == sync.compute_s
    assert t.step_s == pytest.approx(sync.compute_s + 4 * max(ring) * 0.5 / 32 / 1e6, rel=1e-3)
    slow = _one_node(1e6, shared=True, alpha=1e-3)
    whole, streamed = (with_local_steps(sync, spec, slow, every=32, fragments=f, wire_ratio=0.5)
                       for f in (1, 4))
    assert streamed.step_s > whole.step_s and streamed.ring_bytes == whole.ring_bytes
    with pytest.raises(ValueError, match="multiple of the fragments"):
        with_local_steps(sync, spec, cluster, every=6, fragments=4)


def test_cluster_parser_and_device_table() -> None:
    c = parse_cluster("nodes=4,gpus-per-node=8,gpu=h100,intra=900GB/s,inter=25gbit")
    assert (c.nodes, c.ranks_per_node, c.world, c.device.name) == (4, 8, 32, "h100")
    assert c.intra.bandwidth == 900e9 and c.inter is not None
    assert c.inter.bandwidth == 25e9 / 8
    assert parse_rate("100Gb/s") == parse_rate("100gbit") == 12.5e9
    assert {"a100", "h100", "h200", "cpu"} <= set(DEVICES)
    assert DEVICES["h100"].peak("bf16-mixed") == 989e12
    assert DEVICES["h100"].rate("bf16-mixed") == 989e12 * DEVICES["h100"].mfu
    for bad, words in (("nodes=0", "nodes"), ("gpu=h900", "unknown gpu"),
                       ("nodes=2", "inter=RATE"), ("inter=fast", "rate"),
                       ("speed=1", "key=value"), ("nodes=1,nodes=2", "twice")):
        with pytest.raises(ValueError, match=words):
            parse_cluster(bad)


def test_cluster_errors_are_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "cluster", "--recipe", "llama-tiny", "--cluster", "nodes=2,gpu=h100"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "inter=RATE" in err


def test_advisor_picks_at_matched_progress() -> None:
    """With memory for neither ddp nor b-sdp, on a slow link between 2 nodes: the fitting
    options are the sharded ones. b-sdp+fsdp moves fewer bytes per step than fsdp and its
    step is shorter, but it takes round(S / C) = 2S steps for fsdp's S ([Note: matched
    progress]): fsdp reaches the same progress first, and is the pick."""
    cluster = parse_cluster("nodes=2,gpus-per-node=2,gpu=h100,inter=1gbit")
    base = BenchSpec(strategy="ddp", **TINY)  # type: ignore[arg-type]
    options = ("ddp", "b-sdp", "fsdp", "b-sdp+fsdp")
    costs = recipe_costs(get_recipe("llama-tiny"), batch=2, seq=32,
                         model_args={"n_layers": 4})
    peaks = {s.label: analytic_peak(s, costs)
             for s in candidates(base, (0.5,), options)}
    budget = max(peaks["fsdp"], peaks["b-sdp+fsdp (C=0.5)"])
    assert budget < peaks["b-sdp (C=0.5)"] < peaks["ddp"]  # the premise
    (rows,) = advise(base, [cluster], memory_gb=budget / 1e9, rate=1e14, coverages=(0.5,),
                     options=options)
    fits = {a.spec.label: a.fits for a in rows}
    assert fits == {"ddp": False, "b-sdp (C=0.5)": False, "fsdp": True,
                    "b-sdp+fsdp (C=0.5)": True}
    by = {a.spec.label: a for a in rows}
    sdp, fsdp = by["b-sdp+fsdp (C=0.5)"], by["fsdp"]
    assert sdp.time.step_s < fsdp.time.step_s  # per step, SDP looks faster
    assert (sdp.steps, fsdp.steps) == (2 * PROGRESS_STEPS, PROGRESS_STEPS)
    assert sdp.matched_s == sdp.steps * sdp.time.step_s > fsdp.matched_s
    assert [a.spec.label for a in rows if a.fastest] == ["fsdp"]


def test_advisor_names_the_smallest_sync_window() -> None:
    """On a slow link every option that can take local steps gets the smallest power-of-two
    H whose syncs take at most a tenth of the compute (half of it would not do); sharded
    options (FSDP, ZeRO) refuse local steps and get none."""
    cluster = parse_cluster("nodes=2,gpus-per-node=2,gpu=h100,inter=100mbit")
    base = BenchSpec(strategy="ddp", **TINY)  # type: ignore[arg-type]
    (rows,) = advise(base, [cluster], memory_gb=80, rate=1e10, coverages=(0.5,),
                     options=("ddp", "b-sdp", "b-sdp+fsdp", "ddp+zero2"))
    found = {a.spec.label: a.sync_every for a in rows}
    assert found["b-sdp+fsdp (C=0.5)"] is None and found["ddp+zero2"] is None
    for a in rows:
        if a.sync_every is None:
            continue
        def share(h: int, a=a) -> float:
            t = with_local_steps(a.time, a.spec, cluster, every=h)
            return t.exposed_comm_s / t.compute_s
        assert share(a.sync_every) <= 0.1 < share(a.sync_every // 2)
    assert found["ddp"] >= found["b-sdp (C=0.5)"] > 1  # SDP syncs fewer bytes


def test_plan_cluster_prints_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "cluster", "--recipe", "llama-tiny", "--cluster",
                 "nodes=2,gpus-per-node=2,gpu=a100,inter=10gbit", "--batch-size", "2",
                 "--seq-len", "32", "--strategies", "ddp,b-sdp+fsdp", "--coverage", "0.5",
                 "--mfu", "0.3"]) == 0
    out = capsys.readouterr().out
    assert "peak 156 TFLOP/s (a100's datasheet) x MFU 0.3 (--mfu)" in out
    assert out.count("<- fastest that fits") == 1 and "b-sdp+fsdp (C=0.5)" in out
    assert "ranked at matched progress" in out.splitlines()[2]  # above the table
    assert "local steps (--sync-every H, docs/strategies.md): the smallest H whose syncs " \
           "take at most 10% of the compute: ddp " in out


@pytest.mark.parametrize(("gpu", "rate", "assumed"), [
    ("a100", "(assumed: peak 312 TFLOP/s x MFU 0.159: the H200's measured MFU", True),
    ("h200", "(peak 989 TFLOP/s x MFU 0.159: measured: llama-1b on 8 x H200", False)])
def test_assumed_numbers_are_marked(capsys: pytest.CaptureFixture[str], gpu: str, rate: str,
                                    assumed: bool) -> None:
    """Each number that no measurement of this device produced says "assumed": the MFU of a
    GPU that was not measured (the H200's was: benchmarks/results/gpu_h200/mfu.md), the
    default links and latencies, NCCL's default communicator size; a measured MFU does not."""
    assert main(["plan", "cluster", "--recipe", "llama-tiny", "--cluster",
                 f"nodes=2,gpus-per-node=2,gpu={gpu},inter=10gbit", "--batch-size", "2",
                 "--seq-len", "32", "--strategies", "ddp", "--dtype", "bf16-mixed"]) == 0
    out = capsys.readouterr().out
    assert rate in out
    assert ("assumed: peak" in out) == assumed
    assert "per rank, assumed (latency 5 us, assumed)" in out
    assert "(latency 10 us, assumed)" in out and "636 MiB per communicator, assumed" in out
    assert main(["plan", "cluster", "--recipe", "llama-tiny", "--cluster",
                 f"nodes=2,gpus-per-node=2,gpu={gpu},inter=10gbit,intra=100GB/s,"
                 "intra-latency=2us,inter-latency=3us", "--batch-size", "2", "--seq-len", "32",
                 "--strategies", "ddp", "--dtype", "bf16-mixed", "--comm-mem-mb", "100"]) == 0
    # left: the MFU where unmeasured, FSDP's host time per call on GPUs (not modelled) and
    # what else the FLOP rate misses (steptime.ComputeTerms: measured on CPUs only)
    head = capsys.readouterr().out.split("\nranked")[0]
    assert head.count("assumed") == int(assumed) + 2 and "FSDP host time per call 0" in head
    assert "activation checkpointing at the FLOP rate (assumed)" in head


def test_advisor_peak_counts_the_communicators() -> None:
    """The advisor's peak adds NCCL's buffers: the most communicators any rank joins times
    ``comm_mem_mb`` MiB ([Note: communicator memory]), so it never promises what NCCL takes."""
    from subnetdp.estimate.spec import make_bench_plan, meta_model
    from subnetdp.plan.communicators import communicators_per_rank

    costs = recipe_costs(get_recipe("llama-tiny"), batch=2, seq=32,
                         model_args={"n_layers": 4})
    spec = BenchSpec(strategy="b-sdp", coverage=0.5, **TINY)  # type: ignore[arg-type]
    recipe, meta = meta_model(spec)
    most = max(communicators_per_rank(make_bench_plan(spec, meta, recipe)))
    assert most > 1  # holder groups beside the world group
    with_comms = dataclasses.replace(spec, comm_mem_mb=636.0)
    assert analytic_peak(with_comms, costs) - analytic_peak(spec, costs) == most * 636 * 2**20
    ddp = BenchSpec(strategy="ddp", **TINY)  # type: ignore[arg-type]
    assert (analytic_peak(dataclasses.replace(ddp, comm_mem_mb=100.0), costs)
            - analytic_peak(ddp, costs)) == 100 * 2**20  # the world group only


def test_advisor_tables_unchanged() -> None:
    """The advisor evaluates each distinct case once (ranks of one plan row share their
    collectives, FLOPs and buckets): on small clusters its tables are exactly those of the
    per-rank loop before (``data/advisor_small.json``, ``advisor_cases``)."""
    from tests.estimate.advisor_cases import CASES, KEYS

    with open(Path(__file__).parent / "data" / "advisor_small.json") as f:
        expected = json.load(f)
    for (text, backend, overlap), want in zip(CASES, expected, strict=True):
        cluster = parse_cluster(text)
        base = BenchSpec(strategy="ddp", recipe="llama-tiny", world=cluster.world, batch=2,
                         seq=32, model_args=(("n_layers", 4),), comm_mem_mb=636.0)
        (rows,) = advise(base, [cluster], memory_gb=0.75, rate=1e13, backend=backend,
                         overlap=overlap)
        got = json.loads(json.dumps([{k: a.to_dict()[k] for k in KEYS} for a in rows]))
        assert got == want, text


@pytest.mark.parametrize("label", ["bb-sdp+fsdp", "b-sdp+zero2", "fsdp"])
def test_advisor_work_grows_with_cases_not_ranks(label: str) -> None:
    """On 1,000 nodes x 8 the collectives and FLOPs are computed once per distinct plan row
    (as many as on 8 ranks, at most C(4, 2) for 4 blocks at C = 0.5), and the answer comes."""
    from subnetdp.estimate.spec import make_bench_plan, meta_model

    distinct = {}
    for world in (8, 8000):
        spec = BenchSpec(strategy=label, coverage=0.5 if "sdp" in label else 1.0,
                         **{**TINY, "world": world})  # type: ignore[arg-type]
        recipe, meta = meta_model(spec)
        plan = make_bench_plan(spec, meta, recipe) if spec.is_sdp else None
        colls = collectives(spec, plan)
        costs = recipe_costs(recipe, batch=2, seq=32, model_args={"n_layers": 4})
        rows = len(set(plan.matrix)) if plan is not None else 1
        # backward masking: each unit's owner has its own list (its refresh sends)
        owners = ({plan.owner(u) for u in range(plan.num_units)}
                  if plan is not None and spec.strategy_value.backward_masked else set())
        assert len({id(c) for c in colls}) <= rows + len(owners)
        assert len({id(f) for f in rank_flops(spec, costs, plan)}) == rows
        distinct[world] = rows
    assert distinct[8000] <= math.comb(4, 2)
    cluster = parse_cluster("nodes=1000,gpus-per-node=8,gpu=h100,inter=25gbit")
    (rows_,) = advise(BenchSpec(strategy="ddp", **{**TINY, "world": 8000}),  # type: ignore[arg-type]
                      [cluster], memory_gb=80, rate=4e14, coverages=(0.5,), options=(label,))
    assert len(rows_) == 1 and rows_[0].time.step_s > 0


def test_advisor_leaves_out_neuron_plans_of_huge_worlds(
        capsys: pytest.CaptureFixture[str]) -> None:
    """n-sdp's plan has a group per rank in every layer pair (quadratic in the world): over
    NEURON_PLAN_CELLS its options are left out, and the table says so."""
    base = BenchSpec(strategy="ddp", **TINY)  # type: ignore[arg-type]
    assert left_out(base, 4, (0.5,), ("ddp", "n-sdp")) == []
    assert left_out(base, 8000, (0.5,), ("ddp", "n-sdp", "n-sdp+fsdp")) == [
        "n-sdp (C=0.5)", "n-sdp+fsdp (C=0.5)"]
    assert main(["plan", "cluster", "--recipe", "llama-tiny", "--cluster",
                 "nodes=1000,gpus-per-node=8,gpu=h100,inter=25gbit", "--batch-size", "2",
                 "--seq-len", "32", "--model-arg", "n_layers=4", "--strategies", "ddp,n-sdp",
                 "--coverage", "0.5"]) == 0
    out = capsys.readouterr().out
    assert "not estimated on 8000 ranks: n-sdp (C=0.5)" in out
    assert "\nddp " in out and "\nn-sdp " not in out


def test_calibration_file_round_trip(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``python -m subnetdp.estimate.calibrate --out FILE`` writes a record whose measured
    model FLOP/s ``plan cluster ...gpu=cpu --calibration FILE`` runs at and names; a file
    that is not one is a one-line error naming it."""
    from subnetdp.estimate.calibrate import main as calibrate_main
    from subnetdp.estimate.rates import read_calibration

    out = tmp_path / "cal.json"
    assert calibrate_main(["--nproc", "1", "--steps", "1", "--batch-size", "1", "--seq-len",
                           "8", "--matmul-seconds", "0.1", "--out", str(out)]) == 0
    record = read_calibration(out)
    assert record["model_flops"] > 0 and record["nproc"] == 1
    # what the FLOP rate misses (test_compute_terms), measured on the narrowed n-sdp rank of
    # two and the checkpointed model, with the load average around it
    assert 0 < record["narrow"]["held"] < 1 and record["narrow"]["efficiency"] > 0
    assert record["ac_efficiency"] > 0 and record["load_after"] >= 0
    argv = ["plan", "cluster", "--recipe", "llama-tiny", "--batch-size", "2", "--seq-len", "32",
            "--cluster", "nodes=1,gpus-per-node=2,gpu=cpu", "--strategies", "ddp",
            "--calibration", str(out), "--json"]
    capsys.readouterr()
    assert main(argv) == 0
    (table,) = json.loads(capsys.readouterr().out)
    assert table["rate_flops"] == record["model_flops"] and not table["rate_assumed"]
    assert f"measured earlier ({out})" in table["rate_source"]
    costs = recipe_costs(get_recipe("llama-tiny"), batch=2, seq=32)
    flops = costs.shared.flops + sum(u.flops for u in costs.units)
    assert table["rows"][0]["compute_s"] == pytest.approx(flops / record["model_flops"])
    out.write_text('{"recipe": "llama-tiny"}')
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and f"--calibration {out}: lacks model_flops" in err


def test_fsdp_host_time_counts_each_call() -> None:
    """``call_s`` (calibrate's measured host time per FSDP call) adds to compute once per FSDP
    collective call of the rank: n-sdp+fsdp's parts are gathered per block and holder group
    (runtime.fsdp), so llama-tiny on 4 ranks at C = 0.5 has 16 such modules + the root, each a
    gather in forward and a reduce-scatter in backward (kept gathered: no backward gather);
    b-sdp+fsdp has 4 blocks + the root, the blocks gathered again in backward."""
    cluster = _one_node(1e30, shared=False)
    for strategy, calls in (("n-sdp", 2 * 17), ("b-sdp", 5 + 4 + 5)):
        spec = BenchSpec(recipe="llama-tiny", strategy=strategy, world=4, batch=4, seq=128,
                         coverage=0.5, fsdp=True)
        base = predict_step(spec, cluster, rate=1e10, backend="gloo")
        slow = predict_step(spec, cluster, rate=1e10, backend="gloo", call_s=1e-3)
        assert slow.compute_s - base.compute_s == pytest.approx(calls * 1e-3)


def test_zero1_broadcasts_one_call_per_parameter() -> None:
    """ddp+zero1's optimizer (torch's ZeroRedundancyOptimizer, no bucket view) broadcasts
    parameter by parameter: on a link of latency only, its phase after the step costs one
    broadcast's latency steps per parameter tensor (llama-tiny, 4 blocks: 4 x 9 + 3)."""
    spec = BenchSpec(strategy="ddp+zero1", **TINY)  # type: ignore[arg-type]
    (bcast,) = [c for c in collectives(spec)[0] if c.kind == "broadcast"]
    assert bcast.calls == 39
    t = predict_step(spec, _one_node(1e30, shared=False, alpha=1e-3), rate=1e30)
    assert t.exposed_s["after reduce"] == pytest.approx(39 * 3 * 1e-3)


def test_backward_masking_refresh_is_sent_by_owners() -> None:
    """bb-sdp's refresh (runtime.refresh): each unit's owner sends its parameters to every
    non-holder before the next forward, exposed: on a link of bandwidth only, the phase takes
    the owners' bytes (every unit x its non-holders x 4 bytes per fp32 parameter) over the
    shared link; b-sdp has none."""
    from subnetdp.estimate.spec import make_bench_plan, meta_model

    spec = BenchSpec(strategy="bb-sdp", coverage=0.5, **TINY)  # type: ignore[arg-type]
    recipe, meta = meta_model(spec)
    plan = make_bench_plan(spec, meta, recipe)
    want = sum(plan.units[u].size * 4 * (4 - len(plan.holders(u)))
               for u in range(plan.num_units))
    sends = [c for cs in collectives(spec, plan) for c in cs if c.kind == "send"]
    assert sum(c.payload for c in sends) == want > 0
    assert all(c.group[0] == plan.owner(u) for c in sends
               for u in range(plan.num_units) if c.group[1] not in plan.holders(u)
               and plan.owner(u) == c.group[0])
    t = predict_step(spec, _one_node(1e6, shared=True), rate=1e30)
    assert t.exposed_s["after refresh"] == pytest.approx(want / 1e6)
    b = predict_step(spec.replace(strategy="b-sdp"), _one_node(1e6, shared=True), rate=1e30)
    assert "after refresh" not in b.exposed_s
