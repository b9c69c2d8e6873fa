"""A heterogeneous plan (balanced scheme, per-rank capacities 1 : 0.5 : 0.5 : 0.5): ranks hold
unequal numbers of units and units unequal numbers of holders; the 4-process run still equals
the hand-averaged single-process reference, holder copies stay identical and the bytes sent
equal the plan's analytic figures."""

from __future__ import annotations

import pytest
import torch

from subnetdp.plan import make_plan, worker_bytes
from subnetdp.subnet.units import describe_units
from tests.dist.harness import run_workers
from tests.dist.toy import TOY_ADAPTER, Toy
from tests.runtime.test_bsdp import _reference, _train_sdp

pytestmark = pytest.mark.dist
STEPS = 3


def test_heterogeneous_plan_matches_reference() -> None:
    with torch.device("meta"):
        units, shared = describe_units(Toy(), TOY_ADAPTER)
    plan = make_plan(world=4, units=units, coverage=1.0, scheme="balanced",
                     capacities=[1.0, 0.5, 0.5, 0.5], shared_size=shared)
    counts = [len(plan.held_units(r)) for r in range(4)]
    assert counts[0] == plan.num_units and max(counts[1:]) < plan.num_units
    assert len(set(plan.holder_counts())) > 1  # units with unequal holder counts
    results = run_workers(_train_sdp, 4, plan, STEPS)
    ref = _reference(plan, STEPS)
    for rank, res in enumerate(results):
        assert res["held"] == plan.held_units(rank)
        wb = worker_bytes(plan, rank)
        assert res["params_held"] * 4 == wb.params
        assert res["bytes"] == [wb.allreduce_payload] * STEPS
        for step in range(STEPS):
            for name, value in res["history"][step].items():
                torch.testing.assert_close(value, ref[step][name], rtol=0, atol=1e-6)
    for u in range(plan.num_units):
        first, *others = plan.holders(u)
        for h in others:
            for name, value in results[first]["history"][-1].items():
                if name.startswith(f"blocks.{u}."):
                    assert torch.equal(value, results[h]["history"][-1][name])


RESNET = ["--recipe", "resnet18-fmnist", "--model-arg", "width=4", "--batch-size", "4",
          "--eval-batches", "1", "--memory-step", "-1", "--no-progress", "--steps", "2"]


def test_train_capacities_gives_ranks_unequal_units(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """``subnetdp train --capacities 1,0.5,0.5,0.5``: one balanced plan on every rank, rank 0
    holding every unit and the others fewer, trained end to end."""
    import json

    from subnetdp.cli import main
    from subnetdp.plan import Plan

    out = tmp_path / "caps"
    assert main(["train", *RESNET, "--nproc", "4", "--capacities", "1,0.5,0.5,0.5",
                 "--out", str(out)]) == 0
    plan = Plan.from_json((out / "plan.json").read_text())
    counts = [len(plan.held_units(r)) for r in range(4)]
    assert plan.scheme == "balanced" and counts[0] == plan.num_units > max(counts[1:])
    summary = json.loads((out / "summary.json").read_text())
    assert summary["plan"]["param_coverage"][0] == 1.0 > max(summary["plan"]["param_coverage"][1:])


def test_train_memory_gb_plans_within_the_budgets(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """``subnetdp train --memory-gb A,B``: the launcher makes an estimator-checked plan (the
    budget table is the one ``subnetdp plan --memory-gb`` prints), the workers train it."""
    from subnetdp.cli import main
    from subnetdp.estimate.hetero import GB
    from subnetdp.estimate.memory import estimate_memory
    from subnetdp.estimate.spec import BenchSpec
    from subnetdp.plan import Plan

    base = BenchSpec(recipe="resnet18-fmnist", strategy="b-sdp", world=2, batch=4, seq=2,
                     model_args=(("width", 4),))
    full = estimate_memory(base.replace(coverage=1.0)).peak_bytes / GB
    budgets = f"{full:.6g},{0.6 * full:.6g}"
    out = tmp_path / "budget"
    assert main(["train", *RESNET, "--nproc", "2", "--memory-gb", budgets,
                 "--out", str(out)]) == 0
    plan = Plan.from_json((out / "plan.json").read_text())
    assert len(plan.held_units(0)) > len(plan.held_units(1))
    assert (out / "budget_plan.json").exists()


@pytest.mark.parametrize(("args", "message"), [
    (["--capacities", "1,0.5"], "one capacity per worker: 2 for world=4"),
    (["--capacities", "1,0.5,0.5,0.5", "--memory-gb", "1,1,1,1"], "not both"),
    (["--capacities", "1,0.5,0.5,0.5", "--strategy", "ddp"], "block-level SDP strategies only"),
    (["--capacities", "1,2,0.5,0.5"], "in (0, 1]"),
])
def test_bad_heterogeneous_input_is_a_one_line_error(args, message, tmp_path,  # type: ignore[no-untyped-def]
                                                      capsys) -> None:
    from subnetdp.cli import main

    assert main(["train", *RESNET, "--nproc", "4", "--out", str(tmp_path / "x"), *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
