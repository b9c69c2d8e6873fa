"""Build a worker's physical subnetwork: drop the units it does not hold, materialise the rest.

The model may arrive on the meta device (the memory-saving path: non-held units are never
allocated) or already materialised (then non-held units are simply dropped and freed).
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Mapping

import torch
from torch import nn

from subnetdp.subnet.adapter import UnitAdapter
from subnetdp.subnet.pieces import tied_parameters
from subnetdp.subnet.removed import removed_module
from subnetdp.subnet.units import unit_modules


def drop_units(model: nn.Module, adapter: UnitAdapter, held: Iterable[int]) -> list[str]:
    """Replace every unit not in ``held`` by its parameter-free stand-in; return their names."""
    keep = set(held)
    dropped = []
    for i, (name, module) in enumerate(unit_modules(model, adapter)):
        if i in keep:
            continue
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        # like=module: the stand-in follows the block's calling convention (removed.py).
        setattr(parent, child, removed_module(adapter.removed, name, like=module))
        dropped.append(name)
    return dropped


def _name_seed(seed: int, name: str) -> int:
    # A stable per-module seed (Python's hash() is salted per process, crc32 is not).
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63 - 1)


def _owns_tensors(module: nn.Module) -> bool:
    return any(True for _ in module.parameters(recurse=False)) or any(
        True for _ in module.buffers(recurse=False)
    )


def _init_one(name: str, module: nn.Module, adapter: UnitAdapter, seed: int) -> None:
    torch.manual_seed(_name_seed(seed, name))
    if adapter.init_module is not None:
        adapter.init_module(name, module)
    elif callable(reset := getattr(module, "reset_parameters", None)):
        reset()
    else:
        raise ValueError(
            f"module {name!r} ({type(module).__name__}) owns parameters but has no "
            "reset_parameters(); give the adapter an init_module function"
        )


def _set_tensor(module: nn.Module, attr: str, new: torch.Tensor) -> None:
    old = module._parameters.get(attr)
    if old is not None:
        module._parameters[attr] = nn.Parameter(new, requires_grad=old.requires_grad)
    else:
        module._buffers[attr] = new


def narrow_tensors(model: nn.Module, slices: Mapping[str, tuple[int, torch.Tensor]]) -> None:
    """Replace each sliced entry by its local part: ``index_select`` of the full tensor along
    ``dim`` (n-sdp's physically narrower layers). On the meta device only shapes change."""
    with torch.no_grad():
        for key, (dim, index) in slices.items():
            mod_name, _, attr = key.rpartition(".")
            module = model.get_submodule(mod_name)
            old = getattr(module, attr)
            _set_tensor(module, attr, old.detach().index_select(dim, index.to(old.device)))


def materialize(
    model: nn.Module,
    adapter: UnitAdapter,
    *,
    device: torch.device | str,
    seed: int,
    slices: Mapping[str, tuple[int, torch.Tensor]] | None = None,
) -> nn.Module:
    """Allocate a meta-device model on ``device`` and initialise it deterministically.

    Module by module: allocate, initialise at full size from the name seed, then cut the
    entries in ``slices`` down to this rank's part. So a narrowed layer holds exactly the
    full model's values at its indices, and at most one full-size module exists at a time.

    ``to_empty`` allocates each module's tensors anew, which would split a tied parameter
    (``head.weight = emb.weight``) in two; so once the alias's module is initialised (its own
    init may need the alias, e.g. a bias's fan-in), the alias is pointed back at the canonical
    parameter, which came earlier in module order: a tie keeps the canonical one's values.
    """
    device = torch.device(device)
    fork_devices = [device] if device.type == "cuda" else []
    slices = slices or {}
    ties = tied_parameters(model)
    with torch.no_grad(), torch.random.fork_rng(devices=fork_devices):
        for name, module in model.named_modules():
            if not _owns_tensors(module):
                continue
            module.to_empty(device=device, recurse=False)
            _init_one(name, module, adapter, seed)
            prefix = f"{name}." if name else ""
            for attr in list(module._parameters):
                if (canonical := ties.get(prefix + attr)) is not None:
                    module._parameters[attr] = model.get_parameter(canonical)
            mine = {k[len(prefix):]: v for k, v in slices.items()
                    if k.startswith(prefix) and "." not in k[len(prefix):]}
            if mine:
                narrow_tensors(module, mine)
    return model


def is_on_meta(model: nn.Module) -> bool:
    tensors = [*model.parameters(), *model.buffers()]
    return bool(tensors) and all(t.is_meta for t in tensors)


def build_full_model(
    model: nn.Module, adapter: UnitAdapter, *, device: torch.device | str = "cpu", seed: int = 0
) -> nn.Module:
    """The full model with the same initial values as the workers' subnetworks (a reference)."""
    return materialize(model, adapter, device=device, seed=seed) if is_on_meta(model) else model
