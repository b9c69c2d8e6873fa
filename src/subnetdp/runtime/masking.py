"""What a rank trains: the parameters its optimizer sees and the reducer averages.

Parameters the user froze (``requires_grad=False`` before wrapping) are never trained: no
gradient, no optimizer entry, and no place in the reducer's buckets (``Piece.frozen``). They
are told apart from what backward masking freezes by being frozen on entry.

Forward masking (b-sdp, n-sdp): the local model holds only held units, so it trains all of it.

Backward masking (bb-sdp, nb-sdp, docs/method.md §5): the local model is the *full* model, but only
held units (and shared parameters) get gradients and optimizer state:
- a parameter with no held piece is frozen (``requires_grad`` off): no gradient buffer, no
  optimizer state, while activations still flow through it to earlier layers;
- a fully held parameter trains as usual;
- a partly held one (nb-sdp: some neuron groups of a layer): the optimizer sees one *slice
  parameter* per held piece instead, a view of the full tensor (so updates write through).
  Where the layer is a Linear or a plain convolution, the full tensor is frozen and the layer
  computes only the held slices' weight gradients (``runtime.held_grad``). Otherwise the full
  tensor keeps ``requires_grad``, so autograd computes its whole gradient, and a
  post-accumulate-grad hook moves the held slices into the slice parameters and frees the full
  gradient at once, so at most one such full-size gradient exists at a time.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from subnetdp.runtime import held_grad
from subnetdp.subnet.pieces import LocalPiece


@dataclass
class Trainable:
    """Trainable tensors by name (local state key, or piece name for slices) and where their
    pieces sit (same keys), plus the slice parameters (outside the module), of which
    ``filled`` get their gradients from hooks rather than from autograd."""

    params: dict[str, nn.Parameter]
    local: dict[str, list[LocalPiece]]
    external: list[nn.Parameter] = field(default_factory=list)
    filled: list[nn.Parameter] = field(default_factory=list)
    hooks: list[Any] = field(default_factory=list)


def forward_trainable(
    module: nn.Module, local: Mapping[str, Sequence[LocalPiece]]
) -> Trainable:
    params = {k: p for k, p in module.named_parameters() if p.requires_grad}
    return Trainable(params, {k: list(local[k]) for k in params})


def backward_trainable(
    module: nn.Module,
    local: Mapping[str, Sequence[LocalPiece]],
    held: set[int],
    mark_ready: Callable[[nn.Parameter], None],
) -> Trainable:
    """Freeze what this rank does not hold and split partly held parameters (module doc)."""
    out = Trainable({}, {})
    partial: dict[str, list[LocalPiece]] = {}
    params = dict(module.named_parameters())
    for key, p in params.items():
        if not p.requires_grad:  # frozen by the user (module doc)
            continue
        pieces = list(local[key])
        mine = [lp for lp in pieces if lp.piece.unit is None or lp.piece.unit in held]
        if len(mine) == len(pieces):
            out.params[key], out.local[key] = p, pieces
        elif not mine:
            p.requires_grad_(False)
        else:
            partial[key] = mine
    for path in _sliceable_layers(module, partial):
        layer = module.get_submodule(path)
        prefix = f"{path}." if path else ""
        cut = {name: _slices(out, params[prefix + name], partial.pop(prefix + name))
               for name in ("weight", "bias") if prefix + name in partial}
        layer.weight.requires_grad_(False)
        if "bias" in cut:
            layer.bias.requires_grad_(False)
        held_grad.install(layer, *[[held_grad.Slice.of(lp, sp) for lp, sp in cut.get(name, [])]
                                   for name in ("weight", "bias")])
    for key, mine in partial.items():  # the generic path: full gradient, then sliced
        slices = _slices(out, params[key], mine)
        out.filled += [sp for _, sp in slices]
        out.hooks.append(params[key].register_post_accumulate_grad_hook(
            _extract(slices, mark_ready)))
    return out


def _sliceable_layers(module: nn.Module, partial: Mapping[str, object]) -> list[str]:
    """Layers whose partly held tensors ``held_grad`` can slice: a supported layer's weight,
    with or without its bias, and nothing else of it partly held."""
    names: dict[str, set[str]] = {}
    for key in partial:
        path, _, name = key.rpartition(".")
        names.setdefault(path, set()).add(name)
    return [path for path, ns in names.items()
            if "weight" in ns and ns <= {"weight", "bias"}
            and held_grad.supports(module.get_submodule(path))]


def _slices(out: Trainable, p: nn.Parameter,
            mine: Sequence[LocalPiece]) -> list[tuple[LocalPiece, nn.Parameter]]:
    """One trainable slice parameter per held piece of ``p``, a view of it (so that updates
    write through), registered in ``out``."""
    slices = []
    for lp in mine:
        sp = nn.Parameter(lp.view(p.detach()))
        out.params[lp.piece.name] = sp
        out.local[lp.piece.name] = [LocalPiece(lp.piece, 0, whole=True)]
        out.external.append(sp)
        slices.append((lp, sp))
    return slices


def _extract(
    slices: list[tuple[LocalPiece, nn.Parameter]], mark_ready: Callable[[nn.Parameter], None]
) -> Callable[[torch.Tensor], None]:
    def hook(p: torch.Tensor) -> None:
        g = p.grad
        assert g is not None
        for lp, sp in slices:
            part = lp.view(g)
            if sp.grad is None:
                sp.grad = part.clone(memory_format=torch.contiguous_format)
            else:  # accumulation (no_sync) or the reducer's bucket view
                sp.grad.add_(part)
        p.grad = None  # the full-size gradient is never kept
        for _, sp in slices:
            mark_ready(sp)

    return hook
