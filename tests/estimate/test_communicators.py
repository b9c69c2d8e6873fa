"""Communicators per rank (plan.communicators) and their memory in the estimator
(estimate.communicators, [Note: communicator memory]).

Oracles: counts by hand on an explicit plan; the documented NCCL formula; the estimator's
``communicators`` category equals count x ``comm_mem_mb`` per rank and is part of its peak.
"""

from __future__ import annotations

import json

import pytest

from subnetdp.cli import main
from subnetdp.estimate.advisor import analytic_peak
from subnetdp.estimate.communicators import (
    DEFAULT_COMM_MB,
    SHARED_CHILD_MB,
    MiB,
    NcclBuffers,
    communicator_bytes,
    split_shared,
)
from subnetdp.estimate.memory import estimate_memory
from subnetdp.estimate.spec import BenchSpec, make_bench_plan, meta_model
from subnetdp.plan import Plan, Unit
from subnetdp.plan.communicators import communicators_per_rank
from subnetdp.plan.diagnostics import diagnostics
from subnetdp.subnet.costs import recipe_costs


def test_communicators_per_rank_by_hand() -> None:
    # units held by {0,1}, {0,1} again, {1,2}, {3} alone, and everyone
    m = [[1, 1, 0, 0, 1], [1, 1, 1, 0, 1], [0, 0, 1, 0, 1], [0, 0, 0, 1, 1]]
    plan = Plan(world=4, units=tuple(Unit(f"u{i}", 1) for i in range(5)), shared_size=0,
                matrix=tuple(tuple(bool(x) for x in row) for row in m))
    # world group + {0,1} (rank 0); + {0,1}, {1,2} (rank 1); + {1,2} (rank 2); rank 3: world
    assert communicators_per_rank(plan) == [2, 3, 2, 1]
    assert diagnostics(plan)["communicators"] == [2, 3, 2, 1]


def test_nccl_formula() -> None:
    per_connection = 4 * MiB + 4.6875 * MiB + 0.5 * MiB  # Simple + LL128 + LL
    assert NcclBuffers().bytes() == 32 * 2 * per_connection + 48 * MiB
    assert DEFAULT_COMM_MB == 636.0


def test_estimate_counts_communicators_per_rank() -> None:
    spec = BenchSpec(recipe="llama-tiny", strategy="b-sdp", world=4, batch=2, seq=32,
                     coverage=0.5, model_args=(("n_layers", 4),), comm_mem_mb=100.0)
    recipe, meta = meta_model(spec)
    counts = communicators_per_rank(make_bench_plan(spec, meta, recipe))
    assert max(counts) > 1
    est = estimate_memory(spec)
    for r in est.per_rank:
        b = r.breakdown
        assert b["communicators"] == counts[r.rank] * 100 * MiB
        assert r.peak_bytes == b["total"] == sum(v for k, v in b.items() if k != "total")


def test_split_shared_follows_nccl_env() -> None:
    """The runtime splits holder groups from the world communicator; they share its buffers
    only with NCCL_COMM_SPLIT_SHARE_RESOURCES=1, which the estimate reads the same way."""
    assert not split_shared({})
    assert not split_shared({"NCCL_COMM_SPLIT_SHARE_RESOURCES": "0"})
    assert split_shared({"NCCL_COMM_SPLIT_SHARE_RESOURCES": "1"})


def test_communicator_bytes_separate_and_shared() -> None:
    assert communicator_bytes(3, 636.0) == 3 * 636 * MiB
    # shared: the world communicator whole, each child the 48 MiB allowance
    assert communicator_bytes(3, 636.0, shared=True) == (636 + 2 * SHARED_CHILD_MB) * MiB
    assert SHARED_CHILD_MB == 48.0
    assert communicator_bytes(3, 10.0, shared=True) == 30 * MiB  # never above separate
    assert communicator_bytes(0, 636.0, shared=True) == 0


def _plan_rows(capsys: pytest.CaptureFixture[str], gpu: str) -> tuple[str, dict[str, float]]:
    args = ["plan", "--recipe", "llama-tiny", "--cluster", f"nodes=1,gpus-per-node=4,gpu={gpu}",
            "--batch-size", "2", "--seq-len", "32", "--model-arg", "n_layers=4",
            "--strategies", "ddp,b-sdp", "--coverages", "0.5",
            "--mfu", "0.3"]  # a given rate: gpu=cpu would calibrate, memory does not need it
    assert main(args) == 0
    text = capsys.readouterr().out
    assert main([*args, "--json"]) == 0
    (table,) = json.loads(capsys.readouterr().out)
    return text, {r["label"]: r["peak_GB"] * 1e9 for r in table["rows"]}


def test_plan_prices_communicators_per_backend(capsys: pytest.CaptureFixture[str],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """gloo (gpu=cpu): no communicator memory; NCCL: 636 MiB per communicator, or with
    NCCL_COMM_SPLIT_SHARE_RESOURCES=1 the world's 636 and 48 per holder group; the
    assumptions line says which."""
    spec = BenchSpec(recipe="llama-tiny", strategy="b-sdp", world=4, batch=2, seq=32,
                     coverage=0.5, model_args=(("n_layers", 4),))
    recipe, meta = meta_model(spec)
    most = max(communicators_per_rank(make_bench_plan(spec, meta, recipe)))
    assert most > 1
    costs = recipe_costs(recipe, batch=2, seq=32, model_args={"n_layers": 4})
    bare = {"ddp": analytic_peak(spec.replace(strategy="ddp", coverage=1.0), costs),
            "b-sdp (C=0.5)": analytic_peak(spec, costs)}  # comm_mem_mb 0
    monkeypatch.delenv("NCCL_COMM_SPLIT_SHARE_RESOURCES", raising=False)
    text, peaks = _plan_rows(capsys, "cpu")
    assert peaks == pytest.approx(bare, rel=1e-12)
    assert "gloo ring collectives: no communicator memory" in text
    text, peaks = _plan_rows(capsys, "h100")
    assert peaks["ddp"] - bare["ddp"] == pytest.approx(636 * MiB)
    assert peaks["b-sdp (C=0.5)"] - bare["b-sdp (C=0.5)"] == pytest.approx(most * 636 * MiB)
    assert "636 MiB per communicator" in text and "separate buffers" in text
    monkeypatch.setenv("NCCL_COMM_SPLIT_SHARE_RESOURCES", "1")
    text, peaks = _plan_rows(capsys, "h100")
    assert peaks["b-sdp (C=0.5)"] - bare["b-sdp (C=0.5)"] == pytest.approx(
        (636 + (most - 1) * 48) * MiB)
    assert "NCCL_COMM_SPLIT_SHARE_RESOURCES=1: split with shared resources" in text


def test_budget_spec_reads_split_sharing(monkeypatch: pytest.MonkeyPatch) -> None:
    """plan --memory-gb A,B,... and train --memory-gb build their spec in one place, which
    takes the workers' NCCL_COMM_SPLIT_SHARE_RESOURCES as the advisor does."""
    from subnetdp.estimate.hetero import budget_spec
    from subnetdp.strategy import Composition

    def spec() -> BenchSpec:
        return budget_spec("llama-tiny", "b-sdp", world=4, batch=2, seq=32, comp=Composition(),
                           model_args={}, seed=0, min_holders=1, comm_mem_mb=636.0)

    monkeypatch.delenv("NCCL_COMM_SPLIT_SHARE_RESOURCES", raising=False)
    assert not spec().comm_split_shared
    monkeypatch.setenv("NCCL_COMM_SPLIT_SHARE_RESOURCES", "1")
    assert spec().comm_split_shared
