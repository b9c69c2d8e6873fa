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
import torch
import transformers

from subnetdp.integrations.hf_models import hf_decoder_adapter
from subnetdp.runtime.wrapper import SubnetDataParallel
from subnetdp.subnet.neurons import make_neuron_plan
from tests.dist.harness import run_workers
from tests.dist.reference import assert_pieces_match, reference_history

pytestmark = pytest.mark.dist
STEPS, VOCAB = 2, 64


def _model() -> Any:
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        tie_word_embeddings=False, use_cache=False)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def _batch(w: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(10 * step + w))
    return tokens[:, :-1], tokens[:, 1:]


def _loss(out: Any, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), y.flatten())


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.5)


def _plan(model: Any) -> Any:
    return make_neuron_plan(model, hf_decoder_adapter(model), world=2, coverage=0.5)


def _train(rank: int, world: int) -> dict[str, Any]:
    model = _model()
    sdp = SubnetDataParallel(model, plan=_plan(model), adapter=hf_decoder_adapter(model),
                             strategy="n-sdp", device="cpu")
    opt = _sgd(sdp.parameters())
    for step in range(STEPS):
        x, y = _batch(rank, step)
        _loss(sdp(x), y).backward()
        opt.step()
        opt.zero_grad()
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
    ref = reference_history(model, adapter, plan, "n-sdp", batch=_batch, loss=_loss,
                            optimizer=_sgd, steps=STEPS)[-1]
    for res in results:
        assert res["widths"] == (8, 24)  # one of 2 K/V heads (head_dim 8), half the MLP units
        assert assert_pieces_match(res["pieces"], ref, atol=2e-5, rtol=1e-4) > 0
