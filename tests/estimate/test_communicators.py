"""Communicators per rank (plan.communicators) and their memory in the estimator
(estimate.communicators, [Note: communicator memory]).

Oracles: counts by hand on an explicit plan; the documented NCCL formula; the estimator's
``communicators`` category equals count x ``comm_mem_mb`` per rank and is part of its peak.
"""

from __future__ import annotations

from subnetdp.estimate.communicators import DEFAULT_COMM_MB, MiB, NcclBuffers
from subnetdp.estimate.memory import estimate_memory
from subnetdp.estimate.spec import BenchSpec, make_bench_plan, meta_model
from subnetdp.plan import Plan, Unit
from subnetdp.plan.communicators import communicators_per_rank
from subnetdp.plan.diagnostics import diagnostics


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
