"""SDP for any residual model: a ``UnitAdapter`` found from the model's structure.

Most residual networks keep their repeated blocks in an ``nn.ModuleList`` (``model.layers``,
``model.model.layers`` in Hugging Face decoders, ``blocks``, ``h``, ...). ``auto_adapter``
makes each module of such a list one block-level unit: given the list's path, or found as the
longest ``ModuleList`` of two or more modules of one type.

The contract a block must meet (subnetdp cannot verify it; a block that breaks it trains a
different model, silently):

- it is residual with an identity skip, ``x -> x + f(x, ...)``, so removing it leaves ``x``;
  a block whose skip is a projection (a downsampling stage) must not be in the list;
- it receives the residual stream as its first positional argument, or by keyword under the
  name of its forward's first parameter;
- it returns the new stream, or a tuple whose first element is the stream; in the latter
  case its ``forward`` must be annotated ``-> tuple[...]`` (or ``Tuple[...]``) so that a
  removed block returns ``(x,)`` too (see ``subnet.removed.passthrough_like``).

Caches and extra outputs are not mirrored: train with them off (for Hugging Face models,
``use_cache=False``, no ``output_attentions``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from torch import nn

from subnetdp.subnet.adapter import UnitAdapter


class NoBlocksError(ValueError):
    """The model has no list of residual blocks subnetdp can use; the message says what to do."""


def block_lists(model: nn.Module) -> list[tuple[str, int]]:
    """Every ``ModuleList`` of two or more modules of one type that hold parameters, as
    ``(path, length)``, longest first (ties in registration order)."""
    found = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) < 2:
            continue
        types = {type(m) for m in module}
        if len(types) == 1 and any(True for _ in module.parameters()):
            found.append((name, len(module)))
    return sorted(found, key=lambda t: -t[1])


def find_blocks(model: nn.Module) -> str:
    """The path of the longest ``ModuleList`` of same-type modules; raises ``NoBlocksError``
    when there is none, or when two lists tie (name one with ``blocks=``)."""
    lists = block_lists(model)
    if not lists:
        raise NoBlocksError(
            f"{type(model).__name__} has no nn.ModuleList of two or more modules of one type, "
            "so subnetdp cannot find its residual blocks. Keep the blocks in an nn.ModuleList "
            "and pass auto_adapter(model, blocks='path.to.list'), or write a UnitAdapter "
            "(subnetdp.subnet.adapter) that lists them."
        )
    if len(lists) > 1 and lists[1][1] == lists[0][1]:
        tied = [p for p, n in lists if n == lists[0][1]]
        raise NoBlocksError(
            f"{type(model).__name__} has several block lists of length {lists[0][1]}: "
            f"{tied}; choose with auto_adapter(model, blocks=...) (a path or a list of paths)"
        )
    return lists[0][0]


def _check_list(model: nn.Module, path: str) -> nn.ModuleList:
    try:
        module = model.get_submodule(path)
    except AttributeError:
        known = [p for p, _ in block_lists(model)]
        raise NoBlocksError(
            f"{type(model).__name__} has no submodule {path!r}; block lists it has: {known}"
        ) from None
    if not isinstance(module, nn.ModuleList) or len(module) == 0:
        raise NoBlocksError(
            f"{path!r} in {type(model).__name__} is a {type(module).__name__}, not a non-empty "
            "nn.ModuleList of residual blocks; name the ModuleList that holds the blocks"
        )
    return module


def auto_adapter(
    model: nn.Module,
    blocks: str | Sequence[str] | None = None,
    *,
    init_module: Callable[[str, nn.Module], None] | None = None,
) -> UnitAdapter:
    """A block-level ``UnitAdapter`` for ``model``: every module of the ``ModuleList`` at
    ``blocks`` (or of each listed path, in order) is one unit; a removed one is the identity.

    Args:
        model: the model (on any device, the meta device included).
        blocks: the path of the block list (``"model.layers"``), several paths, or ``None``
            to use the longest ``ModuleList`` of same-type modules (see ``find_blocks``).
        init_module: how to initialise what one module owns, for models built on the meta
            device (see ``UnitAdapter.init_module``); not needed for a materialised model.

    Raises:
        NoBlocksError: no such list, or not a ``ModuleList``.
    """
    paths = [find_blocks(model)] if blocks is None else (
        [blocks] if isinstance(blocks, str) else list(blocks))
    if not paths:
        raise NoBlocksError("blocks=[] names no block list; give at least one path")
    for path in paths:
        _check_list(model, path)

    def unit_paths(m: nn.Module) -> list[str]:
        # Re-read the lengths from the model it is given (the same architecture, possibly
        # another instance, e.g. the meta-device copy each worker builds).
        return [f"{p}.{i}" for p in paths for i in range(len(_check_list(m, p)))]

    return UnitAdapter(unit_paths=unit_paths, removed="passthrough", init_module=init_module)
