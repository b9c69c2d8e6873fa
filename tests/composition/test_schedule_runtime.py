"""The schedule checker's model is what FSDP2 really issues (plan.schedule, runtime.fsdp).

Each worker records every all-gather and reduce-scatter FSDP2 sends (kind and group; over
gloo the reduce-scatter is ``runtime.ring``'s) during one training step and compares the
sequence with ``plan.schedule.fsdp_schedule`` for its rank: so the checker proves the schedule
the runtime runs, prefetch included, and prefetch on really moves the all-gathers. A
configuration the checker rejects is refused when wrapping, on every rank, before any
collective.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch.distributed as dist
import torch.nn.functional as F

from subnetdp.plan import Plan, explicit_plan, make_plan
from subnetdp.plan.schedule import ADJACENT, DEFAULT, OFF, ScheduleError, fsdp_schedule
from subnetdp.runtime import SubnetDataParallel, ring
from subnetdp.runtime.backends import _part_order
from subnetdp.subnet.units import describe_units
from tests.composition.test_fsdp_ac_bf16 import WORLD, _batch, _meta_model, _plan
from tests.dist.harness import run_workers


def _record(rank: int, world: int, strategy: str, plan: Plan, prefetch: bool) -> Any:
    recipe, model = _meta_model()
    sdp = SubnetDataParallel(model, plan=plan, adapter=recipe.adapter, strategy=strategy,
                             device="cpu", fsdp=True, activation_checkpointing=True,
                             fsdp_prefetch=prefetch)
    seen: list[tuple[str, tuple[int, ...]]] = []
    originals = {k: getattr(dist, k) for k in ("all_gather_single", "reduce_scatter_single")}

    def spy(kind: str) -> Any:
        def call(*args: Any, group: Any = None, **kw: Any) -> Any:
            seen.append((kind, tuple(dist.get_process_group_ranks(group))))
            return originals[f"{kind}_single"](*args, group=group, **kw)
        return call

    order = None
    if strategy == "n-sdp":
        order = [u for u in _part_order(sdp.module, sdp.pieces, set(sdp.held_units))
                 if plan.holds(rank, u)]
    ring_rs = ring.ring_reduce_scatter  # gloo's reduce-scatter is runtime.ring's

    def ring_spy(out: Any, inp: Any, group: Any) -> None:
        seen.append(("reduce_scatter", tuple(dist.get_process_group_ranks(group))))
        ring_rs(out, inp, group)

    sequences = []
    for step in range(2):  # step 0 includes FSDP's lazy init; step 1 is the steady state
        seen.clear()
        dist.all_gather_single = spy("all_gather")  # type: ignore[attr-defined]
        dist.reduce_scatter_single = spy("reduce_scatter")  # type: ignore[attr-defined]
        ring.ring_reduce_scatter = ring_spy
        try:
            x, y = _batch("llama", rank, step)
            logits = sdp(x)
            F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)).backward()
        finally:
            for k, f in originals.items():
                setattr(dist, k, f)
            ring.ring_reduce_scatter = ring_rs
        sequences.append([s for s in seen if len(s[1]) > 1])
    return sequences, order


def _expected(plan: Plan, rank: int, mode: str, order: list[int] | None) -> list[Any]:
    ops = fsdp_schedule(plan, rank, prefetch=mode, order=order, step_end=(),
                        reshard_after_forward=order is None)
    return [(o.kind, o.group) for o in ops if len(o.group) > 1]


@pytest.mark.parametrize(("strategy", "prefetch"), [
    ("b-sdp", True), ("b-sdp", False), ("bb-sdp", True), ("n-sdp", True)])
def test_runtime_issues_the_checked_schedule(strategy: str, prefetch: bool) -> None:
    plan = _plan(strategy)
    mode = ADJACENT if prefetch else OFF
    runs = run_workers(_record, WORLD, strategy, plan, prefetch)
    for rank, (steps, order) in enumerate(runs):
        want = _expected(plan, rank, mode if strategy != "n-sdp" else OFF, order)
        assert steps[1] == want, f"rank {rank}"
    if strategy == "b-sdp" and prefetch:  # prefetch really reorders the backward all-gathers
        assert any(_expected(plan, r, ADJACENT, None) != _expected(plan, r, OFF, None)
                   for r in range(WORLD))
        # the order is stable: lazy init adds nothing (steps 0 and 1 issue the same)
        for steps, _ in runs:
            assert steps[0] == steps[1] and steps[0]


@pytest.mark.parametrize("family", ["random", "explicit"])
def test_other_plan_families(family: str) -> None:
    """A random plan, and an explicit one with units held by one rank only (one-rank meshes
    between shared groups)."""
    recipe, model = _meta_model()
    units, shared = describe_units(model, recipe.adapter)
    if family == "random":
        plan = make_plan(world=WORLD, units=units, coverage=0.5, scheme="random", seed=3,
                         shared_size=shared)
    else:
        rows = [[1, 1, 0, 0, 1, 0, 0, 1], [0, 1, 1, 0, 0, 0, 1, 0],
                [0, 0, 1, 1, 0, 1, 0, 0], [0, 0, 0, 1, 1, 0, 1, 0]]
        plan = explicit_plan(rows, units=units, shared_size=shared)
        assert min(plan.holder_counts()) == 1
    for rank, (steps, _) in enumerate(run_workers(_record, WORLD, "b-sdp", plan, True)):
        assert steps[1] == _expected(plan, rank, ADJACENT, None), f"rank {rank}"


def _wrap_with_default_prefetch(rank: int, world: int, plan: Plan) -> str:
    import subnetdp.runtime.backends as backends

    backends.ADJACENT = DEFAULT  # what FSDP2 does by itself: the checker must refuse it
    recipe, model = _meta_model()
    try:
        SubnetDataParallel(model, plan=plan, adapter=recipe.adapter, strategy="b-sdp",
                           device="cpu", fsdp=True)
    except ScheduleError as e:
        return str(e)
    return "built"


def test_unsafe_schedule_refused_when_wrapping() -> None:
    recipe, model = _meta_model()
    units, shared = describe_units(model, recipe.adapter)
    plan = make_plan(world=WORLD, units=units, coverage=0.5, shared_size=shared)
    for msg in run_workers(_wrap_with_default_prefetch, WORLD, plan, timeout=60):
        assert "cannot be ordered (deadlock)" in msg
