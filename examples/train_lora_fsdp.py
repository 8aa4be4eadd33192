#!/usr/bin/env python
"""LoRA training of a KimiHybrid model with accelerate + FSDP2, on any number of GPUs (or CPU processes).

Launch (one process per GPU; the count comes from the launcher, nothing here assumes 2):

    accelerate launch --config_file examples/accelerate_fsdp2.yaml --num_processes 2 \\
        examples/train_lora_fsdp.py --model /path/to/kimi-hybrid-48b-a3b --steps 50 --out out/lora-fsdp

    # the documented 48B-A3B slice with random weights (real widths, 4 layers: 3 KDA + 1 MLA, all MoE)
    accelerate launch --config_file examples/accelerate_fsdp2.yaml --num_processes 2 \\
        examples/train_lora_fsdp.py --preset kimi-linear-48b-a3b --layers 4 --synthetic --seq-len 4096 --steps 20

What it does. Loads the base model in bf16 (``--model``; with ``fsdp_cpu_ram_efficient_loading`` transformers reads
the checkpoint on rank 0 only and FSDP broadcasts the shards) or builds one from a preset with random weights (same
seed on every rank), attaches the recommended LoRA (``kimi_hybrid.app.lora.recommended_lora_config``: attention,
MLPs and the fused routed experts via ``target_parameters``), turns on non-reentrant gradient checkpointing, and lets
``accelerator.prepare`` shard every ``KimiDecoderLayer`` with FSDP2 (``examples/accelerate_fsdp2.yaml``). Frozen
base weights are sharded like the rest; only the LoRA parameters get gradients and AdamW state.

Data: ``--synthetic`` random token ids (throughput), or chunks of one CPython stdlib package's source
(``--package``, the task of ``examples/finetune_lora.py``), packed per step with ``DataCollatorWithFlattening``.
Every rank gets a different slice of the data (``accelerator.prepare`` of the DataLoader).

Reports per step: loss (mean over ranks), tokens/s over all ranks, peak memory of this rank. At the end the LoRA
weights are gathered (``DTensor.full_tensor``, only the LoRA parameters: the base model is never gathered) and the
adapter is saved by rank 0 (``adapter_config.json``, ``adapter_model.safetensors``, ``README.md``) with a JSON
report.

Tested on CPU with 2 processes (gloo) on a tiny model (``tests/test_distributed.py``); not run on GPUs here.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from kimi_hybrid.app.lora import enable_gradient_checkpointing, packing_collator, recommended_lora_config

ROOT = Path(__file__).resolve().parents[1]

LIN, FULL = "linear_attention", "full_attention"


def build_model(args, dtype):
    from transformers import AutoModelForCausalLM

    from kimi_hybrid import KimiHybridConfig, KimiHybridForCausalLM

    if args.model:
        return AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype)
    over = {}
    if args.layers:
        over = dict(num_hidden_layers=args.layers, layer_types=[LIN] * (args.layers - 1) + [FULL],
                    mlp_layer_types=["sparse"] * args.layers, first_k_dense_replace=0)
    cfg = KimiHybridConfig.from_preset(args.preset, **over)
    torch.manual_seed(args.seed)  # identical random weights on every rank
    return KimiHybridForCausalLM(cfg).to(dtype)


def make_rows(args, vocab_size):
    if args.synthetic:
        g = torch.Generator().manual_seed(args.seed)
        pool = [torch.randint(0, vocab_size, (args.seq_len,), generator=g).tolist()
                for _ in range(args.synthetic_pool or args.steps * args.batch_size * 64)]
        n = max(len(pool), args.steps * args.batch_size * 64)  # rows for every rank; a small pool repeats
        return [{"input_ids": pool[i % len(pool)]} for i in range(n)]
    from transformers import AutoTokenizer

    import finetune_lora as ft  # the sibling script (examples/ is on sys.path: the folder of the script run)

    tok = AutoTokenizer.from_pretrained(args.tokenizer or args.model or str(ROOT / "models" / "kimi-hybrid-stdlib"))
    train_files, _ = ft.package_files(args.package, 0.25)
    return [{"input_ids": c} for c in ft.chunks(tok, train_files, args.seq_len)]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="base model folder (else --preset with random weights)")
    ap.add_argument("--preset", default="kimi-linear-48b-a3b",
                    help="shipped preset name or .json file of KimiHybridConfig arguments")
    ap.add_argument("--layers", type=int, default=None, help="depth slice of the preset (layers-1 KDA + 1 MLA)")
    ap.add_argument("--tokenizer", default=None)
    ap.add_argument("--synthetic", action="store_true", help="random token ids instead of stdlib source")
    ap.add_argument("--synthetic-pool", type=int, default=None,
                    help="number of distinct random sequences (small = a memorisable task; default: no repeats)")
    ap.add_argument("--package", default="multiprocessing")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--batch-size", type=int, default=1, help="sequences per rank per step (packed in one row)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--alpha", type=int, default=32)
    ap.add_argument("--no-experts", action="store_true")
    ap.add_argument("--shard-manually", action="store_true",
                    help="apply FSDP2 fully_shard to every decoder layer and the root here (for a backend accelerate "
                         "does not shard, e.g. CPU processes with gloo in tests); GPUs use the accelerate config")
    ap.add_argument("--dtype", default=None, help="bfloat16 (default on GPU) / float32 (default on CPU)")
    ap.add_argument("--out", default="out/lora-fsdp")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    from accelerate import Accelerator
    from peft import get_peft_model

    acc = Accelerator()
    cuda = acc.device.type == "cuda"
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if cuda else torch.float32)
    model = build_model(args, dtype)
    model = get_peft_model(model, recommended_lora_config(model.config, r=args.rank, alpha=args.alpha,
                                                          include_experts=not args.no_experts))
    enable_gradient_checkpointing(model)
    model.train()
    n_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr, weight_decay=0.0)
    rows = make_rows(args, model.config.vocab_size)
    dl = torch.utils.data.DataLoader(rows, batch_size=args.batch_size, shuffle=True, collate_fn=packing_collator(),
                                     generator=torch.Generator().manual_seed(args.seed), drop_last=True)
    if args.shard_manually and acc.num_processes > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(acc.device.type, (acc.num_processes,))
        for layer in model.get_base_model().model.layers:  # the _no_split_modules unit: KimiDecoderLayer
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr, weight_decay=0.0)
        dl = acc.prepare(dl)
    else:
        model, opt, dl = acc.prepare(model, opt, dl)
    try:
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.tensor import DTensor

        fsdp_units = sum(isinstance(m, FSDPModule) for m in model.modules())
        sharded = sum(isinstance(p, DTensor) for p in model.parameters())
    except ImportError:  # pragma: no cover
        fsdp_units, sharded = 0, 0

    log, it = [], iter(dl)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t_start = time.perf_counter()
    for step in range(args.steps):
        try:
            batch = next(it)
        except StopIteration:
            it = iter(dl)
            batch = next(it)
        t = time.perf_counter()
        out = model(**batch, use_cache=False)
        acc.backward(out.loss)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        dt = time.perf_counter() - t
        tokens = acc.gather(torch.tensor([batch["input_ids"].numel()], device=acc.device)).sum().item()
        loss = acc.gather(out.loss.detach().float().reshape(1)).mean().item()
        rec = {"step": step, "loss": round(loss, 4), "step_s": round(dt, 3), "tokens_per_s": round(tokens / dt, 1)}
        if cuda:
            rec["peak_GiB_rank0"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        log.append(rec)
        if acc.is_main_process:
            print(json.dumps(rec), flush=True)

    # gather only the LoRA weights (a collective: every rank takes part), save on rank 0
    lora_sd = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            full = p.full_tensor() if hasattr(p, "full_tensor") else p
            lora_sd[name] = full.detach().to("cpu", torch.float32).clone()
    acc.wait_for_everyone()
    out_dir = Path(args.out)
    if acc.is_main_process:
        unwrapped = acc.unwrap_model(model)
        unwrapped.save_pretrained(str(out_dir / "adapter"), state_dict=lora_sd)
        timed = log[1:] or log
        report = {"world_size": acc.num_processes, "device": str(acc.device), "dtype": str(dtype),
                  "trainable_params": n_trainable, "steps": args.steps, "log": log,
                  "fsdp2_units": fsdp_units, "dtensor_params": sharded,
                  "first_loss": log[0]["loss"], "last_loss": log[-1]["loss"],
                  "median_tokens_per_s": sorted(r["tokens_per_s"] for r in timed)[len(timed) // 2],
                  "wall_s": round(time.perf_counter() - t_start, 1), "adapter_dir": str(out_dir / "adapter")}
        (out_dir / "report.json").write_text(json.dumps(report, indent=1) + "\n")
        print(json.dumps({k: v for k, v in report.items() if k != "log"}), flush=True)
    acc.wait_for_everyone()
    acc.end_training()


if __name__ == "__main__":
    main()
