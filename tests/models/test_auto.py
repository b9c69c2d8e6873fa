"""``auto_adapter``: finding a model's block list, clear errors, and removed blocks that follow
the block's calling convention (positional or keyword stream, tensor or tuple result)."""

from __future__ import annotations

import typing

import pytest
import torch
from torch import nn

from subnetdp.models import get_recipe
from subnetdp.subnet.auto import NoBlocksError, auto_adapter, block_lists
from subnetdp.subnet.build import drop_units
from subnetdp.subnet.removed import Passthrough, ZeroBranch, passthrough_like, removed_module
from subnetdp.subnet.units import describe_units


class Res(nn.Module):
    def __init__(self, d: int = 4) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc(x)


class TupleRes(Res):
    def forward(self, hidden: torch.Tensor, mask: object = None) -> tuple[torch.Tensor, None]:
        return hidden + self.fc(hidden), None


class OldStyle(Res):  # typing.Tuple, as transformers < 4.54 annotates decoder layers
    def forward(self, x: torch.Tensor) -> typing.Tuple[torch.Tensor, typing.Optional[int]]:  # noqa: UP006, UP045
        return x + self.fc(x), None


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(3, 4)
        self.encoder = nn.ModuleDict({"layers": nn.ModuleList(TupleRes() for _ in range(5))})
        self.heads = nn.ModuleList([nn.Linear(4, 2), nn.Linear(4, 2)])  # shorter: not chosen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        for layer in self.encoder["layers"]:
            h = layer(hidden=h, mask=None)[0]
        return self.heads[0](h)


def test_finds_the_longest_same_type_list() -> None:
    with torch.device("meta"):
        net = Net()
    assert block_lists(net) == [("encoder.layers", 5), ("heads", 2)]
    adapter = auto_adapter(net)
    units, shared = describe_units(net, adapter)
    assert [u.name for u in units] == [f"encoder.layers.{i}" for i in range(5)]
    assert shared == 3 * 4 + 4 + 2 * (4 * 2 + 2)
    assert adapter.removed == "passthrough"
    # explicit paths, several lists in order
    two = auto_adapter(net, ["heads", "encoder.layers"])
    assert two.unit_paths(net)[:3] == ["heads.0", "heads.1", "encoder.layers.0"]


def test_recipes_models_are_found_too() -> None:
    with torch.device("meta"):
        llama = get_recipe("llama-tiny").build_model()
        swin = get_recipe("swin-t-fmnist").build_model()
    assert auto_adapter(llama).unit_paths(llama) == [f"layers.{i}" for i in range(8)]
    assert auto_adapter(swin).unit_paths(swin)[0] == "stages.2.blocks.0"  # the 6-block stage
    both = auto_adapter(swin, [f"stages.{s}.blocks" for s in range(4)])
    assert len(both.unit_paths(swin)) == 12


def test_no_blocks_is_a_clear_error() -> None:
    with pytest.raises(NoBlocksError, match=r"blocks='path\.to\.list'"):
        auto_adapter(nn.Sequential(nn.Linear(2, 2), nn.ReLU()))
    mixed = nn.Module()
    mixed.layers = nn.ModuleList([nn.Linear(2, 2), nn.Conv1d(2, 2, 1)])
    with pytest.raises(NoBlocksError, match=r"no nn\.ModuleList"):
        auto_adapter(mixed)
    tied = nn.Module()
    tied.a = nn.ModuleList(Res() for _ in range(3))
    tied.b = nn.ModuleList(Res() for _ in range(3))
    with pytest.raises(NoBlocksError, match=r"\['a', 'b'\]"):
        auto_adapter(tied)
    with pytest.raises(NoBlocksError, match="no submodule 'encoder'"):
        auto_adapter(tied, "encoder")
    with pytest.raises(NoBlocksError, match="not a non-empty"):
        auto_adapter(Net(), "stem")


def test_removed_blocks_follow_the_calling_convention() -> None:
    x = torch.randn(2, 4)
    plain = passthrough_like("u", Res())
    assert plain(x) is x and plain(x, 3, mask=1) is x
    tup = passthrough_like("u", TupleRes())
    assert tup.input_name == "hidden" and tup.tuple_output
    out = tup(hidden=x, mask=None)
    assert isinstance(out, tuple) and out[0] is x and len(out) == 1
    assert passthrough_like("u", OldStyle()).tuple_output
    with pytest.raises(TypeError, match="residual stream"):
        tup(mask=None)
    # existing behaviour is unchanged without a model to copy
    assert isinstance(removed_module("passthrough", "u"), Passthrough)
    assert removed_module("zero", "u", like=Res())(x) == 0
    assert isinstance(removed_module("zero", "u"), ZeroBranch)


def test_dropped_blocks_keep_the_model_running() -> None:
    torch.manual_seed(0)
    net = Net()
    adapter = auto_adapter(net)
    x = torch.randn(2, 3)
    ref = net.stem(x)
    for i in (0, 2, 3, 4):
        ref = net.encoder["layers"][i](ref)[0]
    ref = net.heads[0](ref)
    drop_units(net, adapter, held=[0, 2, 3, 4])
    assert isinstance(net.encoder["layers"][1], Passthrough)
    torch.testing.assert_close(net(x), ref)
