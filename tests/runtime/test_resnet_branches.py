"""b-sdp on a model whose units are residual *branches* with BatchNorm: removed branches add
zero, running statistics are averaged over holders, and the assembled state dict loads into
the plain model class."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from subnetdp.models import get_recipe
from subnetdp.models.resnet.model import ResNet18
from subnetdp.plan import make_plan
from subnetdp.runtime import SubnetDataParallel
from subnetdp.subnet.units import describe_units
from tests.dist.harness import run_workers

pytestmark = pytest.mark.dist


def _train(rank: int, world: int, plan) -> dict:
    recipe = get_recipe("resnet18-fmnist")
    with torch.device("meta"):
        model = recipe.build_model(width=4)
    sdp = SubnetDataParallel(model, plan=plan, adapter=recipe.adapter, device="cpu")
    opt = torch.optim.SGD(sdp.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(rank)
    for _ in range(2):
        x = torch.randn(8, 1, 28, 28, generator=g) * (1 + rank)  # ranks see different stats
        y = torch.randint(0, 10, (8,), generator=g)
        F.cross_entropy(sdp(x), y).backward()
        opt.step()
        opt.zero_grad()
    before = {k: v.clone() for k, v in sdp.module.state_dict().items() if "running" in k}
    full = sdp.full_state_dict()  # syncs buffers first
    after = {k: v.clone() for k, v in sdp.module.state_dict().items() if "running" in k}
    local = {k: v.clone() for k, v in sdp.module.state_dict().items()}
    return {"before": before, "after": after, "full": full, "held": sdp.held_units,
            "local": local}


def test_resnet_bsdp_buffers_and_assembly() -> None:
    with torch.device("meta"):
        model = get_recipe("resnet18-fmnist").build_model(width=4)
    units, shared = describe_units(model, get_recipe("resnet18-fmnist").adapter)
    plan = make_plan(world=2, units=units, coverage=0.5, shared_size=shared)
    results = run_workers(_train, 2, plan)
    # shared running stats (the stem's BN) are the mean of the two ranks' own statistics
    key = "stem.1.running_mean"
    mean = (results[0]["before"][key] + results[1]["before"][key]) / 2
    assert not torch.allclose(results[0]["before"][key], results[1]["before"][key])
    for r in results:
        torch.testing.assert_close(r["after"][key], mean)
    # a unit held by one rank keeps its own statistics
    for r in results:
        for u in r["held"]:
            if len(plan.holders(u)) == 1:
                k = f"{units[u].name}.1.running_mean"
                torch.testing.assert_close(r["after"][k], r["before"][k])
    # the assembled model loads, strictly, into the plain class and runs
    full = results[0]["full"]
    plain = ResNet18(in_channels=1, num_classes=10, width=4)
    plain.load_state_dict(full, strict=True)
    for u, unit in enumerate(units):  # each unit comes from its owner
        local = results[plan.owner(u)]["local"]
        for k in [k for k in full if k.startswith(unit.name + ".")]:
            assert torch.equal(full[k], local[k]), k
    assert plain(torch.randn(2, 1, 28, 28)).shape == (2, 10)
