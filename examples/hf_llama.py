"""b-sdp on a Hugging Face LLaMA that subnetdp knows nothing about (offline, small config).

    pip install -e '.[hf]'
    OMP_NUM_THREADS=1 torchrun --nproc-per-node 4 examples/hf_llama.py

Each worker holds half of the decoder layers (``auto_adapter`` finds ``model.model.layers``),
trains on its own batches of toy sequences, and rank 0 loads the assembled weights back into a
plain ``LlamaForCausalLM``. With CUDA it runs on NCCL, one GPU per worker; else gloo on CPU.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from subnetdp import SubnetDataParallel, make_plan
from subnetdp.distributed.process_group import init_distributed
from subnetdp.subnet import auto_adapter
from subnetdp.subnet.units import describe_units


def main() -> None:
    rank, world = init_distributed()  # NCCL on GPU LOCAL_RANK when CUDA is there, else gloo
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cpu")
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
                         tie_word_embeddings=False, use_cache=False)  # no KV cache in training
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    adapter = auto_adapter(model)
    units, shared = describe_units(model, adapter)
    plan = make_plan(world=world, units=units, coverage=0.5, shared_size=shared)
    total = sum(p.numel() for p in model.parameters())
    sdp = SubnetDataParallel(model, plan=plan, adapter=adapter, device=device)
    opt = torch.optim.AdamW(sdp.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(rank)
    for step in range(30):
        # Learnable toy sequences: arithmetic progressions mod the vocabulary.
        start = torch.randint(0, config.vocab_size, (8, 1), generator=g)
        stride = torch.randint(1, 5, (8, 1), generator=g)
        tokens = ((start + stride * torch.arange(33)) % config.vocab_size).to(device)
        logits = sdp(tokens[:, :-1]).logits
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        sdp.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        if rank == 0 and step % 10 == 0:
            print(f"step {step:2d}  loss {loss.item():.3f}  "
                  f"bytes/step {sdp.comm_stats.last_step_bytes / 2**20:.2f} MiB")
    full = sdp.full_state_dict()
    if rank == 0:
        assert full is not None
        plain = LlamaForCausalLM(config)
        plain.load_state_dict(full, strict=True)
        print(f"on {device}: layers held by rank 0: {plan.held_units(0)}; params held "
              f"{sdp.params_held:,} of {total:,}; exported weights load into LlamaForCausalLM")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
