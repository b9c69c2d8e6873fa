"""How a model declares its units to subnetdp.

A model file stays plain PyTorch; next to it, a small ``UnitAdapter`` tells subnetdp which
submodules are units (in forward order) and what a removed unit turns into. Everything else
in subnetdp is model-agnostic and only talks to this adapter.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from torch import nn

# What a unit that a worker does not hold becomes in its local model:
# - "passthrough": the unit is a whole residual block ``x -> x + f(x)``; removed, it returns its
#   first positional argument unchanged (the identity on the residual stream).
# - "zero": the unit is a residual *branch* whose output the parent adds to a shortcut;
#   removed, it contributes ``0`` (the parent's ``branch(x) + shortcut(x)`` becomes the shortcut).
RemovedKind = Literal["passthrough", "zero"]


@dataclass(frozen=True)
class NeuronPair:
    """A layer pair whose hidden dimension n-sdp splits into groups of neurons.

    The pair's hidden activation has ``slots`` indivisible entries (FFN hidden units, K/V heads,
    intermediate channels). Every tensor in ``tensors`` carries that dimension: a
    ``(state-dict key, dim)`` entry whose size along ``dim`` is a multiple of ``slots``, slot
    ``s`` owning the ``size // slots`` consecutive entries starting at ``s * size // slots``
    (so a slot of a GQA attention pair is one K/V head and its ``n_rep`` query heads).
    Per layer, n-sdp splits the slots into ``min(groups, slots)`` contiguous, near-equal
    groups; each group is one plan unit named ``f"{name}[{g}]"``. The module that consumes the
    hidden activation is ``down`` (its input gets the optional 1/keep-rate output scaling).
    A model whose pairs may be narrowed must read widths and head counts from tensor shapes in
    ``forward``.
    """

    name: str
    kind: str  # "ffn", "heads" or "channels": which kinds to split is a user option
    slots: int
    tensors: tuple[tuple[str, int], ...]
    down: str


@dataclass(frozen=True)
class UnitAdapter:
    """Declares a model's block-level units.

    Attributes:
        unit_paths: given the full model (possibly on the meta device), the qualified module
            names of its units in forward order, e.g. ``["layers.0", "layers.1", ...]``.
        removed: what a non-held unit is replaced with (see ``RemovedKind``).
        neuron_pairs: the layer pairs n-sdp may narrow (see ``NeuronPair``).
        init_module: deterministic initialiser for the parameters and buffers *directly owned*
            by one module (``recurse=False``), given its qualified name. subnetdp seeds the RNG
            from the name before calling it, so every worker materialises identical values for
            the modules it holds whatever else it holds. ``None`` means
            ``module.reset_parameters()`` where the module has one.
    """

    unit_paths: Callable[[nn.Module], list[str]]
    removed: RemovedKind = "passthrough"
    init_module: Callable[[str, nn.Module], None] | None = None
    # Neuron level (n-sdp): the model's layer pairs in forward order; None if it has none.
    neuron_pairs: Callable[[nn.Module], list[NeuronPair]] | None = None
