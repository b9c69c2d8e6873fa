"""SubnetDataParallel on a model of your own: train with b-sdp, save and resume the model with
its optimizer, evaluate the full model (docs/own-model.md walks through it).

    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 examples/own_model.py --steps 6 --ckpt runs/a
    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 examples/own_model.py --steps 3 --ckpt runs/b
    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 examples/own_model.py --steps 6 --ckpt runs/b \\
        --resume

The last two print the same losses, step by step, as the first. With CUDA each rank uses its
own GPU (NCCL), else gloo on the CPU; ``python examples/own_model.py ...`` runs it as one rank.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import subnetdp
from subnetdp import SubnetDataParallel, make_plan
from subnetdp.subnet import auto_adapter
from subnetdp.subnet.units import describe_units


class Block(nn.Module):
    """``x -> x + f(x)``: a block this rank does not hold is simply skipped (b-sdp)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.fc2(F.gelu(self.fc1(self.norm(x)))))


class ResidualMLP(nn.Module):
    def __init__(self, d_in: int = 16, d: int = 32, n_blocks: int = 8, classes: int = 4) -> None:
        super().__init__()
        self.inp = nn.Linear(d_in, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(n_blocks))  # the units
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


TEACHER = torch.randn(16, 4, generator=torch.Generator().manual_seed(0))


def batch(rank: int, step: int, size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's batch of ``step``: a function of (rank, step), so a resumed run draws what
    the uninterrupted one would have (with a DataLoader, resume its position yourself)."""
    x = torch.randn(size, 16, generator=torch.Generator().manual_seed(10_000 * step + rank))
    return x, (x @ TEACHER).argmax(-1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6, help="train until this step (default 6)")
    ap.add_argument("--ckpt", required=True, help="checkpoint folder (shared by all ranks)")
    ap.add_argument("--resume", action="store_true", help="continue from --ckpt's newest")
    ap.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (AdamW)")
    args = ap.parse_args()

    device = subnetdp.init_distributed()  # torchrun's group; cuda:LOCAL_RANK or CPU/gloo
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(1234 + rank)  # dropout masks per rank; the model needs no common seed
    with torch.device("meta"):  # nothing allocated: each rank materialises what it holds
        model = ResidualMLP()
    adapter = auto_adapter(model)  # the units: model.blocks
    units, shared = describe_units(model, adapter)
    plan = make_plan(world=world, units=units, coverage=0.5, shared_size=shared)
    sdp = SubnetDataParallel(model, plan=plan, adapter=adapter, device=device)
    opt = torch.optim.AdamW(sdp.parameters(), lr=args.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))  # warm-up
    start = subnetdp.load(args.ckpt, sdp, opt, scheduler=sched) if args.resume else 0

    for step in range(start + 1, args.steps + 1):
        x, y = batch(rank, step)
        loss = F.cross_entropy(sdp(x.to(device)), y.to(device))  # this rank's subnetwork
        loss.backward()  # gradients averaged over each block's holders
        sdp.clip_grad_norm_(1.0)  # the full model's norm, the same on every rank
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        if rank == 0:
            print(f"step {step} loss {mean.item() / world!r}", flush=True)

    subnetdp.save(args.ckpt, sdp, opt, step=args.steps, scheduler=sched)  # every rank
    state = sdp.full_state_dict()  # every rank; the full model arrives on rank 0
    if rank == 0:
        assert state is not None
        full = ResidualMLP()
        full.load_state_dict(state)
        full.eval()
        x, y = batch(rank=world, step=0, size=512)  # held out: no rank trains on step 0
        with torch.no_grad():
            logits = full(x)
        print(f"full model: validation loss {F.cross_entropy(logits, y).item()!r} accuracy "
              f"{(logits.argmax(-1) == y).float().mean().item():.3f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
