"""Which torch optimizer implementation a rank's parameters allow (``fused``, ``foreach`` or
the per-tensor loop), as keyword arguments for ``torch.optim``.

[Note: optimizers across meshes]
Under ``--fsdp`` each held block is a DTensor on the mesh of its holder group, so one
parameter group mixes DTensors of several meshes. A multi-tensor (``foreach``) or ``fused``
step hands all of them to one kernel call, which DTensor refused as a "cross-mesh operation"
before torch 2.7 (foreach, pytorch/pytorch#134212, fixed by #147869) and 2.9 (fused AdamW's
``state_steps``, #157682). Splitting the parameter groups by mesh would avoid it but makes the
number of groups differ between ranks (rank 0's checkpoint manifest and every rank's LR
scheduler state are per group), so instead we pick the fastest implementation this torch runs
correctly on these parameters. CUDA gets torchtitan's default, ``fused``; CPU keeps torch's
own default (the per-tensor loop), which the memory estimator also models.
``tests/runtime/test_optim.py`` checks that foreach and fused steps of an ``--fsdp`` run end
at the same parameters as the loop.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.distributed.tensor import DTensor

CROSS_MESH_FOREACH = (2, 7)  # first torch whose DTensor foreach ops accept several meshes
CROSS_MESH_FUSED = (2, 9)  # ... and whose fused AdamW/Adam/SGD do


def torch_release(version: str = torch.__version__) -> tuple[int, int]:
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def mesh_count(params: Iterable[Any]) -> int:
    """Distinct device meshes among ``params`` (parameters or param-group dicts); plain
    tensors count as one more "mesh" only when no DTensor is present."""
    meshes: set[int] = set()
    plain = False
    for p in params:
        for t in (p["params"] if isinstance(p, dict) else [p]):
            if isinstance(t, DTensor):
                meshes.add(id(t.device_mesh))
            else:
                plain = True
    return len(meshes) or int(plain)


def fast_path(
    params: Iterable[Any], *, device_type: str, release: tuple[int, int] | None = None,
) -> dict[str, bool]:
    """``torch.optim`` keyword arguments for ``params`` on ``device_type``: ``{"fused": True}``
    on CUDA where this torch (``release``, default: the running one) fuses across the
    parameters' meshes, else ``{"foreach": True}`` where it can, else ``{"foreach": False}``;
    ``{}`` (torch's default) elsewhere ([Note: optimizers across meshes])."""
    if device_type != "cuda":
        return {}
    release = torch_release() if release is None else release
    several = mesh_count(params) > 1
    if not several or release >= CROSS_MESH_FUSED:
        return {"fused": True}
    return {"foreach": release >= CROSS_MESH_FOREACH}
