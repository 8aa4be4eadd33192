#!/usr/bin/env python
"""QLoRA training peak and throughput at full depth under an 80 GB cap: FP8 block-scaled base + LoRA.

The model: the Kimi-Linear-48B-A3B preset in the released plan (27 layers, MLA at 3, 7, 11, 15, 19, 23, 26, dense
layer 0), random weights. It is built on the meta device and materialised one decoder layer at a time on the GPU in
bf16 (random normal(0, 0.02), norms 1, the fp32 keep-list ``A_log`` / ``dt_bias`` / ``e_score_correction_bias``
in fp32), then that layer is quantized at once (``quantize_model_fp8_``: 128x128 blocks), so the bf16 model
(91.5 GiB) never exists on the GPU; embeddings and ``lm_head`` stay bf16.

The step: ``kimi_hybrid.app.qlora.qlora_config`` (r=16, alpha=32: attention, MLA, shared experts, dense MLP,
routed experts as split low-rank products), non-reentrant gradient checkpointing, AdamW on the adapters, random
ids ``[batch, seq_len]``, ``labels = input_ids``. ``torch.cuda.set_per_process_memory_fraction`` caps the process at
``--memory-cap-gib`` (80) before anything is allocated. ``tok_s = batch * seq_len / median timed step``.

The bf16 LoRA reference is ``examples/bench_lora.py --layers 27`` (it needs ~115 GiB, so it cannot run under the
cap; pass its ``tokens_per_s`` as ``--bf16-tok-s`` to record the ratio).

Usage (H200, ~5 min): ``python examples/bench_qlora.py --out examples/results/bench_qlora_h200.json``
CPU smoke: ``python examples/bench_qlora.py --config tiny.json --device cpu --seq-len 32 --steps 1``
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

KEEP_FP32 = ("A_log", "dt_bias", "e_score_correction_bias")


def build_config(args):
    from kimi_hybrid import KimiHybridConfig

    if args.config:
        return KimiHybridConfig(**json.loads(Path(args.config).read_text()))
    return KimiHybridConfig.from_preset("kimi-linear-48b-a3b", num_hidden_layers=args.layers)


def _init_random_(module: torch.nn.Module, gen: torch.Generator) -> None:
    """Random weights in place: matrices normal(0, 0.02), vectors (norm scales) 1, ``A_log`` log(U[1, 16]),
    ``dt_bias`` / router bias 0."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if leaf == "A_log":
                p.copy_(torch.empty(p.shape, device=p.device).uniform_(1, 16, generator=gen).log())
            elif leaf in ("dt_bias", "e_score_correction_bias"):
                p.zero_()
            elif p.ndim == 1:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)


def build_quantized(cfg, device, block):
    """The model on ``device``: bf16 materialised and quantized one decoder layer at a time."""
    from kimi_hybrid import KimiHybridForCausalLM
    from kimi_hybrid.quantization_kimi_hybrid import quantize_model_fp8_

    with torch.device("meta"):
        model = KimiHybridForCausalLM(cfg)
    model.to(torch.bfloat16)
    for mod in model.modules():
        for name in KEEP_FP32:
            p = getattr(mod, name, None)
            if isinstance(p, torch.nn.Parameter):
                setattr(mod, name, torch.nn.Parameter(p.float(), requires_grad=False))
    gen = torch.Generator(device=device).manual_seed(0)
    for layer in model.model.layers:
        layer.to_empty(device=device)
        _init_random_(layer, gen)
        quantize_model_fp8_(layer, block_size=block)
    rest = [m for n, m in model.model.named_children() if n != "layers"] + [model.lm_head]
    for m in rest:  # (the model has no buffers: every tensor is one of these parameters)
        m.to_empty(device=device)
        _init_random_(m, gen)
    for p in model.parameters():
        p.requires_grad_(False)
    return model.train()


def _train_step(pm, opt, ids) -> float:
    """One optimizer step on ``ids`` (labels = ids, the step of examples/bench_lora.py); returns the loss."""
    out = pm(input_ids=ids, labels=ids, use_cache=False)
    out.loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return out.loss.item()


def bench(model, cfg, args, device):
    from peft import get_peft_model

    from kimi_hybrid.app.lora import enable_gradient_checkpointing
    from kimi_hybrid.app.qlora import qlora_config

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    weights = torch.cuda.memory_allocated() / 2**30 if device.type == "cuda" else None
    pm = get_peft_model(model, qlora_config(cfg, r=args.rank, alpha=2 * args.rank))
    enable_gradient_checkpointing(pm)
    pm.train()
    trainable = [p for p in pm.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-4)
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq_len),
                        generator=torch.Generator().manual_seed(1)).to(device)

    def step():
        return _train_step(pm, opt, ids)

    out = {"trainable_params": sum(p.numel() for p in trainable), "weights_gib": weights}
    t0 = time.perf_counter()
    for _ in range(args.warmup):
        out["first_loss"] = step()
    sync()
    out["warmup_s"] = round(time.perf_counter() - t0, 2)
    times = []
    for _ in range(args.steps):
        t = time.perf_counter()
        out["last_loss"] = step()
        sync()
        times.append(time.perf_counter() - t)
    med = statistics.median(times)
    out.update(step_s=[round(x, 3) for x in times], tok_s=round(args.batch * args.seq_len / med, 1))
    if device.type == "cuda":
        out["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 3)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=27)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--block", type=int, default=128, help="FP8 block size (square)")
    ap.add_argument("--memory-cap-gib", type=float, default=80.0)
    ap.add_argument("--bf16-tok-s", type=float, default=None, help="bench_lora.py's bf16 tokens_per_s, for the ratio")
    ap.add_argument("--config", default=None, help="a .json of KimiHybridConfig arguments (CPU smoke runs)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.memory_cap_gib * 2**30 / total), device)
    cfg = build_config(args)
    t0 = time.perf_counter()
    model = build_quantized(cfg, device, (args.block, args.block))
    build_s = round(time.perf_counter() - t0, 1)
    res = bench(model, cfg, args, device)
    qlora = {"peak_gib": res.get("peak_gib"), "tok_s": res["tok_s"], "layers": cfg.num_hidden_layers,
             "memory_cap_gib": args.memory_cap_gib,
             "quantization": f"fp8 e4m3 {args.block}x{args.block} block scales: linears (not lm_head, kv_b_proj) "
                             "and routed experts; LoRA r=%d" % args.rank}
    if args.bf16_tok_s:
        qlora["tok_s_vs_bf16"] = round(res["tok_s"] / args.bf16_tok_s, 3)
    result = {"summary": {"qlora": qlora}, "build_s": build_s, "run": res, "seq_len": args.seq_len,
              "batch": args.batch, "torch": torch.__version__}
    print(json.dumps(result, indent=1), flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
