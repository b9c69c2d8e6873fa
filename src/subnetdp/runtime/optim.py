"""Which torch optimizer implementation a rank's parameters get (``fused`` on CUDA, torch's
default elsewhere), as keyword arguments for ``torch.optim``.

[Note: optimizers across meshes]
Under ``--fsdp`` each held block is a DTensor on the mesh of its holder group, so one
parameter group mixes DTensors of several meshes. A multi-tensor (``foreach``) or ``fused``
step hands all of them to one kernel call, which DTensor refused as a "cross-mesh operation"
before torch 2.7 (foreach, pytorch/pytorch#134212, fixed by #147869) and 2.9 (fused AdamW's
``state_steps``, #157682). Splitting the parameter groups by mesh would avoid it but makes the
number of groups differ between ranks (rank 0's checkpoint manifest and every rank's LR
scheduler state are per group). Every torch subnetdp supports (2.9 and later: ``torch_compat``)
has both fixes, so CUDA gets torchtitan's default, ``fused``, whatever the meshes; CPU keeps
torch's own default (the per-tensor loop), which the memory estimator also models.
``tests/runtime/test_optim.py`` checks that foreach and fused steps of an ``--fsdp`` run end
at the same parameters as the loop.
"""

from __future__ import annotations


def fast_path(device_type: str) -> dict[str, bool]:
    """``torch.optim`` keyword arguments on ``device_type``: ``{"fused": True}`` on CUDA, over
    any meshes ([Note: optimizers across meshes]); ``{}`` (torch's default) elsewhere."""
    return {"fused": True} if device_type == "cuda" else {}
