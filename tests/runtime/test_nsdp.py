"""Oracles for the n-sdp runtime (neuron level, physically narrowed layers).

The reference is written independently of subnetdp's slicing code: one process runs the *full*
model for each virtual worker with the hidden units it does not hold zeroed on their way into
the pair's ``down`` layer (a removed hidden unit, head or channel contributes exactly nothing,
so this equals the narrowed layer), then averages every gradient element by hand over the
workers that hold it.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from subnetdp.models import get_recipe
from subnetdp.plan import make_layered_plan, worker_bytes
from subnetdp.runtime import SubnetDataParallel
from subnetdp.subnet.build import build_full_model
from subnetdp.subnet.neurons import describe_neuron_units
from tests.dist.harness import run_workers
from tests.dist.neuron_ref import (
    SMALL,
    element_holders,
    hidden_masks,
    lm_loss,
    piece_of,
    small_batch,
    small_llama,
    small_plan,
)

pytestmark = pytest.mark.dist
STEPS = 3
LR = 0.1
LLAMA = get_recipe("llama-tiny")


def _train_sdp(rank: int, world: int, plan, cfg: dict, scaling: str) -> dict:
    sdp = SubnetDataParallel(small_llama(**cfg), plan=plan, adapter=LLAMA.adapter,
                             strategy="n-sdp", device="cpu", init_seed=3, output_scaling=scaling)
    opt = torch.optim.SGD(sdp.parameters(), lr=LR, momentum=0.9)
    losses, nbytes = [], []
    for step in range(STEPS):
        x, y = small_batch(rank, step)
        loss = lm_loss(sdp(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        nbytes.append(sdp.comm_stats.last_step_bytes)
    return {
        "losses": losses,
        "bytes": nbytes,
        "params_held": sdp.params_held,
        "pieces": sdp.shard_state(owned_only=False),
        "shapes": {k: tuple(v.shape) for k, v in sdp.module.state_dict().items()},
        "full": sdp.full_state_dict(),
        "groups": len(sdp.groups),
    }


# -- the independent reference ----------------------------------------------------------------
def _reference(plan, cfg: dict, scaling: str) -> dict[str, torch.Tensor]:
    full = build_full_model(small_llama(**cfg), get_recipe("llama-tiny").adapter, seed=3)
    opt = torch.optim.SGD(full.parameters(), lr=LR, momentum=0.9)
    for step in range(STEPS):
        sums = {n: torch.zeros_like(p) for n, p in full.named_parameters()}
        counts = {n: torch.zeros_like(p) for n, p in full.named_parameters()}
        for w in range(plan.world):
            hooks = [
                full.get_submodule(name).register_forward_pre_hook(
                    lambda _m, args, mask=mask: (args[0] * mask,)
                )
                for name, mask in hidden_masks(plan, full, w, scaling).items()
            ]
            full.zero_grad(set_to_none=True)
            x, y = small_batch(w, step)
            lm_loss(full(x), y).backward()
            for h in hooks:
                h.remove()
            for n, p in full.named_parameters():
                held = element_holders(plan, full, w)[n]
                sums[n] += p.grad * held
                counts[n] += held
        for n, p in full.named_parameters():
            assert bool((counts[n] >= 1).all()), n  # every element has a holder
            p.grad = sums[n] / counts[n]
        opt.step()
    return {k: v.detach().clone() for k, v in full.state_dict().items()}


CASES = {
    # plain multi-head attention, heads and FFN split, rotated windows, no output scaling
    "mha-ffn+heads": ({}, None, True, "none"),
    # grouped-query attention (2 K/V heads for 4 query heads), heads only, 1/keep scaling
    "gqa-heads-keep": ({"n_kv_heads": 2}, ["heads"], False, "keep"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_four_process_nsdp_matches_masked_reference(case: str) -> None:
    cfg, kinds, rotate, scaling = CASES[case]
    groups = 4 if kinds is None else 2
    plan = small_plan(4, 0.5, groups=groups, kinds=kinds, rotate=rotate, **cfg)
    results = run_workers(_train_sdp, 4, plan, cfg, scaling)
    ref = _reference(plan, cfg, scaling)
    # the assembled full model equals the reference (each piece taken from its owner)
    full = results[0]["full"]
    assert full is not None and list(full) == list(ref)
    for k, v in ref.items():
        torch.testing.assert_close(full[k], v, rtol=0, atol=1e-6)
    for rank, res in enumerate(results):
        assert all(torch.isfinite(torch.tensor(res["losses"])))
        # every piece every rank holds (not only owned ones) equals the reference: holder
        # copies are identical and the index maps put each slice where it belongs
        for name, value in res["pieces"].items():
            torch.testing.assert_close(value, piece_of(ref, name), rtol=0, atol=1e-6)
        # physically narrower: wq keeps k of G groups of rows; costs equal the analytic ones
        wq = res["shapes"]["layers.0.attn.wq.weight"]
        assert wq[0] == SMALL["dim"] // 2 and wq[1] == SMALL["dim"]
        wb = worker_bytes(plan, rank)
        assert res["params_held"] * 4 == wb.params
        assert res["bytes"] == [wb.allreduce_payload] * STEPS
        multi = {hs for hs in plan.holder_sets() if len(hs) > 1} | {tuple(range(4))}
        assert res["groups"] == len(multi)


def _train_ddp(rank: int, world: int) -> dict[str, torch.Tensor]:
    model = build_full_model(small_llama(), get_recipe("llama-tiny").adapter, seed=3)
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR, momentum=0.9)
    for step in range(STEPS):
        x, y = small_batch(rank, step)
        lm_loss(ddp(x), y).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _both(rank: int, world: int, plan) -> tuple[dict, dict]:
    return _train_sdp(rank, world, plan, {}, "none")["pieces"], _train_ddp(rank, world)


def test_nsdp_everyone_holds_everything_equals_ddp() -> None:
    plan = small_plan(2, 1.0, groups=2)
    for pieces, ddp_state in run_workers(_both, 2, plan):
        for name, value in pieces.items():
            torch.testing.assert_close(value, piece_of(ddp_state, name), rtol=0, atol=1e-6)


def _train_resnet(rank: int, world: int, plan) -> dict:
    recipe = get_recipe("resnet18-fmnist")
    with torch.device("meta"):
        model = recipe.build_model(width=4)
    sdp = SubnetDataParallel(model, plan=plan, adapter=recipe.adapter, strategy="n-sdp",
                             device="cpu")
    opt = torch.optim.SGD(sdp.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(rank)
    for _ in range(2):
        x = torch.randn(4, 1, 28, 28, generator=g) * (1 + rank)
        y = torch.randint(0, 10, (4,), generator=g)
        F.cross_entropy(sdp(x), y).backward()
        opt.step()
        opt.zero_grad()
    full = sdp.full_state_dict()  # averages BatchNorm statistics over holders first
    return {"full": full, "pieces": sdp.shard_state(owned_only=False),
            "conv1": tuple(sdp.module.state_dict()["layer1.0.residual.0.weight"].shape)}


def test_resnet_nsdp_channels_buffers_and_assembly() -> None:
    recipe = get_recipe("resnet18-fmnist")
    with torch.device("meta"):
        model = recipe.build_model(width=4)
    units, shared, layers = describe_neuron_units(model, recipe.adapter, groups=4)
    plan = make_layered_plan(world=4, units=units, layers=layers, coverage=0.5,
                             shared_size=shared)
    results = run_workers(_train_resnet, 4, plan)
    full = results[0]["full"]
    plain = recipe.build_model(width=4)
    plain.load_state_dict(full, strict=True)  # loads into the plain class
    assert results[0]["conv1"] == (2, 4, 3, 3)  # 2 of 4 intermediate channels
    for u in range(plan.num_units):  # holders agree on every piece, running stats included
        holders = plan.holders(u)
        for name, value in results[holders[0]]["pieces"].items():
            for h in holders[1:]:
                if name in results[h]["pieces"]:
                    assert torch.equal(value, results[h]["pieces"][name]), name
    for name, value in results[0]["pieces"].items():
        assert torch.isfinite(value.float()).all(), name
