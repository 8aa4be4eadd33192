"""torchrun worker for tests/test_distributed.py: one LoRA forward/backward of a tiny KimiHybrid model sharded
with FSDP2 (``fully_shard`` per decoder layer + root) over CPU processes (gloo); rank 0 saves the loss and the full
LoRA gradients to ``argv[1]``."""

import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from kimi_hybrid import KimiHybridForCausalLM
from kimi_hybrid.app.lora import enable_gradient_checkpointing, recommended_lora_config
from presets import preset_config


def build():
    from peft import get_peft_model

    torch.manual_seed(0)
    m = KimiHybridForCausalLM(preset_config("tiny-kda-first"))
    pm = get_peft_model(m, recommended_lora_config(m.config, r=4, alpha=8, init_lora_weights=False))
    enable_gradient_checkpointing(pm)
    pm.train()
    return pm


def batch():
    return torch.randint(3, 128, (2, 16), generator=torch.Generator().manual_seed(5))


def main(out_path):
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    pm = build()
    for layer in pm.get_base_model().model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(pm, mesh=mesh)
    n_dtensor = sum(isinstance(p, DTensor) for p in pm.parameters())
    x = batch()
    out = pm(input_ids=x, labels=x)
    out.loss.backward()
    grads = {n: p.grad.full_tensor() for n, p in pm.named_parameters() if p.requires_grad and p.grad is not None}
    if dist.get_rank() == 0:
        torch.save({"loss": out.loss.item(), "grads": grads, "dtensor_params": n_dtensor}, out_path)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
