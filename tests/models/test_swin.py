"""Swin-T: configurations, shifted-window locality, narrowed layers, meta build, adapter."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from subnetdp.models import get_recipe
from subnetdp.models.swin import SWIN_ADAPTER, SWIN_FLAVOURS, SwinConfig, SwinTransformer
from subnetdp.models.swin.model import SwinBlock
from subnetdp.subnet.build import build_full_model
from subnetdp.subnet.neurons import select_pairs
from subnetdp.subnet.units import describe_units


def _small(**kw: object) -> SwinTransformer:
    args: dict = {"embed_dim": 8, "depths": (2, 2), "num_heads": (2, 4)} | kw
    return SwinTransformer(SwinConfig(**args))


def test_flavours_parameter_counts_and_stages() -> None:
    with torch.device("meta"):
        t32 = SwinTransformer(SWIN_FLAVOURS["t-32"])
        t28 = SwinTransformer(SWIN_FLAVOURS["t-28"])
    # Swin-T widths and depths (96, [2, 2, 6, 2], [3, 6, 12, 24]); 10 classes.
    assert sum(p.numel() for p in t32.parameters()) == 27_505_108
    assert sum(p.numel() for p in t28.parameters()) == 27_506_500
    assert SWIN_FLAVOURS["t-32"].stage_sides() == [16, 8, 4, 2]
    assert SWIN_FLAVOURS["t-28"].stage_sides() == [14, 7, 4, 2]
    units, shared = describe_units(t32, SWIN_ADAPTER)
    assert [u.name for u in units][:3] == ["stages.0.blocks.0", "stages.0.blocks.1",
                                           "stages.1.blocks.0"]
    assert len(units) == 12 and shared > 0  # patch embedding/merging, norm, head are shared
    cifar100 = get_recipe("swin-t-cifar100").build_model(embed_dim=8, depths=[1, 1],
                                                         num_heads=[1, 2])
    assert cifar100(torch.randn(2, 3, 32, 32)).shape == (2, 100)
    grey = get_recipe("swin-t-fmnist").build_model(embed_dim=8, depths=[1, 1, 1],
                                                   num_heads=[1, 1, 2])
    assert grey(torch.randn(2, 1, 28, 28)).shape == (2, 10)


def test_bad_configs_say_how_to_fix() -> None:
    with pytest.raises(ValueError, match="window"):
        SwinConfig(window_size=5)
    with pytest.raises(ValueError, match="heads"):
        SwinConfig(embed_dim=10)
    with pytest.raises(ValueError, match="same"):
        SwinConfig(depths=(2, 2), num_heads=(3,))
    with pytest.raises(ValueError, match="valid"):
        get_recipe("swin-t-fmnist").build_model(dim=3)


def _receptive(block: SwinBlock, i: int, j: int) -> set[tuple[int, int]]:
    x = torch.randn(1, 8, 8, 8, requires_grad=True)
    block(x)[0, i, j].sum().backward()
    assert x.grad is not None
    nz = x.grad.abs().sum(-1)[0].nonzero().tolist()
    return {(a, b) for a, b in nz}


def test_windows_and_shifted_windows_are_local() -> None:
    torch.manual_seed(0)
    plain = SwinBlock(8, 2, window=4, shift=0, mlp_ratio=2.0)
    assert _receptive(plain, 0, 0) == {(a, b) for a in range(4) for b in range(4)}
    shifted = SwinBlock(8, 2, window=4, shift=2, mlp_ratio=2.0)
    # Token (0, 0) sits in the shifted window of rows/cols 6,7,0,1, but rows and cols 6-7 only
    # wrapped around by the cyclic shift: the mask must keep it to its own 2×2 region.
    assert _receptive(shifted, 0, 0) == {(a, b) for a in range(2) for b in range(2)}
    # An interior token sees the whole shifted window: rows/cols 2-5.
    assert _receptive(shifted, 3, 4) == {(a, b) for a in range(2, 6) for b in range(2, 6)}


def _narrow(model: nn.Module, keep: dict[str, list[int]]) -> None:
    """Physically keep only some slots of the given pairs, as n-sdp does."""
    with torch.device("meta"):  # the pairs of the full-width model
        pairs = {p.name: p for p in select_pairs(_small(), SWIN_ADAPTER)}
    state = model.state_dict(keep_vars=True)
    for name, slots in keep.items():
        pair = pairs[name]
        for key, dim in pair.tensors:
            t = state[key]
            per = t.shape[dim] // pair.slots
            idx = torch.tensor([s * per + k for s in slots for k in range(per)], dtype=torch.long)
            mod_name, _, attr = key.rpartition(".")
            mod = model.get_submodule(mod_name)
            setattr(mod, attr, nn.Parameter(t.detach().index_select(dim, idx)))


def test_narrowed_layers_equal_masked_full_layers() -> None:
    torch.manual_seed(0)
    full = _small()
    narrow = _small()
    narrow.load_state_dict(full.state_dict())
    keep = {"stages.0.blocks.1.attn": [1], "stages.1.blocks.0.attn": [0, 3],
            "stages.0.blocks.1.mlp": list(range(0, 32, 3))}
    _narrow(narrow, keep)
    pairs = {p.name: p for p in select_pairs(full, SWIN_ADAPTER)}
    for name, slots in keep.items():  # the full model with the other slots zeroed
        pair = pairs[name]
        down = full.get_submodule(pair.down)
        mask = torch.zeros(pair.slots)
        mask[slots] = 1
        mask = mask.repeat_interleave(down.weight.shape[1] // pair.slots)
        down.register_forward_pre_hook(lambda m, a, mask=mask: (a[0] * mask,))
    x = torch.randn(3, 3, 32, 32)
    torch.testing.assert_close(narrow(x), full(x), atol=1e-5, rtol=1e-5)
    # A layer narrowed to no head at all (an n-sdp worker may hold none of a pair) still runs.
    _narrow(narrow, {"stages.1.blocks.1.attn": []})
    assert narrow(x).shape == (3, 10)


def test_meta_build_initialises_every_tensor_deterministically() -> None:
    with torch.device("meta"):
        a, b = _small(), _small()
    a = build_full_model(a, SWIN_ADAPTER, seed=3)
    b = build_full_model(b, SWIN_ADAPTER, seed=3)
    eager = _small()
    for (k, va), vb in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(va, vb), k
        assert torch.isfinite(va).all(), k
    for (k, buf), ref in zip(a.named_buffers(), eager.buffers(), strict=True):
        assert torch.equal(buf, ref), k  # the relative-position index is rebuilt, not garbage
    attn = a.get_submodule("stages.0.blocks.0.attn")
    assert attn.q.bias.abs().sum() == 0 and 0 < attn.relative_bias.std() < 0.05


def test_adapter_neuron_pairs() -> None:
    model = _small()
    pairs = select_pairs(model, SWIN_ADAPTER)  # checks every tensor/dim against the model
    assert [p.kind for p in pairs] == ["heads", "ffn"] * 4
    heads = pairs[4]
    assert heads.name == "stages.1.blocks.0.attn" and heads.slots == 4
    assert ("stages.1.blocks.0.attn.relative_bias", 1) in heads.tensors
    assert pairs[1].slots == 32 and pairs[1].down == "stages.0.blocks.0.mlp.fc2"
