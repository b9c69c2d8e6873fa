"""The DDP baselines: stochastic depth skips whole units like b-sdp's removed ones, neuron
dropout drops whole slots of every layer pair with inverted scaling; both only in training."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from subnetdp.models import get_recipe
from subnetdp.subnet.regularize import (
    apply_neuron_dropout,
    apply_stochastic_depth,
    rank_generator,
)
from subnetdp.train.config import TrainConfig


def _llama() -> tuple[nn.Module, object]:
    recipe = get_recipe("llama-tiny")
    torch.manual_seed(0)
    model = recipe.build_model(dim=32, n_layers=3, n_heads=4, n_kv_heads=2, ffn_hidden=24,
                               vocab_size=64, max_seq_len=16)
    return model, recipe.adapter


def _resnet() -> tuple[nn.Module, object]:
    recipe = get_recipe("resnet18-fmnist")
    torch.manual_seed(0)
    model = recipe.build_model(width=4, zero_init_residual=False)
    return model, recipe.adapter


def test_stochastic_depth_skips_blocks_as_passthrough() -> None:
    model, adapter = _llama()
    tokens = torch.randint(0, 64, (2, 8))
    model.eval()
    full = model(tokens)
    handle = apply_stochastic_depth(model, adapter, 0.999, rank_generator(0, 0))
    model.train()
    skipped = model(tokens)  # every block skipped: embeddings -> norm -> head
    ref = model.output(model.norm(model.tok_embeddings(tokens)))
    torch.testing.assert_close(skipped, ref)
    assert handle.skipped == 3
    model.eval()  # eval: the full model, unchanged
    torch.testing.assert_close(model(tokens), full)
    keys = set(model.state_dict())
    handle.remove()
    assert set(model.state_dict()) == keys and "forward" not in vars(model.layers[0])


def test_stochastic_depth_zero_branch_and_rate() -> None:
    model, adapter = _resnet()
    x = torch.randn(2, 1, 28, 28)
    handle = apply_stochastic_depth(model, adapter, 0.999, rank_generator(0, 0))
    model.train()
    y = model(x)
    assert y.shape == (2, 10) and handle.skipped == 8  # every BasicBlock branch returned 0
    handle.remove()
    handle = apply_stochastic_depth(model, adapter, 0.25, rank_generator(1, 0))
    for _ in range(25):
        model(x)
    rate = handle.skipped / (25 * 8)
    assert 0.12 < rate < 0.38
    # p = 0 never skips; ranks draw different masks
    assert rank_generator(0, 0).initial_seed() != rank_generator(0, 1).initial_seed()


def test_stochastic_depth_skipped_blocks_get_no_gradient() -> None:
    model, adapter = _llama()
    apply_stochastic_depth(model, adapter, 0.999, rank_generator(0, 0))
    model.train()
    model(torch.randint(0, 64, (2, 8))).sum().backward()
    assert all(p.grad is None for p in model.layers.parameters())
    assert model.output.weight.grad is not None


def test_neuron_dropout_drops_whole_slots_with_inverted_scaling() -> None:
    model, adapter = _llama()
    apply_neuron_dropout(model, adapter, 0.5, rank_generator(0, 0))
    seen: dict[str, torch.Tensor] = {}

    def grab(name: str):  # the input the down projection actually receives
        def hook(_m: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            seen[name] = args[0].detach()
        return hook

    # registered after the dropout hooks, so they see the masked input
    model.layers[0].attn.wo.register_forward_pre_hook(grab("wo"))
    model.layers[0].ffn.w2.register_forward_pre_hook(grab("w2"))
    clean: dict[str, torch.Tensor] = {}
    model.layers[0].attn.wo.register_forward_hook(
        lambda m, a, o: clean.setdefault("wo_out", o.detach()))
    tokens = torch.randint(0, 64, (2, 8))
    model.train()
    model(tokens)
    # heads: 2 K/V slots of 2 query heads x 8 dims = 16 columns each, zero or not as a block
    wo_in = seen["wo"].reshape(2, 8, 2, 16)
    zero = (wo_in == 0).all(-1)
    assert zero.any() and (~zero).any()
    nonzero_blocks = wo_in[~zero]
    assert (nonzero_blocks != 0).all()
    # ffn: each hidden unit per token zero or kept; about half dropped
    w2_in = seen["w2"]
    frac = (w2_in == 0).float().mean().item()
    assert 0.3 < frac < 0.7


def test_neuron_dropout_scaling_and_eval() -> None:
    lin = nn.Sequential(nn.Identity(), nn.Linear(6, 2, bias=False))
    from subnetdp.subnet.adapter import NeuronPair, UnitAdapter

    adapter = UnitAdapter(unit_paths=lambda m: [], neuron_pairs=lambda m: [
        NeuronPair("p", "ffn", 3, (("1.weight", 1),), "1")])
    handle = apply_neuron_dropout(lin, adapter, 0.5, rank_generator(0, 0))
    seen = []
    lin[1].register_forward_pre_hook(lambda m, a: seen.append(a[0]))
    x = torch.ones(4000, 6)
    lin.train()
    lin(x)
    got = seen[-1].reshape(4000, 3, 2)
    assert set(got.unique().tolist()) <= {0.0, 2.0}  # kept entries scaled by 1/(1-p)
    assert (got[..., 0] == got[..., 1]).all()  # a slot is dropped whole
    assert abs(got.mean().item() - 1.0) < 0.05  # unbiased in expectation
    lin.eval()
    lin(x)
    assert torch.equal(seen[-1], x)
    handle.remove()
    lin.train()
    lin(x)
    assert torch.equal(seen[-1], x)


def test_neuron_dropout_conv_channels_per_sample() -> None:
    model, adapter = _resnet()
    apply_neuron_dropout(model, adapter, 0.5, rank_generator(0, 0))
    seen = []
    model.layer1[0].residual[3].register_forward_pre_hook(lambda m, a: seen.append(a[0]))
    model.train()
    model(torch.randn(3, 1, 28, 28))
    x = seen[0]  # [B, C, H, W]: a dropped channel is zero over the whole map of that sample
    zero = (x == 0).flatten(2).all(-1)
    assert zero.any() and (~zero).any()


@pytest.mark.parametrize("field", ["stochastic_depth", "neuron_dropout"])
def test_config_validation(field: str) -> None:
    TrainConfig(strategy="ddp", **{field: 0.5}).resolved()
    with pytest.raises(ValueError, match="use it with --strategy ddp"):
        TrainConfig(strategy="b-sdp", **{field: 0.5}).resolved()
    with pytest.raises(ValueError, match=r"in \[0, 1\)"):
        TrainConfig(strategy="ddp", **{field: 1.0}).resolved()
