"""Tied weights and user-frozen parameters (issue 14, item 7): both used to diverge silently.

- A head tied to the input embedding, built on the meta device, stays tied on every rank,
  is one parameter reduced once, trains exactly like a hand-averaged single-process
  reference (AdamW) and comes back under both keys in shards and the assembled state.
- Parameters the user froze (one in a block, one shared) get no gradient, no optimizer entry
  and no update (AdamW's weight decay would move them), and cost no all-reduce bytes.
- A tie that forward masking would split is refused with a message.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from subnetdp.models import get_recipe
from subnetdp.plan import make_layered_plan, make_plan, worker_bytes
from subnetdp.runtime import SubnetDataParallel
from subnetdp.subnet.build import build_full_model
from subnetdp.subnet.neurons import describe_neuron_units, plan_groups
from subnetdp.subnet.pieces import full_pieces, reduction_order
from subnetdp.subnet.units import describe_units
from tests.dist.harness import run_workers
from tests.dist.neuron_ref import SMALL, element_holders, lm_loss, small_batch, small_llama
from tests.dist.reference import assert_pieces_match, reference_history

pytestmark = pytest.mark.dist
STEPS, WORLD, SEED = 3, 4, 3
LLAMA = get_recipe("llama-tiny")
BLOCK_UNITS = [f"layers.{i}" for i in range(SMALL["n_layers"])]
FROZEN = ("layers.1.ffn.w2.weight", "norm.weight")  # in a block (n-sdp: sliced), shared


def _adamw(params: Any) -> torch.optim.Optimizer:
    # weight decay moves any parameter it is given, even with a zero gradient
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def _tied_llama() -> nn.Module:
    model = small_llama()
    model.output.weight = model.tok_embeddings.weight
    return model


def _frozen_llama() -> nn.Module:
    model = small_llama()
    for key in FROZEN:
        model.get_parameter(key).requires_grad_(False)
    return model


def _plan(model: nn.Module, strategy: str):
    if strategy in ("n-sdp", "nb-sdp"):
        units, shared, layers = describe_neuron_units(model, LLAMA.adapter, groups=WORLD)
        return make_layered_plan(world=WORLD, units=units, layers=layers, coverage=0.5,
                                 shared_size=shared)
    units, shared = describe_units(model, LLAMA.adapter)
    return make_plan(world=WORLD, units=units, coverage=0.5, shared_size=shared)


def _train(sdp: SubnetDataParallel, rank: int) -> list[int]:
    opt = _adamw(sdp.parameters())
    nbytes = []
    for step in range(STEPS):
        x, y = small_batch(rank, step)
        lm_loss(sdp(x), y).backward()
        opt.step()
        opt.zero_grad()
        nbytes.append(sdp.comm_stats.last_step_bytes)
    sdp.refresh()  # backward masking: non-holders' copies current again (else a no-op)
    return nbytes


def _element_masks(model: nn.Module, plan, strategy: str, w: int) -> dict[str, torch.Tensor]:
    """1 where worker ``w`` holds a parameter element, from the plan's unit names by hand."""
    if strategy in ("n-sdp", "nb-sdp"):
        return element_holders(plan, model, w)
    held = set(plan.held_units(w))
    return {n: torch.full_like(p, float(not n.startswith("layers.")
                                        or int(n.split(".")[1]) in held))
            for n, p in model.named_parameters()}


def _reference(model: nn.Module, plan, strategy: str) -> dict[str, torch.Tensor]:
    """The full model after STEPS hand-averaged AdamW steps; frozen parameters never reach
    the optimizer. Forward masking: ``tests.dist.reference``; backward masking: the full
    model runs for every worker and each element is averaged over the workers holding it."""
    def opt(params: Any) -> torch.optim.Optimizer:
        return _adamw([p for p in params if p.requires_grad])

    if strategy in ("b-sdp", "n-sdp"):
        return reference_history(model, LLAMA.adapter, plan, strategy, batch=small_batch,
                                 loss=lm_loss, optimizer=opt, steps=STEPS)[-1]
    params = dict(model.named_parameters())
    masks = [_element_masks(model, plan, strategy, w) for w in range(plan.world)]
    optimizer = opt(model.parameters())
    for step in range(STEPS):
        sums = {n: torch.zeros_like(p) for n, p in params.items()}
        for w in range(plan.world):
            model.zero_grad(set_to_none=True)
            lm_loss(model(small_batch(w, step)[0]), small_batch(w, step)[1]).backward()
            for n, p in params.items():
                if p.grad is not None:
                    sums[n] += p.grad * masks[w][n]
        for n, p in params.items():
            p.grad = sums[n] / sum(m[n] for m in masks)
        optimizer.step()
    return {n: p.detach().clone() for n, p in params.items()}


# -- tied embeddings --------------------------------------------------------------------------
def _train_tied(rank: int, world: int, plan, strategy: str) -> dict[str, Any]:
    sdp = SubnetDataParallel(_tied_llama(), plan=plan, adapter=LLAMA.adapter,
                             strategy=strategy, device="cpu", init_seed=SEED)
    m = sdp.module
    tied_at_start = m.output.weight is m.tok_embeddings.weight
    nbytes = _train(sdp, rank)
    # a checkpoint round trip: the union of the owned shards into a differently seeded copy
    parts: list[Any] = [None] * world
    dist.all_gather_object(parts, sdp.shard_state())
    fresh = SubnetDataParallel(_tied_llama(), plan=plan, adapter=LLAMA.adapter,
                               strategy=strategy, device="cpu", init_seed=SEED + 1)
    fresh.load_shard_state({k: v for part in parts for k, v in part.items()})
    f = fresh.module
    return {
        "tied": [tied_at_start, m.output.weight is m.tok_embeddings.weight,
                 f.output.weight is f.tok_embeddings.weight],
        "names": [n for n, _ in sdp.named_parameters()],
        "reloaded": all(torch.equal(v, f.state_dict()[k]) for k, v in m.state_dict().items()),
        "bytes": nbytes,
        "pieces": sdp.shard_state(owned_only=False),
        "full": sdp.full_state_dict(),
    }


def _tied_reference(plan, strategy: str) -> dict[str, torch.Tensor]:
    # tied by hand on an untied build: the tie keeps the embedding's (canonical) values
    model = build_full_model(small_llama(), LLAMA.adapter, seed=SEED)
    model.output.weight = model.tok_embeddings.weight
    return _reference(model, plan, strategy)


@pytest.mark.parametrize("strategy", ["b-sdp", "bb-sdp", "n-sdp"])
def test_tied_embedding_on_meta_trains_like_the_reference(strategy: str) -> None:
    model = _tied_llama()
    plan = _plan(model, strategy)
    vocab, dim = SMALL["vocab_size"], SMALL["dim"]
    untied = sum(p.numel() for p in small_llama().parameters())
    assert plan.total_size == untied - vocab * dim  # the plan counts the tied tensor once
    results = run_workers(_train_tied, WORLD, plan, strategy)
    ref = _tied_reference(plan, strategy)
    for rank, res in enumerate(results):
        assert res["tied"] == [True, True, True], rank
        assert "module.tok_embeddings.weight" in res["names"]
        assert "module.output.weight" not in res["names"]  # one parameter, trained once
        assert res["reloaded"]
        assert assert_pieces_match(res["pieces"], ref, atol=1e-5, rtol=0) > 0
        # reduced once: exactly the analytic bytes, which count the tied tensor once
        assert res["bytes"] == [worker_bytes(plan, rank).allreduce_payload] * STEPS
    full = results[0]["full"]
    assert list(full) == list(model.state_dict())  # both keys, in the model's own order
    torch.testing.assert_close(full["tok_embeddings.weight"], ref["tok_embeddings.weight"],
                               atol=1e-5, rtol=0)
    assert torch.equal(full["output.weight"], full["tok_embeddings.weight"])
    plain = build_full_model(_tied_llama(), LLAMA.adapter, seed=0)
    plain.load_state_dict(full, strict=True)
    assert plain.output.weight is plain.tok_embeddings.weight


def _hf_tied() -> Any:
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=SMALL["vocab_size"], hidden_size=32, intermediate_size=48,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=64, tie_word_embeddings=True, use_cache=False,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def _hf_loss(out: Any, y: torch.Tensor) -> torch.Tensor:
    return lm_loss(out.logits, y)


def _train_hf(rank: int, world: int, plan) -> dict[str, Any]:
    from subnetdp.subnet.auto import auto_adapter

    model = _hf_tied()  # materialised: the non-meta path
    sdp = SubnetDataParallel(model, plan=plan, adapter=auto_adapter(model), device="cpu")
    opt = _adamw(sdp.parameters())
    for step in range(STEPS):
        x, y = small_batch(rank, step)
        _hf_loss(sdp(x), y).backward()
        opt.step()
        opt.zero_grad()
    return {"tied": model.lm_head.weight is model.model.embed_tokens.weight,
            "bytes": sdp.comm_stats.last_step_bytes,
            "pieces": sdp.shard_state(owned_only=False), "full": sdp.full_state_dict()}


def test_tied_hf_llama_materialised_keeps_the_tie() -> None:
    from subnetdp.subnet.auto import auto_adapter

    model = _hf_tied()
    adapter = auto_adapter(model)
    units, shared = describe_units(model, adapter)
    plan = make_plan(world=WORLD, units=units, coverage=0.5, shared_size=shared)
    results = run_workers(_train_hf, WORLD, plan)
    ref = reference_history(model, adapter, plan, "b-sdp", batch=small_batch, loss=_hf_loss,
                            optimizer=_adamw, steps=STEPS)[-1]
    for rank, res in enumerate(results):
        assert res["tied"]
        assert assert_pieces_match(res["pieces"], ref, atol=1e-5, rtol=0) > 0
        assert res["bytes"] == worker_bytes(plan, rank).allreduce_payload
    full = results[0]["full"]
    assert torch.equal(full["lm_head.weight"], full["model.embed_tokens.weight"])
    loaded = _hf_tied()
    loaded.load_state_dict(full, strict=True)
    torch.testing.assert_close(loaded.lm_head.weight, ref["model.embed_tokens.weight"],
                               atol=1e-5, rtol=0)


# -- refused ties -----------------------------------------------------------------------------
def _wrap(rank: int, world: int, plan, tie: tuple[str, str]) -> str:
    model = small_llama()
    alias, canonical = tie
    owner, _, attr = alias.rpartition(".")
    setattr(model.get_submodule(owner), attr, model.get_parameter(canonical))
    try:
        SubnetDataParallel(model, plan=plan, adapter=LLAMA.adapter, device="cpu")
    except ValueError as e:
        return str(e)
    return ""


@pytest.mark.parametrize("tie", [("layers.1.attn.wq.weight", "layers.0.attn.wq.weight"),
                                 ("layers.0.attn_norm.weight", "norm.weight")])
def test_a_tie_across_units_is_refused(tie: tuple[str, str]) -> None:
    plan = make_plan(world=2, units=_plan(small_llama(), "b-sdp").units, coverage=0.5,
                     shared_size=1)
    for message in run_workers(_wrap, 2, plan, tie):
        assert "\n" not in message and "is tied to" in message and "untie them" in message
        assert tie[0] in message and tie[1] in message


def test_ties_inside_a_unit_are_one_piece_and_sliced_ties_are_refused() -> None:
    model = small_llama()
    ffn = model.layers[0].ffn
    ffn.w3.weight = ffn.w1.weight  # inside one block: allowed
    pieces = {p.name: p for p in full_pieces(model, BLOCK_UNITS)}
    assert pieces["layers.0.ffn.w3.weight"].tied_to == "layers.0.ffn.w1.weight"
    assert pieces["layers.0.ffn.w3.weight"].unit == 0
    reduced = [p.name for p in reduction_order(list(pieces.values()))]
    assert "layers.0.ffn.w1.weight" in reduced and "layers.0.ffn.w3.weight" not in reduced
    plan = _plan(model, "n-sdp")  # but n-sdp would cut w1 and w3 into neuron groups
    names = [u.name for u in plan.units]
    with pytest.raises(ValueError, match="neuron groups; untie them"):
        full_pieces(model, names, plan_groups(model, LLAMA.adapter, names))


# -- frozen parameters ------------------------------------------------------------------------
def _train_frozen(rank: int, world: int, plan, strategy: str) -> dict[str, Any]:
    sdp = SubnetDataParallel(_frozen_llama(), plan=plan, adapter=LLAMA.adapter,
                             strategy=strategy, device="cpu", init_seed=SEED)
    local = dict(sdp.module.named_parameters())
    frozen = {k: local[k] for k in FROZEN if k in local}
    before = {k: p.detach().clone() for k, p in frozen.items()}
    trained = {id(p) for p in sdp.parameters()}
    nbytes = _train(sdp, rank)
    return {
        "frozen": sorted(frozen),
        "unchanged": [torch.equal(p, before[k]) for k, p in frozen.items()],
        "trained": [k for k, p in frozen.items() if id(p) in trained],
        "slices": [n for n, _ in sdp.named_parameters() if n.startswith("slices.layers.1.ffn.w2")],
        "grads": [k for k, p in frozen.items() if p.grad is not None],
        "bytes": nbytes,
        "pieces": sdp.shard_state(owned_only=False),
        "full": sdp.full_state_dict(),
    }


def _frozen_bytes(model: nn.Module, plan, strategy: str, rank: int) -> int:
    """All-reduce bytes the frozen parameters would cost ``rank``: every element it holds
    that at least one other worker holds too (from the plan by hand)."""
    masks = [_element_masks(model, plan, strategy, w) for w in range(plan.world)]
    return sum(4 * int((masks[rank][k] * (sum(m[k] for m in masks) >= 2)).sum().item())
               for k in FROZEN)


@pytest.mark.parametrize("strategy", ["b-sdp", "bb-sdp", "n-sdp", "nb-sdp"])
def test_frozen_parameters_stay_put_and_cost_nothing(strategy: str) -> None:
    plan = _plan(_frozen_llama(), strategy)
    results = run_workers(_train_frozen, WORLD, plan, strategy)
    ref_model = build_full_model(_frozen_llama(), LLAMA.adapter, seed=SEED)
    initial = {k: v.clone() for k, v in ref_model.state_dict().items()}
    ref = _reference(ref_model, plan, strategy)
    for k in FROZEN:  # the reference, too, leaves them alone
        assert torch.equal(ref[k], initial[k])
    masking = "backward" if strategy in ("bb-sdp", "nb-sdp") else "forward"
    for rank, res in enumerate(results):
        assert res["frozen"], rank
        assert all(res["unchanged"]) and not res["trained"] and not res["grads"], res
        assert not res["slices"]
        assert assert_pieces_match(res["pieces"], ref, atol=1e-5, rtol=0) > 0
        analytic = worker_bytes(plan, rank, masking=masking).allreduce_payload
        frozen = _frozen_bytes(ref_model, plan, strategy, rank)
        assert frozen > 0
        assert res["bytes"] == [analytic - frozen] * STEPS
    full = results[0]["full"]
    assert list(full) == list(initial)  # frozen parameters are still state
    for k in FROZEN:
        assert torch.equal(full[k], initial[k])
