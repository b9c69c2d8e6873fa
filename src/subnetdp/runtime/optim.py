"""Which torch optimizer implementation a rank's parameters get (``fused`` on CUDA, ``foreach``
over FSDP's DTensors elsewhere, else torch's default), as keyword arguments for ``torch.optim``.

[Note: optimizers across meshes]
Under ``--fsdp`` each held block is a DTensor on the mesh of its holder group, so one
parameter group mixes DTensors of several meshes. A multi-tensor (``foreach``) or ``fused``
step hands all of them to one kernel call, which DTensor refused as a "cross-mesh operation"
before torch 2.7 (foreach, pytorch/pytorch#134212, fixed by #147869) and 2.9 (fused AdamW's
``state_steps``, #157682). Splitting the parameter groups by mesh would avoid it but makes the
number of groups differ between ranks (rank 0's checkpoint manifest and every rank's LR
scheduler state are per group). Every torch subnetdp supports (2.9 and later: ``torch_compat``)
has both fixes, so CUDA gets torchtitan's default, ``fused``, whatever the meshes. Elsewhere
torch's default is the per-tensor loop (its CPU foreach kernels loop as well), but over DTensors
every tensor operation of the loop is a DTensor dispatch, about ten per parameter and step;
``foreach`` dispatches each operation once for a whole list. n-sdp's FSDP parts are many small
parameters (131 on llama-tiny at C = 0.5, 4 ranks): the step's optimizer took 0.028 s of CPU
with the loop, 0.012 s with foreach (b-sdp+fsdp's 39: 0.012 and 0.006). So DTensor parameters
off CUDA get ``foreach``; plain tensors keep the loop. The memory estimator runs the same
choice (``estimate.spec.optimizer_for``). ``tests/runtime/test_optim.py`` checks that foreach
and fused steps of an ``--fsdp`` run end at the same parameters as the loop.
"""

from __future__ import annotations


def fast_path(device_type: str, *, dtensors: bool = False) -> dict[str, bool]:
    """``torch.optim`` keyword arguments on ``device_type``: ``{"fused": True}`` on CUDA, over
    any meshes; elsewhere ``{"foreach": True}`` where the parameters are DTensors (``--fsdp``),
    else ``{}`` (torch's default): [Note: optimizers across meshes]."""
    if device_type == "cuda":
        return {"fused": True}
    return {"foreach": True} if dtensors else {}
