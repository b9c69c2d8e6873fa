"""FSDP2 over gloo: a ring reduce-scatter, and all-gathers that overlap compute.

gloo's ``reduce_scatter_tensor`` is a clone and an all-reduce of the whole tensor
(``ProcessGroupGloo::reduce_scatter_tensor_coalesced``), so FSDP2 over gloo puts 2(h-1)/h of
every gradient on the wire where a ring needs (h-1)/h (docs/results/network.md, part 5).
``RingReduceScatter`` is the ring, out of gloo's point-to-point sends: h-1 steps, in each of
which every rank sends one 1/h chunk to the next rank and adds the chunk it receives from the
previous one; after the last step rank i holds the reduced chunk i. Besides its input and
output it holds one chunk-sized buffer (gloo's clone: the whole input). FSDP2 takes it through
its supported hook, ``FSDPModule.set_custom_reduce_scatter`` (``GlooComms``).

Semantics are FSDP2's reduce-scatter: ``input`` is the padded flat gradient, h equal chunks
in group-rank order; ``output`` gets this rank's chunk reduced with ``op`` (FSDP2 passes
``AVG`` for fp32/bf16 reductions, ``SUM`` with its own pre/post-divide for fp16; any other op
goes to the built-in collective). Sums run in the tensor's dtype, as gloo's all-reduce does;
only the order of the h-1 additions differs from gloo's, so results agree to fp32 summation
order (bit for bit at h = 2, where the one addition commutes).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule

from subnetdp.torch_compat import ReduceScatter, reduce_scatter_single, set_unshard_async

_RING_OPS = (dist.ReduceOp.SUM, dist.ReduceOp.AVG)


class RingReduceScatter(ReduceScatter):
    """FSDP2's reduce-scatter as a ring of gloo sends (the module docstring)."""

    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: dist.ProcessGroup, op: dist.ReduceOp | dist.ReduceOp.RedOpType,
                 async_op: bool = False) -> dist.Work | None:
        if op not in _RING_OPS:  # e.g. PREMUL_SUM: FSDP2 only asks for it with a custom divisor
            return reduce_scatter_single(output_tensor, input_tensor, op=op, group=group,
                                         async_op=async_op)
        ring_reduce_scatter(output_tensor, input_tensor, group)
        if op == dist.ReduceOp.AVG:
            output_tensor.div_(group.size())
        return None  # done: FSDP2 calls this synchronously (async_op=False)


def ring_reduce_scatter(out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup) -> None:
    """``out`` = the sum over ``group`` of chunk ``group rank`` of every rank's flat ``inp``
    (``inp.numel() == h * out.numel()``); ``inp`` is left unchanged."""
    h, me = group.size(), group.rank()
    n = out.numel()
    if inp.numel() != h * n:
        raise ValueError(f"reduce-scatter input has {inp.numel()} elements, not {h} x {n}")
    chunks = inp.reshape(-1).split(n)
    nxt = dist.get_global_rank(group, (me + 1) % h)
    prv = dist.get_global_rank(group, (me - 1) % h)
    # The partial sums accumulate in ``out`` itself (each sent before it is overwritten), so
    # the ring holds one chunk-sized buffer besides its input and output.
    acc = out.view(-1)
    send, recv = chunks[(me - 1) % h], torch.empty_like(acc)
    for s in range(h - 1):
        # step s: pass on the partial sum of chunk me-s-1, receive the one of chunk me-s-2
        # (at s = 0 just the chunk itself); the last step's is this rank's own chunk
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, send, nxt, group),
                                        dist.P2POp(dist.irecv, recv, prv, group)])
        for w in works:
            w.wait()
        torch.add(recv, chunks[(me - s - 2) % h], out=acc)
        send = acc
    if h == 1:
        acc.copy_(chunks[0])


@dataclass(frozen=True)
class GlooComms:
    """How FSDP2 communicates over a gloo mesh (``Composition``'s fields of the same names).
    ``ring_reduce_scatter``: ``RingReduceScatter``, not gloo's all-reduce of the whole
    tensor. ``async_unshard``: all-gathers are issued asynchronously (gloo runs them on its
    own threads), so a prefetched block's gather overlaps the current block's compute; FSDP2's
    default (``async_op=False``) relies on CUDA streams for that overlap and, on a CPU, which
    has none, blocks for every all-gather where it is issued, prefetch or not."""

    ring_reduce_scatter: bool = True
    async_unshard: bool = True

    def apply(self, module: FSDPModule, mesh: DeviceMesh) -> None:
        """Set ``module`` (just ``fully_shard``-ed over ``mesh``) up for gloo when the mesh's
        process group is gloo's with more than one rank; anything else (NCCL, the fake group
        of compute-only runs and the memory estimator, one-rank meshes) keeps FSDP2's
        defaults."""
        pg = mesh.get_group()
        if pg.size() < 2 or dist.get_backend(pg) != dist.Backend.GLOO:
            return
        if self.ring_reduce_scatter:
            module.set_custom_reduce_scatter(RingReduceScatter())
        if self.async_unshard:
            set_unshard_async(module, True)


GLOO_DEFAULTS = GlooComms()
