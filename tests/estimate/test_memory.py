"""The fake-mode memory estimator: its parameter, gradient and optimizer bytes equal the
analytic formula exactly, for every strategy and composition (FSDP per holder group, activation
checkpointing, mixed precision); and the analytic communication adds up."""

from __future__ import annotations

import os
import subprocess
import sys
from functools import cache
from pathlib import Path
from types import SimpleNamespace

import pytest

import subnetdp
from subnetdp.cli import main
from subnetdp.estimate.comm import analytic_comm
from subnetdp.estimate.memory import (
    FsdpLayout,
    MemoryEstimate,
    estimate_memory,
    fsdp_shard_numel,
    heaviest_rank,
)
from subnetdp.estimate.spec import (
    BASELINES,
    BenchSpec,
    all_strategies,
    make_bench_plan,
    meta_model,
)
from subnetdp.metrics.comm import comm_record, comm_summary
from subnetdp.plan import worker_bytes
from subnetdp.strategy import ZERO_BASELINES
from subnetdp.subnet.neurons import plan_groups
from subnetdp.subnet.pieces import full_pieces

# four blocks keep each fake-mode step to a few hundred ops (the suite must stay quick)
TINY = {"recipe": "llama-tiny", "world": 4, "batch": 2, "seq": 32,
        "model_args": (("n_layers", 4),)}
# Where the layer count shapes no plan row, two layers show the same layout at half the cost:
# baselines (the whole model on every rank) and neuron-level strategies (every layer split
# alike into the world's groups; their steps cost 3 times a block-level one, 10 with FSDP).
TWO_LAYERS = (("n_layers", 2),)


ODD = {"coverage": 0.75, "bucket_cap_mb": 0.004,
       "model_args": (("n_layers", 4), ("dim", 20), ("n_heads", 2), ("n_kv_heads", 2),
                      ("vocab_size", 61), ("ffn_hidden", 44))}
COMPOSED = [{"strategy": "b-sdp", "fsdp": True}, {"strategy": "bb-sdp", "fsdp": True},
            {"strategy": "b-sdp", "fsdp": True, "ac": True, "dtype": "bf16-mixed"},
            {"strategy": "bb-sdp", "fsdp": True, "dtype": "bf16-mixed"},
            {"strategy": "n-sdp", "fsdp": True}, {"strategy": "n-sdp", "fsdp": True, "ac": True},
            {"strategy": "nb-sdp", "fsdp": True},
            {"strategy": "b-sdp", "ac": True}, {"strategy": "b-sdp", "dtype": "bf16-mixed"},
            {"strategy": "ddp", "dtype": "bf16-mixed"},
            {"strategy": "fsdp+ac", "dtype": "bf16-mixed"},
            # ZeRO inside holder groups (runtime.zero), and its baselines
            {"strategy": "b-sdp", "zero": 2}, {"strategy": "b-sdp", "zero": 1},
            {"strategy": "n-sdp", "zero": 2}, {"strategy": "bb-sdp", "zero": 2},
            {"strategy": "nb-sdp", "zero": 1}, {"strategy": "ddp+zero1"},
            {"strategy": "ddp+zero2"},
            # ~4 KB buckets, several per holder set, of sizes 3 holders do not divide: where
            # a bucket closes changes the padding, so the bytes
            {"strategy": "b-sdp", "zero": 2, **ODD}, {"strategy": "bb-sdp", "zero": 1, **ODD},
            {"strategy": "ddp+zero2", **ODD, "coverage": 1.0, "world": 3}]
ADAMW_STATES = 2  # llama-tiny trains with AdamW: exp_avg and exp_avg_sq


def _hand_zero_state(spec: BenchSpec, rank: int) -> dict[str, int]:
    """A ZeRO rank's gradient and optimizer bytes (and, for whole-tensor pieces, parameter
    bytes) from the documented rules alone, not from ``runtime.reducer.global_buckets``:
    reduced parameters in reverse registration order; each (holder set, dtype) fills its own
    bucket, closed when the next piece would take it over the cap; holder k of c keeps slice k
    of each bucket padded to a multiple of c (docs/method.md, Composition). Neuron-level pieces
    (their slices) come from ``full_pieces``; the tiny model fits one default bucket per holder
    set, so their order (runtime: pair families grouped) cannot matter there, and the small-cap
    rows are block level."""
    recipe, meta = meta_model(spec)
    plan = make_bench_plan(spec, meta, recipe) if spec.is_sdp else None
    everyone = tuple(range(spec.world))
    params = dict(meta.named_parameters())
    if plan is not None and spec.strategy_value.neuron_level:
        names = [u.name for u in plan.units]
        pieces = [(p.key, p.unit, p.numel, p.dim is not None)
                  for p in full_pieces(meta, names, plan_groups(meta, recipe.adapter, names))
                  if p.key in params]
    else:
        def unit(name: str) -> int | None:
            return next((u for u, unit in enumerate(plan.units)
                         if name.startswith(unit.name + ".")), None) if plan else None

        pieces = [(n, unit(n), p.numel(), False) for n, p in params.items()]
    cap, width = int(spec.bucket_cap_mb * 2**20), spec.param_bytes
    buckets: list[tuple[tuple[int, ...], int]] = []
    open_: dict[tuple[int, ...], int] = {}  # one dtype (fp32 master) throughout
    for _, u, numel, _ in reversed(pieces):
        holders = everyone if u is None or plan is None else tuple(plan.holders(u))
        filled = open_.get(holders, 0)
        if filled and (filled + numel) * width > cap:
            buckets.append((holders, filled))
            filled = 0
        open_[holders] = filled + numel
    buckets += open_.items()
    zero = spec.composition().zero
    real = grads = 0
    for holders, n in buckets:
        if rank in holders:
            c, k = len(holders), holders.index(rank)
            size = -(-n // c)
            real += max(0, min(n, (k + 1) * size) - k * size)
            grads += size if zero == 2 else size * c
    out = {"grads": grads * width, "optimizer": ADAMW_STATES * real * width}
    if not any(sliced for *_, sliced in pieces):  # whole tensors: no slice copies
        # every unit is stored without a plan or under backward masking (frozen copies)
        everything = plan is None or spec.strategy_value.backward_masked
        held = set(plan.held_units(rank)) if plan else set()
        out["params"] = width * sum(n for _, u, n, _ in pieces
                                    if u is None or everything or u in held)
    return out


@pytest.mark.parametrize("opts", [{"strategy": s} for s in all_strategies()] + COMPOSED,
                         ids=lambda o: "-".join(str(v) for k, v in o.items()
                                                if k not in ODD) + ("-odd" if "dim" in str(o)
                                                                    else ""))
def test_state_bytes_equal_the_analytic_formula(opts: dict) -> None:
    baseline = opts["strategy"] in (*BASELINES, *ZERO_BASELINES)
    spec = BenchSpec(**{**TINY, "coverage": 1.0 if baseline else 0.5, **opts})
    if (baseline or spec.strategy_value.neuron_level) and "model_args" not in opts:
        spec = spec.replace(model_args=TWO_LAYERS)
    rank = heaviest_rank(spec)
    est = estimate_memory(spec, ranks=[rank])
    r = est.per_rank[0]
    assert r.rank == rank
    assert r.state == r.analytic, spec.label
    if spec.composition().zero:  # the ZeRO formula itself rests on the reducer's buckets
        hand = _hand_zero_state(spec, rank)
        assert {k: r.state[k] for k in hand} == hand, spec.label
    b = r.breakdown
    assert r.peak_bytes == b["total"] == sum(v for k, v in b.items() if k != "total")
    assert b["activations"] > 0 and b["params"] > 0


def test_narrow_frozen_copies_estimate_in_a_fresh_process() -> None:
    """bb-sdp+fsdp in bf16-mixed stores its non-held (frozen) copies in bf16. Cast with
    ``Module.to``, their fake parameters went through ``torch.utils.swap_tensors``, which
    refused (``Couldn't swap RMSNorm.weight``) unless an earlier estimate in the same process
    had already run those fake ops (FakeTensorMode's dispatch cache is class-wide): so in a
    process of its own, as a standalone script, where nothing ran before."""
    opts = {**TINY, "strategy": "bb-sdp", "fsdp": True, "dtype": "bf16-mixed", "coverage": 0.5}
    code = ("from subnetdp.estimate.memory import estimate_memory, heaviest_rank\n"
            "from subnetdp.estimate.spec import BenchSpec\n"
            f"spec = BenchSpec(**{opts!r})\n"
            "r = estimate_memory(spec, ranks=[heaviest_rank(spec)]).per_rank[0]\n"
            "assert r.state == r.analytic, (r.state, r.analytic)\n")
    src = str(Path(subnetdp.__file__).parents[1])  # this checkout, not an installed copy
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-4000:]

def test_sdp_rows_share_one_estimate_and_cover_every_rank() -> None:
    spec = BenchSpec(strategy="b-sdp", coverage=0.5, **TINY)
    est = estimate_memory(spec)
    assert [r.rank for r in est.per_rank] == [0, 1, 2, 3]
    assert {r.same_as for r in est.per_rank} == {None, 0}  # llama blocks are all alike
    d = est.to_dict()
    assert d["peak_bytes"] == est.worst.peak_bytes and set(d["breakdown"]) >= {"params", "total"}


def test_sdp_fsdp_rows_by_shard_layout() -> None:
    """Composed with FSDP, a rank's state depends on its position in each holder group (FSDP's
    ceil chunks): ranks share an estimate only when their shard layout is the same, and every
    rank's analytic state is that of the estimate it shares."""
    spec = BenchSpec(strategy="b-sdp", fsdp=True, coverage=0.75, **TINY)  # 3 holders per unit
    est = estimate_memory(spec)
    by_rank = {r.rank: r for r in est.per_rank}
    for r in est.per_rank:
        base = by_rank[r.same_as] if r.same_as is not None else r
        assert base.state == r.analytic, r.rank
    recipe, meta = meta_model(spec)
    layout = FsdpLayout(spec, make_bench_plan(spec, meta, recipe))
    # every parameter element of the model is trained by exactly one shard per holder group
    held = sum(layout.unit_shard(u, k) for k in range(4) for u in layout.plan.held_units(k))
    assert held == sum(u.size for u in layout.plan.units)
    assert sum(layout.shared_shard(k) for k in range(4)) == layout.plan.shared_size


def test_fsdp_shards_cover_each_parameter_exactly_once() -> None:
    for shape in [(10,), (7, 3), (4096, 128), (3,)]:
        total = sum(fsdp_shard_numel(shape, 4, r) for r in range(4))
        assert total == shape[0] * (shape[1] if len(shape) > 1 else 1)


def test_analytic_comm_matches_the_plan_bytes() -> None:
    for strategy in ("b-sdp", "n-sdp", "ddp"):
        spec = BenchSpec(strategy=strategy, coverage=0.5, **TINY)
        recipe, meta = meta_model(spec)
        plan = make_bench_plan(spec, meta, recipe)
        for rank, rec in enumerate(analytic_comm(spec)):
            wb = worker_bytes(plan, rank)
            assert rec["comm/bytes_per_step"] == wb.allreduce_payload
            assert round(rec["comm/ring_bytes_per_step"]) == wb.allreduce_ring
            assert sum(g["payload"] for g in rec["by_group"].values()) == wb.allreduce_payload
    full = sum(p.numel() for p in meta.parameters()) * 4
    fsdp = analytic_comm(BenchSpec(strategy="fsdp", **TINY))[0]
    # every gradient reduce-scattered once; at least every parameter gathered once
    assert fsdp["by_collective"]["reduce_scatter"]["payload"] >= full
    assert full < fsdp["by_collective"]["all_gather"]["payload"] < 2 * full


def test_analytic_comm_of_sdp_with_fsdp() -> None:
    fsdp = analytic_comm(BenchSpec(strategy="fsdp", **TINY))
    # everyone holding everything: exactly FSDP's collectives
    assert analytic_comm(BenchSpec(strategy="b-sdp", fsdp=True, coverage=1.0, **TINY)) == fsdp
    spec = BenchSpec(strategy="b-sdp", coverage=0.5, **TINY)
    plain, composed = analytic_comm(spec), analytic_comm(spec.replace(fsdp=True))
    for p, c in zip(plain, composed, strict=True):
        # the same holder groups; each gradient reduce-scattered once (padded to the group)
        # instead of all-reduced, each held unit gathered twice, the shared ones once
        assert c["by_group"].keys() == p["by_group"].keys()
        rs, ag = (c["by_collective"][k]["payload"] for k in ("reduce_scatter", "all_gather"))
        assert p["comm/bytes_per_step"] <= rs < 1.01 * p["comm/bytes_per_step"]
        assert rs < ag < 2 * rs
        assert c["comm/ring_bytes_per_step"] < 2 * p["comm/ring_bytes_per_step"]
    # mixed precision: bf16 all-gathers, fp32 reduce-scatters
    mixed = analytic_comm(spec.replace(fsdp=True, dtype="bf16-mixed"))[0]["by_collective"]
    full = composed[0]["by_collective"]
    assert mixed["all_gather"]["payload"] * 2 == full["all_gather"]["payload"]
    assert mixed["reduce_scatter"] == full["reduce_scatter"]


def test_comm_record_from_counters() -> None:
    stats = SimpleNamespace(by_group={(0, 1, 2, 3): 800, (0, 1): 400}, collective="all_reduce")
    rec = comm_record(stats, steps=2)
    assert rec["by_group"]["0,1"] == {"size": 2, "payload": 200, "ring": 200.0}
    assert rec["comm/bytes_per_step"] == 600 and rec["comm/ring_bytes_per_step"] == 800.0
    ddp = comm_record(SimpleNamespace(by_group={(0, 1): 1000}, collective="all_reduce"),
                      steps=10)
    assert ddp["by_group"] == {"0,1": {"size": 2, "payload": 100.0, "ring": 100.0}}
    summary = comm_summary([{"rank": 0, "comm": rec}, {"rank": 1, "comm": ddp}])
    assert summary["busiest_rank"] == 0 and summary["per_rank_bytes_per_step"] == [600, 100.0]


def test_composition_labels_and_flags(capsys) -> None:  # type: ignore[no-untyped-def]
    spec = BenchSpec(strategy="b-sdp", fsdp=True, ac=True, coverage=0.5, **TINY)
    assert spec.label == "b-sdp+fsdp+ac (C=0.5)" and spec.uses_fsdp and spec.uses_ac
    assert BenchSpec(strategy="fsdp+ac", **TINY).label == "fsdp+ac"
    args = ["bench", "comm", "--recipe", "llama-tiny", "--nproc", "4", "--seq-len", "32"]
    assert main([*args, "--strategy", "b-sdp", "--fsdp", "--ac", "--json"]) == 0
    assert '"label": "b-sdp+fsdp+ac (C=0.5)"' in capsys.readouterr().out
    # --fsdp/--ac compose a baseline as in `train`: ddp + both is the fsdp+ac baseline
    for argv in (["--strategy", "ddp", "--fsdp", "--ac"], ["--strategy", "fsdp+ac"]):
        assert main([*args, *argv, "--json"]) == 0
        assert '"label": "fsdp+ac"' in capsys.readouterr().out


def test_bad_spec_says_how_to_fix() -> None:
    with pytest.raises(ValueError, match="choose one of"):
        BenchSpec(strategy="zero", **TINY)
    with pytest.raises(ValueError, match=r"fsdp\+ac"):
        BenchSpec(strategy="fsdp", ac=True, **TINY)
    with pytest.raises(ValueError, match="dtype"):
        BenchSpec(strategy="ddp", dtype="fp16", **TINY)
    with pytest.raises(ValueError, match="max_seq_len"):
        meta_model(BenchSpec(strategy="ddp", **{**TINY, "seq": 100_000}))


# a ResNet-18 at width 4 on 28x28: image steps of a few hundred ops
IMAGE = {"recipe": "resnet18-fmnist", "world": 4, "batch": 4, "seq": 2,
         "model_args": (("width", 4),)}


@cache
def _image_estimate(spec: BenchSpec) -> MemoryEstimate:
    """One estimate per image spec for this module: the spread and balanced plans are checked
    against the formula and then compared with each other, the ddp one also for its optimizer."""
    return estimate_memory(spec)


@pytest.mark.parametrize("opts", [{"strategy": "b-sdp"}, {"strategy": "ddp", "coverage": 1.0},
                                  {"strategy": "b-sdp", "scheme": "balanced"}],
                         ids=["spread", "ddp", "balanced"])
def test_image_estimate_state_equals_the_analytic_formula(opts: dict) -> None:
    """Image recipes run an image batch of the recipe's shape with cross-entropy; every rank's
    state bytes are the plan's, and ranks holding unequal blocks get unequal estimates."""
    spec = BenchSpec(**{"coverage": 0.5, **IMAGE, **opts})
    est = _image_estimate(spec)
    for r in est.per_rank:
        assert r.state == r.analytic, (spec.label, r.rank)
        assert r.breakdown["activations"] > 0
    if spec.is_sdp:
        peaks = {r.peak_bytes for r in est.per_rank}
        assert len(peaks) > 1  # ResNet's stages differ: spread and balanced rows differ


def test_image_balanced_lowers_the_worst_rank_state() -> None:
    spread = _image_estimate(BenchSpec(strategy="b-sdp", coverage=0.5, **IMAGE))
    balanced = _image_estimate(BenchSpec(strategy="b-sdp", coverage=0.5, scheme="balanced",
                                         **IMAGE))
    worst = [max(r.state["params"] for r in e.per_rank) for e in (spread, balanced)]
    assert worst[1] < 0.7 * worst[0]


def test_swin_estimate_runs_and_its_init_matches_torch() -> None:
    """Swin's truncated-normal init runs under fake tensors and draws torch's values."""
    import torch
    from torch import nn

    from subnetdp.models.swin.model import trunc_normal_

    a, b = torch.empty(64, 9), torch.empty(64, 9)
    torch.manual_seed(3)
    nn.init.trunc_normal_(a, std=0.02)
    torch.manual_seed(3)
    trunc_normal_(b, std=0.02)
    assert torch.equal(a, b)
    spec = BenchSpec(recipe="swin-t-fmnist", strategy="b-sdp", world=4, batch=2, seq=2,
                     coverage=0.5, model_args=(("depths", (2, 2)), ("embed_dim", 12),
                                               ("num_heads", (1, 2))))
    for r in estimate_memory(spec).per_rank:
        assert r.state == r.analytic


def test_image_estimate_uses_the_recipe_optimizer() -> None:
    """ResNet recipes train with SGD + momentum (one state per parameter), Swin with AdamW
    (two): the estimator builds the recipe's optimizer, so its optimizer bytes say so."""
    from subnetdp.estimate.spec import optimizer_states

    assert optimizer_states("resnet18-fmnist") == 1 and optimizer_states("swin-t-fmnist") == 2
    # the ddp row of test_image_estimate_state_equals_the_analytic_formula: the whole model
    est = _image_estimate(BenchSpec(strategy="ddp", coverage=1.0, **IMAGE))
    state = est.per_rank[0].state
    assert state["optimizer"] == state["params"] == est.per_rank[0].analytic["optimizer"]
