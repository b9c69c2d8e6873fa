"""n-sdp + FSDP's gathered grouped layers (runtime.grouped ``gather_first``) and the group's
forward hooks on its entry alone (``torch_compat.hook_fsdp_on_first``).

Oracles: a gathered grouped Linear computes what its parts compute one by one (to fp32
rounding), in one matmul; its input is cast to the parts' dtype as FSDP's hook did; a layer
that cannot run as one keeps its parts; after ``hook_fsdp_on_first`` only the entry carries
FSDP hooks, and calling it gathers the parts for a forward and backward that end resharded.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils._python_dispatch import TorchDispatchMode

from subnetdp.runtime.fsdp import GroupEntry
from subnetdp.runtime.grouped import GroupedLayer
from subnetdp.torch_compat import hook_fsdp_on_first

MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default}


class _CountMatmuls(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        self.n += func in MATMULS
        return func(*args, **(kwargs or {}))


def _layer(mode: str) -> GroupedLayer:
    torch.manual_seed(0)
    if mode == "out":  # output features split 3 + 5, bias split with them
        return GroupedLayer(nn.Linear(6, 8), "out", [(0, 0, 3), (1, 3, 8)],
                            {"weight": 0, "bias": 0})
    # input features split 3 + 5; the bias, unsplit, stays on the layer
    return GroupedLayer(nn.Linear(8, 6), "in", [(0, 0, 3), (1, 3, 8)], {"weight": 1})


def _run(layer: GroupedLayer, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor], int]:
    x = x.clone().requires_grad_()
    with _CountMatmuls() as count:
        y = layer(x)
    y.square().sum().backward()
    grads = [p.grad for p in layer.parameters()]
    assert x.grad is not None
    return y.detach(), [x.grad, *grads], count.n


@pytest.mark.parametrize("mode", ["out", "in"])
def test_gathered_linear_is_one_matmul_like_its_parts(mode: str) -> None:
    x = torch.randn(4, 5, 8 if mode == "in" else 6)
    parts, one = _layer(mode), _layer(mode)
    one.gather_first()
    assert one.as_one and not parts.as_one
    y_parts, g_parts, n_parts = _run(parts, x)
    y_one, g_one, n_one = _run(one, x)
    assert (n_parts, n_one) == (2, 1)
    torch.testing.assert_close(y_one, y_parts)
    for a, b in zip(g_one, g_parts, strict=True):
        torch.testing.assert_close(a, b)


def test_gathered_layer_casts_its_input_like_fsdp() -> None:
    layer = _layer("out").to(torch.bfloat16)
    layer.gather_first()
    assert layer(torch.randn(2, 6)).dtype == torch.bfloat16


def test_layers_that_are_not_one_plain_linear_keep_their_parts() -> None:
    hooked = _layer("out")
    hooked.parts[1].register_forward_hook(lambda *_: None)
    hooked.gather_first()
    conv = GroupedLayer(nn.Conv2d(2, 4, 1), "out", [(0, 0, 2), (1, 2, 4)],
                        {"weight": 0, "bias": 0})
    conv.gather_first()
    gap = GroupedLayer(nn.Linear(8, 6), "in", [(0, 3, 8), (1, 0, 3)], {"weight": 1})
    gap.gather_first()  # parts not in input order: the concatenation would misread x
    assert not (hooked.as_one or conv.as_one or gap.as_one)


@contextmanager
def _fake_world(world: int) -> Iterator[None]:
    dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


class _Block(nn.Module):
    """Two layers gathered by an entry outside the module tree, as ``shard_block_groups``
    builds them."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.entries = [GroupEntry()]  # a plain list: not a child
        self.gathered_in_forward = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        trigger = self.entries[0](x.new_zeros((), requires_grad=True))
        self.gathered_in_forward = not isinstance(self.a.weight, DTensor)
        return (self.a(x) + self.b(x)).sum() + trigger


def test_fsdp_group_hooks_sit_on_the_entry_alone() -> None:
    with _fake_world(2):
        torch.manual_seed(0)
        block = _Block()
        entry = block.entries[0]
        mods = fully_shard([entry, block.a, block.b], reshard_after_forward=False)
        hook_fsdp_on_first(mods[0], entry)
        fully_shard(block)
        assert entry._forward_pre_hooks and entry._forward_hooks
        for part in (block.a, block.b):
            assert not part._forward_pre_hooks and not part._forward_hooks
        block(torch.randn(3, 4)).backward()
        assert block.gathered_in_forward  # the entry's call gathered the unhooked layers
        for part in (block.a, block.b):  # reduce-scattered and resharded after backward
            assert isinstance(part.weight, DTensor) and isinstance(part.weight.grad, DTensor)
