"""SDP on a model subnetdp knows nothing about: a Hugging Face ``LlamaForCausalLM`` built from a
small config offline. ``auto_adapter`` finds ``model.layers``; b-sdp trains it on 3 gloo workers
exactly like the single-process reference, and the assembled weights load back, strictly, into
a plain ``LlamaForCausalLM``. Needs transformers (the ``hf`` extra, installed by ``make setup``)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from subnetdp.plan import make_plan
from subnetdp.runtime import SubnetDataParallel
from subnetdp.subnet.auto import auto_adapter
from subnetdp.subnet.removed import Passthrough
from subnetdp.subnet.units import describe_units
from tests.dist.harness import run_workers
from tests.dist.reference import assert_pieces_match, reference_history
from tests.models.hf_tiny import batch, loss, sgd, tiny_llama, train

pytestmark = pytest.mark.dist
STEPS = 3


def _model() -> Any:
    return tiny_llama(layers=6, max_positions=64)


def _sgd(params: Any) -> torch.optim.Optimizer:
    return sgd(params, momentum=0.9)


def _train(rank: int, world: int, plan) -> dict[str, Any]:
    model = _model()
    sdp = SubnetDataParallel(model, plan=plan, adapter=auto_adapter(model), device="cpu")
    removed = [i for i, layer in enumerate(model.model.layers) if isinstance(layer, Passthrough)]
    train(sdp, _sgd(sdp.parameters()), rank, STEPS)
    return {"pieces": sdp.shard_state(owned_only=False), "full": sdp.full_state_dict(),
            "removed": removed, "bytes": sdp.comm_stats.last_step_bytes}


def test_bsdp_trains_hf_llama_and_exports_loadable_weights() -> None:
    model = _model()
    adapter = auto_adapter(model)
    units, shared = describe_units(model, adapter)
    assert [u.name for u in units] == [f"model.layers.{i}" for i in range(6)]
    plan = make_plan(world=3, units=units, coverage=0.5, shared_size=shared)
    results = run_workers(_train, 3, plan)

    ref = reference_history(model, adapter, plan, "b-sdp", batch=batch, loss=loss,
                            optimizer=_sgd, steps=STEPS)[-1]
    total = sum(p.numel() for p in model.parameters())
    for rank, res in enumerate(results):
        assert res["removed"] == [u for u in range(6) if u not in plan.held_units(rank)]
        assert assert_pieces_match(res["pieces"], ref, atol=2e-5, rtol=1e-4) > 0
        assert 0 < res["bytes"] < 4 * total
    assert ref["model.layers.0.mlp.up_proj.weight"].ne(
        _model().state_dict()["model.layers.0.mlp.up_proj.weight"]).any()  # it trained

    loaded = _model()
    loaded.load_state_dict(results[0]["full"], strict=True)
    model.eval()
    loaded.eval()
    x, _ = batch(0, 99)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x).logits, model(x).logits, atol=1e-4, rtol=1e-4)
