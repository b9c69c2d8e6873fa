"""Oracles for the b-sdp runtime: DDP parity, a hand-averaged single-process reference,
identical holder copies, and costs that equal the plan's analytic figures."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from subnetdp.plan import PlanError, make_plan, worker_bytes
from subnetdp.runtime import SubnetDataParallel
from subnetdp.subnet.build import build_full_model
from subnetdp.subnet.units import describe_units
from tests.dist.harness import run_workers
from tests.dist.toy import TOY_ADAPTER, Toy, toy_batch, toy_loss

pytestmark = pytest.mark.dist
STEPS = 4
LR = 0.1


def _optimizer(params):
    # SGD, not Adam: Adam's update is nearly invariant to the gradient's scale, so it would
    # hide a wrong divisor (holders vs world) that SGD exposes.
    return torch.optim.SGD(params, lr=LR, momentum=0.9)


def _toy_plan(world: int, coverage: float, scheme: str = "spread"):
    with torch.device("meta"):
        units, shared = describe_units(Toy(), TOY_ADAPTER)
    return make_plan(world=world, units=units, coverage=coverage, scheme=scheme, shared_size=shared)


def _train_sdp(rank: int, world: int, plan, steps: int, bucket_cap_mb: float = 25.0) -> dict:
    with torch.device("meta"):
        model = Toy()
    sdp = SubnetDataParallel(model, plan=plan, adapter=TOY_ADAPTER, device="cpu", init_seed=7,
                             bucket_cap_mb=bucket_cap_mb)
    opt = _optimizer(sdp.parameters())
    history, bytes_per_step, collectives, overlapped = [], [], [], []
    for step in range(steps):
        x, y = toy_batch(rank, step)
        toy_loss(sdp(x), y).backward()
        opt.step()
        opt.zero_grad()
        history.append({k: v.detach().clone() for k, v in sdp.module.named_parameters()})
        bytes_per_step.append(sdp.comm_stats.last_step_bytes)
        collectives.append(sdp.comm_stats.last_step_collectives)
        overlapped.append(sdp.comm_stats.last_step_overlapped)
    return {
        "history": history,
        "bytes": bytes_per_step,
        "collectives": collectives,
        "overlapped": overlapped,
        "buckets": len(sdp.backend.reducer.buckets),
        "params_held": sdp.params_held,
        "held": sdp.held_units,
        "groups": len(sdp.groups),
        "full": sdp.full_state_dict(),
    }


def _train_ddp(rank: int, world: int, steps: int) -> dict:
    with torch.device("meta"):
        model = Toy()
    model = build_full_model(model, TOY_ADAPTER, seed=7)
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = _optimizer(ddp.parameters())
    for step in range(steps):
        x, y = toy_batch(rank, step)
        toy_loss(ddp(x), y).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in ddp.module.named_parameters()}


def _both(rank: int, world: int, plan, steps: int) -> tuple[dict, dict]:
    return _train_sdp(rank, world, plan, steps)["history"][-1], _train_ddp(rank, world, steps)


def test_everyone_holds_everything_equals_ddp() -> None:
    plan = _toy_plan(world=2, coverage=1.0)
    for sdp_params, ddp_params in run_workers(_both, 2, plan, STEPS):
        assert sdp_params.keys() == ddp_params.keys()
        for k in sdp_params:
            torch.testing.assert_close(sdp_params[k], ddp_params[k], rtol=0, atol=1e-6)


class _Skip(nn.Module):  # the reference's own stand-in for a removed block
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def _hand_averaged_grads(full: Toy, blocks: list[nn.Module], plan, step: int) -> None:
    """Set ``full``'s grads to the holder averages of the virtual workers' gradients."""
    sums = {n: torch.zeros_like(p) for n, p in full.named_parameters()}
    counts = dict.fromkeys(sums, 0)
    for w in range(plan.world):
        held = set(plan.held_units(w))
        full.blocks = nn.ModuleList(b if i in held else _Skip() for i, b in enumerate(blocks))
        full.zero_grad(set_to_none=True)
        x, y = toy_batch(w, step)
        toy_loss(full(x), y).backward()
        for n, p in full.named_parameters():
            if p.grad is not None:
                sums[n] += p.grad
                counts[n] += 1
    full.blocks = nn.ModuleList(blocks)
    for n, p in full.named_parameters():
        unit = int(n.split(".")[1]) if n.startswith("blocks.") else None
        expected = plan.world if unit is None else len(plan.holders(unit))
        assert counts[n] == expected, n
        p.grad = sums[n] / counts[n]


def _reference_model() -> Toy:
    with torch.device("meta"):
        model = Toy()
    return build_full_model(model, TOY_ADAPTER, seed=7)


def _reference(plan, steps: int) -> list[dict[str, torch.Tensor]]:
    """One process, N virtual workers: each runs its subnetwork on its own batch; every
    parameter's gradient is then averaged by hand over the workers that hold it."""
    full = _reference_model()
    opt = _optimizer(full.parameters())
    blocks = list(full.blocks)
    history = []
    for step in range(steps):
        _hand_averaged_grads(full, blocks, plan, step)
        opt.step()
        history.append({n: p.detach().clone() for n, p in full.named_parameters()})
    return history


@pytest.fixture(scope="module")
def four_workers():
    plan = _toy_plan(world=4, coverage=0.5)
    return plan, run_workers(_train_sdp, 4, plan, STEPS)


def test_four_process_bsdp_matches_hand_averaged_reference(four_workers) -> None:
    plan, results = four_workers
    ref = _reference(plan, STEPS)
    for rank, res in enumerate(results):
        assert res["held"] == plan.held_units(rank)
        for step in range(STEPS):
            local = res["history"][step]
            for name, value in local.items():
                torch.testing.assert_close(value, ref[step][name], rtol=0, atol=1e-6)
        # forward masking: the rank has no parameters of units it does not hold
        held_prefixes = {f"blocks.{u}." for u in plan.held_units(rank)}
        for name in res["history"][0]:
            if name.startswith("blocks."):
                assert any(name.startswith(p) for p in held_prefixes), name


def test_random_plan_small_buckets_matches_reference() -> None:
    """Many holder sets and one-parameter buckets: still no deadlock, still exact, and every
    bucket but the last is all-reduced while backward still produces other gradients."""
    plan = _toy_plan(world=4, coverage=0.5, scheme="random")
    assert set(plan.holder_sets()) != set(_toy_plan(world=4, coverage=0.5).holder_sets())
    results = run_workers(_train_sdp, 4, plan, 2, 1e-6)
    ref = _reference(plan, 2)
    for res in results:
        for name, value in res["history"][-1].items():
            torch.testing.assert_close(value, ref[-1][name], rtol=0, atol=1e-6)
        assert res["buckets"] > 10
        assert res["collectives"] == [res["buckets"]] * 2
        assert res["overlapped"] == [res["buckets"] - 1] * 2


def test_holder_copies_identical_after_every_step(four_workers) -> None:
    plan, results = four_workers
    for step in range(STEPS):
        for u in range(plan.num_units):
            holders = plan.holders(u)
            first = results[holders[0]]["history"][step]
            for h in holders[1:]:
                other = results[h]["history"][step]
                for name, value in first.items():
                    if name.startswith(f"blocks.{u}."):
                        assert torch.equal(value, other[name]), (step, u, h, name)


def test_costs_equal_plan_analytic_figures(four_workers) -> None:
    plan, results = four_workers
    for rank, res in enumerate(results):
        wb = worker_bytes(plan, rank)
        assert res["params_held"] * 4 == wb.params
        assert res["bytes"] == [wb.allreduce_payload] * STEPS
        # one group per distinct holder set of two or more ranks (the world's is the default)
        multi = {hs for hs in plan.holder_sets() if len(hs) > 1} | {tuple(range(plan.world))}
        assert res["groups"] == len(multi)
    # b-sdp at C = 0.5 sends strictly less than DDP would
    ddp_bytes = (plan.shared_size + sum(u.size for u in plan.units)) * 4
    assert all(r["bytes"][0] < ddp_bytes for r in results)


def test_assembled_full_model_equals_reference(four_workers) -> None:
    plan, results = four_workers
    ref = _reference(plan, STEPS)[-1]
    full = results[0]["full"]
    assert full is not None and list(full) == [k for k in Toy().state_dict()]
    for name, value in ref.items():
        torch.testing.assert_close(full[name], value, rtol=0, atol=1e-6)
    assert all(r["full"] is None for r in results[1:])


def _wrap_with(rank: int, world: int, plan) -> str:
    with torch.device("meta"):
        model = Toy()
    try:
        SubnetDataParallel(model, plan=plan, adapter=TOY_ADAPTER, device="cpu")
    except PlanError as e:
        return str(e)
    return ""


def test_world_size_mismatch_is_a_clear_error() -> None:
    plan = _toy_plan(world=4, coverage=0.5)
    messages = run_workers(_wrap_with, 2, plan)
    assert all("4" in m and "2" in m for m in messages), messages


def test_plan_for_another_model_is_refused() -> None:
    plan = make_plan(world=2, units=5, coverage=1.0)
    messages = run_workers(_wrap_with, 2, plan)
    assert all("5 units" in m for m in messages), messages


def _materialised_then_wrapped(rank: int, world: int, plan) -> dict:
    torch.manual_seed(rank)  # deliberately different values on every rank
    model = Toy()
    sdp = SubnetDataParallel(copy.deepcopy(model), plan=plan, adapter=TOY_ADAPTER, device="cpu")
    return {k: v.detach().clone() for k, v in sdp.module.named_parameters()}


def test_materialised_model_is_broadcast_from_owners() -> None:
    plan = _toy_plan(world=4, coverage=0.5)
    results = run_workers(_materialised_then_wrapped, 4, plan)
    for u in range(plan.num_units):
        holders = plan.holders(u)
        for h in holders[1:]:
            for name, v in results[holders[0]].items():
                if name.startswith(f"blocks.{u}."):
                    assert torch.equal(v, results[h][name])
    for r in results[1:]:
        assert torch.equal(r["embed.weight"], results[0]["embed.weight"])


def _no_sync_accumulates(rank: int, world: int, plan) -> tuple[dict, dict]:
    with torch.device("meta"):
        a, b = Toy(), Toy()
    sdp_a = SubnetDataParallel(a, plan=plan, adapter=TOY_ADAPTER, device="cpu", init_seed=3)
    sdp_b = SubnetDataParallel(b, plan=plan, adapter=TOY_ADAPTER, device="cpu", init_seed=3)
    x0, y0 = toy_batch(rank, 0)
    x1, y1 = toy_batch(rank, 1)
    with sdp_a.no_sync():
        (toy_loss(sdp_a(x0), y0) / 2).backward()
    (toy_loss(sdp_a(x1), y1) / 2).backward()
    x = torch.cat([x0, x1])
    y = torch.cat([y0, y1])
    toy_loss(sdp_b(x), y).backward()
    assert dist.get_world_size() == world
    return (
        {k: p.grad.clone() for k, p in sdp_a.module.named_parameters()},
        {k: p.grad.clone() for k, p in sdp_b.module.named_parameters()},
    )


def test_no_sync_gradient_accumulation_equals_large_batch() -> None:
    plan = _toy_plan(world=2, coverage=0.5)
    for acc, big in run_workers(_no_sync_accumulates, 2, plan):
        for k in acc:
            torch.testing.assert_close(acc[k], big[k], rtol=1e-5, atol=1e-6)


def _clip(rank: int, world: int, plan) -> tuple[float, dict]:
    with torch.device("meta"):
        model = Toy()
    sdp = SubnetDataParallel(model, plan=plan, adapter=TOY_ADAPTER, device="cpu", init_seed=7)
    x, y = toy_batch(rank, 0)
    toy_loss(sdp(x), y).backward()
    norm = sdp.clip_grad_norm_(0.05)
    return norm.item(), {k: p.grad.clone() for k, p in sdp.module.named_parameters()}


def test_clip_grad_norm_uses_the_full_model_norm() -> None:
    """Every rank clips by the same (full-model) norm, so holders stay identical."""
    plan = _toy_plan(world=4, coverage=0.5)
    full = _reference_model()
    _hand_averaged_grads(full, list(full.blocks), plan, step=0)
    grads = {n: p.grad for n, p in full.named_parameters()}
    ref_norm = torch.sqrt(sum(g.square().sum() for g in grads.values())).item()
    assert ref_norm > 0.05  # the clip must bite
    for norm, clipped in run_workers(_clip, 4, plan):
        assert abs(norm - ref_norm) < 1e-5 * ref_norm
        for name, g in clipped.items():
            torch.testing.assert_close(g, grads[name] * 0.05 / (ref_norm + 1e-6),
                                       rtol=1e-5, atol=1e-7)
