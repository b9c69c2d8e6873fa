"""n-sdp under FSDP: a narrowed layer becomes one sub-layer per neuron group.

FSDP shards a module's parameters over one mesh, but a layer narrowed by n-sdp holds several
neuron groups, each with its own holders. So, under ``fsdp``, each such layer is replaced by a
``GroupedLayer`` whose parts are the same layer cut to one group's slice, and each part is then
sharded over its group's holders. The function is unchanged:

- ``out``: a Linear/Conv whose output channels are split (``weight`` dim 0): the parts'
  outputs are concatenated along the channel dimension;
- ``in``: a Linear/Conv whose input channels are split (``weight`` dim 1): each part reads its
  channels and the outputs add up; the layer's bias (shared, unsplit) is added once;
- ``channel``: a BatchNorm: each part normalises its own channels.

Where FSDP gathers a block's parts before the block runs and keeps them gathered (n-sdp without
activation checkpointing: ``runtime.fsdp``, [Note: one FSDP module per block and holder
group]), the parts carry no FSDP hooks and ``gather_first`` tells the layer so: it casts its
input to the parts' compute dtype itself (FSDP's mixed-precision hook did that per part), and a
Linear layer runs as one ``F.linear`` over its parts' weights concatenated: on llama-tiny
(C = 0.5, two parts a layer) half the matmuls, and the local layer's very computation, as plain
n-sdp runs it.

Sliced buffers (BatchNorm running statistics) stay on the ``GroupedLayer`` under their
original names, at the layer's local width, and the parts use views of them, so buffer sync and
assembly see the usual layout. ``ungroup_state`` turns a state dict back into the local
layout that ``runtime.assemble`` expects.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from subnetdp.subnet.pieces import LocalPiece

_SPLITTABLE = (nn.Linear, nn.modules.conv._ConvNd, nn.modules.batchnorm._BatchNorm)


class GroupedLayer(nn.Module):
    """A layer as the sum/concatenation of per-group parts (module doc)."""

    def __init__(
        self, layer: nn.Module, mode: str, bounds: Sequence[tuple[int, int, int]],
        sliced: Mapping[str, int],
    ) -> None:
        """``bounds``: ``(unit, local_start, local_stop)`` per group in local order;
        ``sliced``: the layer's own tensor names that are cut, with their dims."""
        super().__init__()
        self.mode = mode
        self.channel_dim = -1 if isinstance(layer, nn.Linear) else 1
        self.units = [u for u, _, _ in bounds]
        self.spans = [(start, stop - start) for _, start, stop in bounds]
        self.sliced = dict(sliced)
        for name, b in layer.named_buffers(recurse=False):
            if name in sliced:  # the full-width buffer lives here; parts get views
                self.register_buffer(name, b)
        # an unsplit bias of an ``in`` layer is added once, here
        bias = getattr(layer, "bias", None)
        self.bias: torch.Tensor | None = (
            bias if mode == "in" and isinstance(bias, torch.Tensor) else None)
        parts = []
        for _, start, stop in bounds:
            part = copy.deepcopy(layer)
            for name, t in layer.named_parameters(recurse=False):
                if name in sliced:
                    cut = t.detach().narrow(sliced[name], start, stop - start).clone()
                    setattr(part, name, nn.Parameter(cut, requires_grad=t.requires_grad))
                else:  # the in-layer's bias
                    part.register_parameter(name, None)
            for name, b in layer.named_buffers(recurse=False):
                if name in sliced:
                    part.register_buffer(name, b.narrow(sliced[name], start, stop - start),
                                         persistent=False)
            parts.append(part)
        self.parts = nn.ModuleList(parts)
        self.gathered = False  # gather_first
        self.as_one = False

    def gather_first(self) -> None:
        """The parts' parameters are gathered before this layer runs and the parts carry no
        hooks (module doc): cast the input here, and run a Linear's parts as one layer."""
        self.gathered = True
        starts = [s for s, _ in self.spans]
        tiled = starts == [sum(n for _, n in self.spans[:i]) for i in range(len(starts))]
        self.as_one = self.mode == "out" or (self.mode == "in" and tiled)
        for part in self.parts:  # a plain Linear: its forward is F.linear, nothing around it
            self.as_one &= (isinstance(part, nn.Linear) and "forward" not in vars(part)
                            and type(part).forward is nn.Linear.forward
                            and not part._forward_hooks and not part._forward_pre_hooks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ch = self.channel_dim
        if self.gathered:
            x = _cast_like(x, self.parts[0])
        if self.as_one:
            return self._as_one(x)
        if self.mode == "out":
            return torch.cat([p(x) for p in self.parts], dim=ch)
        pieces = [p(x.narrow(ch, s, n)) for p, (s, n) in zip(self.parts, self.spans, strict=True)]
        if self.mode == "channel":
            return torch.cat(pieces, dim=ch)
        y = pieces[0]
        for more in pieces[1:]:
            y = y + more
        if self.bias is not None:
            shape = [1] * y.ndim
            shape[ch] = -1
            y = y + self.bias.view(shape)
        return y

    def _as_one(self, x: torch.Tensor) -> torch.Tensor:
        parts = [cast(nn.Linear, p) for p in self.parts]  # gather_first checked
        weights: list[torch.Tensor] = [p.weight for p in parts]
        weight = torch.cat(weights, dim=self.sliced["weight"])
        if self.mode == "in":  # the parts tile x's channels in order
            return F.linear(x, weight, self.bias)
        biases: list[torch.Tensor] = [p.bias for p in parts if p.bias is not None]
        return F.linear(x, weight, torch.cat(biases) if biases else None)


def _cast_like(x: torch.Tensor, part: nn.Module) -> torch.Tensor:
    """``x`` in the dtype of ``part``'s parameters, as FSDP's mixed-precision policy casts a
    module's floating-point inputs."""
    dtype = next(part.parameters()).dtype
    return x.to(dtype) if x.is_floating_point() and x.dtype != dtype else x


def group_layers(module: nn.Module, local: Mapping[str, Sequence[LocalPiece]]) -> list[str]:
    """Replace every layer that holds sliced pieces by a ``GroupedLayer``; returns their
    paths. Raises ``NotImplementedError`` for a tensor that no supported layer owns."""
    by_layer: dict[str, dict[str, list[LocalPiece]]] = {}
    for key, pieces in local.items():
        if any(lp.piece.dim is not None for lp in pieces):
            path, _, name = key.rpartition(".")
            by_layer.setdefault(path, {})[name] = list(pieces)
    for path, tensors in by_layer.items():
        layer = module.get_submodule(path)
        if not isinstance(layer, _SPLITTABLE) or set(tensors) - _direct_tensors(layer):
            raise NotImplementedError(
                f"n-sdp with fsdp splits Linear, Conv and BatchNorm layers by neuron group; "
                f"{path!r} ({type(layer).__name__}) holds sliced tensors "
                f"{sorted(tensors)} it cannot split. Use n-sdp without fsdp for this model."
            )
        sliced = {name: pieces[0].piece.dim for name, pieces in tensors.items()}
        bounds = [(lp.piece.unit, lp.local_start, lp.local_start + lp.piece.stop - lp.piece.start)
                  for lp in tensors["weight"]]
        mode = ("channel" if isinstance(layer, nn.modules.batchnorm._BatchNorm)
                else "out" if sliced["weight"] == 0 else "in")
        parent, _, child = path.rpartition(".")
        setattr(module.get_submodule(parent) if parent else module, child,
                GroupedLayer(layer, mode, bounds, sliced))  # type: ignore[arg-type]
    return list(by_layer)


def _direct_tensors(layer: nn.Module) -> set[str]:
    return {n for n, _ in layer.named_parameters(recurse=False)} | {
        n for n, _ in layer.named_buffers(recurse=False)}


def ungroup_state(module: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` (of ``module``, parts whole) in the local layout: each split parameter is the
    concatenation of its parts', under the layer's original name."""
    out = dict(state)
    for path, layer in module.named_modules():
        if not isinstance(layer, GroupedLayer):
            continue
        prefix = f"{path}." if path else ""
        for name, dim in layer.sliced.items():
            keys = [f"{prefix}parts.{i}.{name}" for i in range(len(layer.parts))]
            if keys[0] not in out:
                continue  # a buffer: already under its own name
            out[prefix + name] = torch.cat([out.pop(k) for k in keys], dim=dim)
        for key in [k for k in out if k.startswith(f"{prefix}parts.")]:
            rest = key[len(f"{prefix}parts."):].partition(".")[2]
            shared = f"{prefix}{rest}"
            if shared not in out:  # e.g. BatchNorm's num_batches_tracked: the first part's
                out[shared] = out[key]
            del out[key]
    return out
