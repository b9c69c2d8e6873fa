"""Issue 31: ``hf_decoder_adapter`` gives n-sdp a Hugging Face ``LlamaForCausalLM``'s heads and
MLP units. 2 gloo workers narrow every layer to their groups and train 2 SGD steps; each rank's
pieces equal the single-process reference (tests/dist/reference.py: the full model, hidden
units of groups a worker does not hold zeroed on their way into ``o_proj``/``down_proj`` and
the kept ones scaled by 1/keep-rate, n-sdp's default,
gradients averaged by hand over each group's holders), so HF's attention and MLP run narrowed
exactly as the masked full model."""

from __future__ import annotations

from typing import Any

import pytest

from subnetdp.integrations.hf_models import hf_decoder_adapter
from subnetdp.runtime.wrapper import SubnetDataParallel
from subnetdp.subnet.neurons import make_neuron_plan
from tests.dist.harness import run_workers
from tests.dist.reference import assert_pieces_match, reference_history
from tests.models.hf_tiny import batch, loss, sgd, tiny_llama, train

pytestmark = pytest.mark.dist
STEPS = 2


def _model() -> Any:
    return tiny_llama(layers=2, max_positions=32)


def _plan(model: Any) -> Any:
    return make_neuron_plan(model, hf_decoder_adapter(model), world=2, coverage=0.5)


def _train(rank: int, world: int) -> dict[str, Any]:
    model = _model()
    sdp = SubnetDataParallel(model, plan=_plan(model), adapter=hf_decoder_adapter(model),
                             strategy="n-sdp", device="cpu")
    train(sdp, sgd(sdp.parameters()), rank, STEPS)
    layer = model.model.layers[0]
    return {"pieces": sdp.shard_state(owned_only=False),
            "widths": (layer.self_attn.k_proj.weight.shape[0], layer.mlp.up_proj.weight.shape[0])}


def test_nsdp_narrows_hf_llama_like_the_masked_reference() -> None:
    model = _model()
    adapter = hf_decoder_adapter(model)
    pairs = adapter.neuron_pairs(model)  # type: ignore[misc]
    assert [(p.name, p.kind, p.slots) for p in pairs[:2]] == [
        ("model.layers.0.self_attn", "heads", 2), ("model.layers.0.mlp", "ffn", 48)]
    plan = _plan(model)
    results = run_workers(_train, 2)
    ref = reference_history(model, adapter, plan, "n-sdp", batch=batch, loss=loss,
                            optimizer=sgd, steps=STEPS)[-1]
    for res in results:
        assert res["widths"] == (8, 24)  # one of 2 K/V heads (head_dim 8), half the MLP units
        assert assert_pieces_match(res["pieces"], ref, atol=2e-5, rtol=1e-4) > 0
