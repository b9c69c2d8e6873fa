import torch
import torch.nn.functional as F

import subnetdp
from subnetdp.models import get_recipe
from subnetdp.subnet.units import describe_units

device = subnetdp.init_distributed()  # under torchrun: this rank's GPU (NCCL), or CPU (gloo)
recipe = get_recipe("llama-tiny")
with torch.device("meta"):  # nothing is allocated yet
    model = recipe.build_model()
units, shared = describe_units(model, recipe.adapter)
world = torch.distributed.get_world_size()
plan = subnetdp.make_plan(world=world, units=units, coverage=0.5, shared_size=shared)
model = subnetdp.SubnetDataParallel(model, plan=plan, adapter=recipe.adapter, device=device)
opt = torch.optim.AdamW(model.parameters(), lr=3e-4)  # this rank's held blocks + shared
for _ in range(3):
    x = torch.randint(0, 4096, (8, 33), device=device)  # this rank's batch of tokens
    loss = F.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
    loss.backward()  # gradients come back averaged over each block's holders
    model.clip_grad_norm_(1.0)  # the full model's norm: the same factor on every rank
    opt.step()
    opt.zero_grad()
subnetdp.save("ckpt", model, opt, step=3)  # collective: every rank writes its share
state = model.full_state_dict()  # collective: the full model on rank 0, None elsewhere
