"""Optimizer implementations across FSDP holder meshes (runtime.optim, [Note: optimizers
across meshes]).

Oracle: an ``--fsdp`` b-sdp run whose parameters span several meshes ends at the same
parameters with ``foreach=True`` and ``fused=True`` as with the per-tensor loop, so CUDA can
take ``fused`` whatever the meshes.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from subnetdp.runtime import SubnetDataParallel
from subnetdp.runtime.optim import fast_path
from tests.composition.test_fsdp_ac_bf16 import _batch, _meta_model, _plan
from tests.dist.harness import run_workers

IMPLS: list[dict[str, bool]] = [{"foreach": False}, {"foreach": True}, {"fused": True}]


def mesh_count(groups: list[dict[str, Any]]) -> int:
    return len({id(t.device_mesh) for g in groups for t in g["params"]
                if isinstance(t, DTensor)})


def _run(rank: int, world: int, plan: Any) -> list[tuple[int, dict[str, torch.Tensor]]]:
    out = []
    for impl in IMPLS:
        recipe, model = _meta_model()
        sdp = SubnetDataParallel(model, plan=plan, adapter=recipe.adapter, strategy="b-sdp",
                                 device="cpu", init_seed=0, fsdp=True)
        params = list(sdp.parameters())
        groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.1},
                  {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
        opt = torch.optim.AdamW(groups, lr=3e-3, betas=(0.9, 0.95), **impl)
        for step in range(2):
            x, y = _batch("llama", rank, step)
            logits = sdp(x)
            F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        out.append((mesh_count(groups), sdp.full_state_dict() or {}))
    return out


def test_foreach_and_fused_step_across_meshes_like_the_loop() -> None:
    results = run_workers(_run, 4, _plan("b-sdp"))
    assert all(meshes > 1 for r in results for meshes, _ in r)  # the case #134212 is about
    loop = results[0][0][1]
    assert loop
    for (_, state), impl in zip(results[0][1:], IMPLS[1:], strict=True):
        for key, ref in loop.items():
            torch.testing.assert_close(state[key], ref, rtol=1e-5, atol=1e-6, msg=str(impl))


def test_fast_path_by_device() -> None:
    assert fast_path("cpu") == {}
    assert fast_path("cpu", dtensors=True) == {"foreach": True}  # one dispatch per operation
    assert fast_path("cuda") == {"fused": True}
    assert fast_path("cuda", dtensors=True) == {"fused": True}
