"""Worker for tests/test_parallel_plans.py, run under ``torchrun --nproc_per_node 2`` (gloo, CPU).

``python tests/parallel_plan_worker.py MODEL_DIR KIND EXPERTS_IMPL OUT_JSON``: loads MODEL_DIR once plainly and once
with transformers' ``DistributedConfig`` (KIND ``tp``: ``tp_size=2``; ``ep``: ``tp_size=2, ep_size=2``, the experts
on the EP plan and the rest on the TP plan), runs the same batch through both in fp32 (no gradient) and, on rank 0,
writes the max abs logit difference and the names of the parameters that were sharded (DTensors) to OUT_JSON.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist


def main(model_dir: str, kind: str, experts_impl: str, out_json: str) -> None:
    """Run the comparison described in the module docstring."""
    from transformers.distributed.configuration_utils import DistributedConfig

    from kimi_hybrid import KimiHybridForCausalLM

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    cfg = DistributedConfig(tp_size=2) if kind == "tp" else DistributedConfig(tp_size=2, ep_size=2)
    kw = dict(dtype=torch.float32, experts_implementation=experts_impl)
    model = KimiHybridForCausalLM.from_pretrained(model_dir, distributed_config=cfg, **kw).eval()
    ref = KimiHybridForCausalLM.from_pretrained(model_dir, **kw).eval()
    torch.manual_seed(0)
    ids = torch.randint(3, ref.config.vocab_size, (2, 11))
    with torch.no_grad():
        diff = (ref(ids).logits - model(ids).logits).abs().max().item()
    from torch.distributed.tensor import DTensor

    sharded = sorted(n for n, p in model.named_parameters() if isinstance(p.data, DTensor) or isinstance(p, DTensor))
    if dist.get_rank() == 0:
        with open(out_json, "w") as f:
            json.dump({"max_abs_diff": diff, "sharded": sharded}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:5])
