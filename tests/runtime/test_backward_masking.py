"""Oracles for backward masking (bb-sdp, nb-sdp): full forward, gradients and optimizer state
only for held units, owners refresh the others.

The reference runs the full model once per virtual worker on that worker's batch and averages
every gradient *element* by hand over the workers that hold it (an element's holders come from
the plan's unit names, ``tests.dist.neuron_ref``), then takes one SGD step.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from subnetdp.metrics.memory import measure_step_memory
from subnetdp.models import get_recipe
from subnetdp.plan import make_plan, worker_bytes
from subnetdp.runtime import SubnetDataParallel
from subnetdp.subnet.build import build_full_model
from subnetdp.subnet.units import describe_units
from tests.dist.harness import run_workers
from tests.dist.neuron_ref import (
    element_holders,
    lm_loss,
    small_batch,
    small_llama,
    small_plan,
)

pytestmark = pytest.mark.dist
STEPS = 3
LR = 0.1
LLAMA = get_recipe("llama-tiny")


def _block_plan(world: int, coverage: float):
    units, shared = describe_units(small_llama(), LLAMA.adapter)
    return make_plan(world=world, units=units, coverage=coverage, shared_size=shared)


def _holders_by_block(plan, model: nn.Module, worker: int) -> dict[str, torch.Tensor]:
    held = set(plan.held_units(worker))
    out = {}
    for n, p in model.named_parameters():
        unit = int(n.split(".")[1]) if n.startswith("layers.") else None
        out[n] = torch.full_like(p, 1.0 if unit is None or unit in held else 0.0)
    return out


def _element_mask(strategy: str, plan, model: nn.Module, worker: int) -> dict:
    if strategy == "bb-sdp":
        return _holders_by_block(plan, model, worker)
    return element_holders(plan, model, worker)


def _train(rank: int, world: int, plan, strategy: str, same_batch: bool, opt_name: str) -> dict:
    sdp = SubnetDataParallel(small_llama(), plan=plan, adapter=LLAMA.adapter, strategy=strategy,
                             device="cpu", init_seed=3)
    if opt_name == "sgd":
        opt: torch.optim.Optimizer = torch.optim.SGD(sdp.parameters(), lr=LR, momentum=0.9)
    else:
        opt = torch.optim.AdamW(sdp.parameters(), lr=1e-3)
    states, grads_held, refresh = [], [], []
    memory = {}
    for step in range(STEPS):
        x, y = small_batch(0 if same_batch else rank, step)
        if step == STEPS - 1:  # measured like the trainer does: MemTracker, steady state
            _, report = measure_step_memory(lambda x=x, y=y: lm_loss(sdp(x), y).backward(),
                                            modules=sdp.tracked_modules(), optimizers=[opt],
                                            grad_tensors=sdp.grad_buffers())
            memory = report.breakdown
        else:
            lm_loss(sdp(x), y).backward()
        grads_held.append(sum(p.grad.numel() for p in sdp.parameters() if p.grad is not None))
        grads_full = [n for n, p in sdp.module.named_parameters() if p.grad is not None
                      and n not in dict(sdp.trainable.params)]
        assert not grads_full, grads_full  # no full-size gradient survives backward
        opt.step()
        opt.zero_grad()
        refresh.append(sdp.refresh())  # what the next forward would do by itself
        states.append({k: v.detach().clone() for k, v in sdp.module.state_dict().items()})
    opt_elems = sum(t.numel() for s in opt.state.values() for k, t in s.items()
                    if torch.is_tensor(t) and t.ndim > 0)
    return {"states": states, "grads": grads_held, "refresh": refresh,
            "received": sdp.backend.refresher.bytes_received if sdp.backend.refresher else 0,
            "trained": sdp.params_trained, "held": sdp.params_held, "opt": opt_elems,
            "memory": memory,
            "bytes": sdp.comm_stats.last_step_bytes}


def _reference(plan, strategy: str, same_batch: bool) -> list[dict[str, torch.Tensor]]:
    full = build_full_model(small_llama(), LLAMA.adapter, seed=3)
    opt = torch.optim.SGD(full.parameters(), lr=LR, momentum=0.9)
    history = []
    for step in range(STEPS):
        sums = {n: torch.zeros_like(p) for n, p in full.named_parameters()}
        counts = {n: torch.zeros_like(p) for n, p in full.named_parameters()}
        for w in range(plan.world):
            full.zero_grad(set_to_none=True)
            x, y = small_batch(0 if same_batch else w, step)
            lm_loss(full(x), y).backward()
            mask = _element_mask(strategy, plan, full, w)
            for n, p in full.named_parameters():
                sums[n] += p.grad * mask[n]
                counts[n] += mask[n]
        for n, p in full.named_parameters():
            p.grad = sums[n] / counts[n]
        opt.step()
        history.append({k: v.detach().clone() for k, v in full.state_dict().items()})
    return history


def _ddp(rank: int, world: int, same_batch: bool) -> list[dict[str, torch.Tensor]]:
    model = build_full_model(small_llama(), LLAMA.adapter, seed=3)
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR, momentum=0.9)
    history = []
    for step in range(STEPS):
        x, y = small_batch(0 if same_batch else rank, step)
        lm_loss(ddp(x), y).backward()
        opt.step()
        opt.zero_grad()
        history.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    return history


def _plan_for(strategy: str, world: int, coverage: float):
    return _block_plan(world, coverage) if strategy == "bb-sdp" else \
        small_plan(world, coverage, groups=world)


def _sdp_and_ddp(rank: int, world: int, plan, strategy: str, same: bool):
    return _train(rank, world, plan, strategy, same, "sgd")["states"], _ddp(rank, world, same)


@pytest.mark.parametrize("strategy", ["bb-sdp", "nb-sdp"])
def test_same_batch_everywhere_equals_ddp(strategy: str) -> None:
    """Identical data gives identical gradients on every worker, so averaging over holders
    equals averaging over everyone: the (unbiased) backward-masked step is DDP's step. And
    with C = 1, different data, it is DDP."""
    for coverage, same in ((0.5, True), (1.0, False)):
        plan = _plan_for(strategy, 4 if coverage < 1 else 2, coverage)
        for sdp_states, ddp_states in run_workers(_sdp_and_ddp, plan.world, plan, strategy,
                                                  same):
            for step in range(STEPS):
                for k, v in ddp_states[step].items():
                    torch.testing.assert_close(sdp_states[step][k], v, rtol=0, atol=1e-6,
                                               msg=f"{coverage} {step} {k}")


@pytest.mark.parametrize("strategy", ["bb-sdp", "nb-sdp"])
def test_four_processes_match_reference_with_exact_costs(strategy: str) -> None:
    plan = _plan_for(strategy, 4, 0.5)
    results = run_workers(_train, 4, plan, strategy, False, "sgd")
    ref = _reference(plan, strategy, False)
    total = plan.total_size
    for rank, res in enumerate(results):
        wb = worker_bytes(plan, rank, masking="backward")
        for step in range(STEPS):  # refresh_every=1: every full copy equals the reference
            for k, v in ref[step].items():
                torch.testing.assert_close(res["states"][step][k], v, rtol=0, atol=1e-6,
                                           msg=f"rank {rank} step {step} {k}")
        assert res["held"] == total and res["held"] * 4 == wb.params  # the full model stays
        assert res["trained"] * 4 == wb.grads < wb.params
        assert res["grads"] == [wb.grads // 4] * STEPS  # gradients only for what is held
        assert res["refresh"] == [wb.refresh_sent] * STEPS
        assert res["received"] == wb.refresh_received
        assert res["bytes"] == wb.allreduce_payload
    # every unit's bytes leave its owner once per non-holder and arrive once per non-holder
    assert sum(r["refresh"][0] for r in results) == sum(r["received"] for r in results) > 0


@pytest.mark.parametrize("strategy", ["bb-sdp", "nb-sdp"])
def test_optimizer_state_only_for_held(strategy: str) -> None:
    # 4 workers at C = 0.5: every unit has two holders, so all its gradients live in the
    # reducer's buckets, which exist before the measured step (a unit held alone would get
    # its gradient during backward, after the forward's activation peak)
    plan = _plan_for(strategy, 4, 0.5)
    for rank, res in enumerate(run_workers(_train, 4, plan, strategy, False, "adamw")):
        wb = worker_bytes(plan, rank, masking="backward")
        assert res["opt"] * 4 == wb.optimizer
        # measured peak by category: the full model's parameters, gradients only for what is
        # held; the optimizer also keeps one 4-byte ``step`` scalar per trained tensor
        mem = res["memory"]
        assert mem["params"] == wb.params and mem["grads"] == wb.grads
        assert 0 <= mem["optimizer"] - wb.optimizer <= 4 * 64


def _train_refresh_every(rank: int, world: int, plan, every: int) -> list[dict]:
    sdp = SubnetDataParallel(small_llama(), plan=plan, adapter=LLAMA.adapter,
                             strategy="bb-sdp", device="cpu", init_seed=3, refresh_every=every)
    opt = torch.optim.SGD(sdp.parameters(), lr=LR)
    sent = []
    for step in range(4):
        x, y = small_batch(rank, step)
        lm_loss(sdp(x), y).backward()  # the forward refreshes by itself when due
        opt.step()
        opt.zero_grad()
        sent.append(sdp.comm_stats.total_refresh_bytes)
    return sent


def test_refresh_every_k_steps_runs_before_the_forward() -> None:
    plan = _plan_for("bb-sdp", 2, 0.5)
    wb = [worker_bytes(plan, r, masking="backward").refresh_sent for r in range(2)]
    for rank, sent in enumerate(run_workers(_train_refresh_every, 2, plan, 2)):
        # refreshes happen before the forwards of steps 2 (after 2 reductions) only
        assert sent == [0, 0, wb[rank], wb[rank]]


def _step_flops(rank: int, world: int, plan) -> tuple[float, float, float]:
    x, y = small_batch(rank, 0)
    full = build_full_model(small_llama(), LLAMA.adapter, seed=3)
    with FlopCounterMode(display=False) as counted:
        lm_loss(full(x), y).backward()
    sdp = SubnetDataParallel(small_llama(), plan=plan, adapter=LLAMA.adapter, strategy="nb-sdp",
                             device="cpu", init_seed=3)
    with FlopCounterMode(display=False) as nb:
        lm_loss(sdp(x), y).backward()
    # the weight-gradient GEMM FLOPs of the elements this rank does not hold, by hand
    masks = element_holders(plan, full, rank)
    unheld = sum(2 * x.numel() * float((1 - masks[f"{name}.weight"]).sum())
                 for name, m in full.named_modules() if isinstance(m, nn.Linear))
    return counted.get_total_flops(), nb.get_total_flops(), unheld


def test_nb_sdp_computes_only_held_weight_gradients() -> None:
    # nb-sdp's step = the full model's step less the non-held slices' weight gradients, exactly
    plan = _plan_for("nb-sdp", 2, 0.5)
    for full, nb, unheld in run_workers(_step_flops, 2, plan):
        assert unheld > 0.1 * full
        assert nb == full - unheld
