"""SDP on a model subnetdp knows nothing about: a Hugging Face ``LlamaForCausalLM`` built from a
small config offline. ``auto_adapter`` finds ``model.layers``; b-sdp trains it on 3 gloo workers
exactly like the single-process reference, and the assembled weights load back, strictly, into
a plain ``LlamaForCausalLM``. Needs transformers (the ``hf`` extra, installed by ``make setup``)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
import transformers

from subnetdp.plan import make_plan
from subnetdp.runtime import SubnetDataParallel
from subnetdp.subnet.auto import auto_adapter
from subnetdp.subnet.removed import Passthrough
from subnetdp.subnet.units import describe_units
from tests.dist.harness import run_workers
from tests.dist.reference import assert_pieces_match, reference_history

pytestmark = pytest.mark.dist
STEPS, VOCAB = 3, 64


def _model() -> Any:
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=False,
        use_cache=False,  # a removed layer cannot fill a KV cache; training needs none
    )
    torch.manual_seed(0)  # the same initial weights on every rank (and the wrapper broadcasts)
    return transformers.LlamaForCausalLM(cfg)


def _batch(w: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10 * step + w)
    tokens = torch.randint(0, VOCAB, (2, 9), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _loss(out: Any, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.logits.flatten(0, 1), y.flatten())


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.5, momentum=0.9)


def _train(rank: int, world: int, plan) -> dict[str, Any]:
    model = _model()
    sdp = SubnetDataParallel(model, plan=plan, adapter=auto_adapter(model), device="cpu")
    removed = [i for i, layer in enumerate(model.model.layers) if isinstance(layer, Passthrough)]
    opt = _sgd(sdp.parameters())
    for step in range(STEPS):
        x, y = _batch(rank, step)
        _loss(sdp(x), y).backward()
        opt.step()
        opt.zero_grad()
    return {"pieces": sdp.shard_state(owned_only=False), "full": sdp.full_state_dict(),
            "removed": removed, "bytes": sdp.comm_stats.last_step_bytes}


def test_bsdp_trains_hf_llama_and_exports_loadable_weights() -> None:
    model = _model()
    adapter = auto_adapter(model)
    units, shared = describe_units(model, adapter)
    assert [u.name for u in units] == [f"model.layers.{i}" for i in range(6)]
    plan = make_plan(world=3, units=units, coverage=0.5, shared_size=shared)
    results = run_workers(_train, 3, plan)

    ref = reference_history(model, adapter, plan, "b-sdp", batch=_batch, loss=_loss,
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
    x, _ = _batch(0, 99)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x).logits, model(x).logits, atol=1e-4, rtol=1e-4)
