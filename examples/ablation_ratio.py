#!/usr/bin/env python
"""A small replication of the Kimi Linear layer-ratio ablation: 3:1 KDA:MLA hybrid vs all-MLA.

Kimi Linear (arXiv 2510.26692) compares hybrids of KDA and MLA layers against full attention at equal parameters
and tokens; here the two arms are the shipped stdlib model's shape (``train_default_model.stdlib_config``):

* ``hybrid_3to1``: 8 layers ``[KDA, KDA, KDA, MLA] x 2`` (KDA 4 heads x 64; MLA 4 heads);
* ``all_mla``: 8 MLA layers, with the MLA head count chosen so that the total parameter count is as close as
  possible to the hybrid's (a KDA layer has more parameters than a 4-head MLA layer at this width).

Both arms use the same seed, data order, optimiser, schedule, context and number of steps (so the same training
tokens). The number of steps is fixed by timing the hybrid arm (``--time-budget`` seconds) unless ``--steps`` is
given. Reported per arm: parameters, training time, held-out loss / perplexity at several evaluation contexts
(the contexts above the training context test length extrapolation: both arms use NoPE attention), and the
decoding cache bytes from ``KimiHybridCache.memory_report()`` after a batch-1 prefill of several lengths in bf16
(measured), plus the per-token / constant parts of the formula and its value at long contexts.

This is a short run at a tiny scale (minutes on one GPU, a few million tokens); the numbers show the trend and the
cache arithmetic, not the paper's.

Usage:
  python examples/ablation_ratio.py --data data --out examples/results/ablation_ratio.json --time-budget 60
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from train_default_model import (  # the sibling script (examples/ is on sys.path: the folder of the script run)
    MLA, ROOT, KimiHybridForCausalLM, KimiHybridTokenizer, cast_for_shipping, count_params, evaluate,
    load_ids, stdlib_config, train,
)


def _n_params(cfg) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in KimiHybridForCausalLM(cfg).parameters())


def arms(tokenizer):
    """``{name: config}``: the hybrid and the all-MLA arm with the closest total parameter count."""
    hybrid = stdlib_config(tokenizer)
    n_hybrid = _n_params(hybrid)
    best = None
    for heads in range(2, 9):
        cfg = stdlib_config(tokenizer, layer_types=[MLA] * 8, num_attention_heads=heads, num_key_value_heads=heads)
        n = _n_params(cfg)
        if best is None or abs(n - n_hybrid) < abs(best[1] - n_hybrid):
            best = (cfg, n)
    return {"hybrid_3to1": hybrid, "all_mla": best[0]}


@torch.no_grad()
def cache_bytes(model, lengths, device, vocab_size: int):
    """``memory_report()`` after a batch-1 prefill of ``L`` random ids, for each L (model in its current dtype)."""
    from kimi_hybrid import KimiHybridCache

    model.eval()
    out = []
    gen = torch.Generator().manual_seed(0)
    for L in lengths:
        ids = torch.randint(0, vocab_size - 256, (1, L), generator=gen).to(device)
        cache = KimiHybridCache(model.config)
        model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        rep = cache.memory_report()
        out.append({k: rep[k] for k in ("seen_tokens", "kda_bytes", "mla_bytes", "mask_bytes", "total_bytes",
                                         "mla_bytes_per_token", "kda_bytes_constant")})
        del cache
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", default=str(ROOT / "data"))
    p.add_argument("--tokenizer", default=str(ROOT / "models" / "kimi-hybrid-stdlib"))
    p.add_argument("--out", default=str(ROOT / "examples" / "results" / "ablation_ratio.json"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--steps", type=int, default=0, help="0 = time the hybrid arm to --time-budget")
    p.add_argument("--time-budget", type=float, default=60.0)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--eval-contexts", default="256,1024,2048")
    p.add_argument("--cache-lengths", default="1024,4096,16384")
    p.add_argument("--eval-max-windows", type=int, default=None)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)

    device = torch.device(args.device)
    amp = torch.bfloat16 if device.type == "cuda" else None
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    tokenizer = KimiHybridTokenizer.from_pretrained(args.tokenizer)
    data = Path(args.data)
    train_ids, heldout_ids = load_ids(data / "train_ids.npy"), load_ids(data / "heldout_ids.npy")
    eval_contexts = [int(x) for x in args.eval_contexts.split(",")]
    cache_lengths = [int(x) for x in args.cache_lengths.split(",")]
    steps = args.steps
    result = {"description": "3:1 KDA:MLA hybrid vs all-MLA at about equal parameters, same data order, steps, "
                             "tokens, optimiser and schedule; held-out loss in nats/token (bf16 weights); cache bytes "
                             "from KimiHybridCache.memory_report() after a batch-1 bf16 prefill",
              "seed": args.seed, "context": args.context, "batch_size": args.batch_size, "lr": args.lr,
              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "arms": {}}
    for name, cfg in arms(tokenizer).items():
        torch.manual_seed(args.seed)
        model = KimiHybridForCausalLM(cfg).to(device)
        params = count_params(model)
        print(f"[{name}] layer_types={cfg.layer_types} mla_heads={cfg.num_attention_heads} params={params}",
              flush=True)
        summary = train(model, train_ids, context=args.context, batch_size=args.batch_size, steps=steps,
                        time_budget=args.time_budget, lr=args.lr, warmup=args.warmup, min_lr_ratio=0.1,
                        weight_decay=0.1, seed=args.seed, device=device, amp_dtype=amp,
                        log=lambda m: print(m, flush=True), desc=name)
        steps = summary["steps"]  # the next arm trains exactly as long
        cast_for_shipping(model, torch.bfloat16)
        t0 = time.perf_counter()
        heldout = {str(c): evaluate(model, heldout_ids, c, max(1, 16 * 1024 // c), device, None,
                                    args.eval_max_windows) for c in eval_contexts}
        caches = cache_bytes(model, cache_lengths, device, cfg.vocab_size)
        last = caches[-1]
        formula = {str(L): last["kda_bytes_constant"] + L * last["mla_bytes_per_token"]
                   for L in (131072, 1048576)}
        result["arms"][name] = {
            "layer_types": cfg.layer_types, "mla_heads": cfg.num_attention_heads, "params": params,
            "train": {k: v for k, v in summary.items() if k != "curve"},
            "final_train_loss": summary["curve"][-1]["loss"], "heldout": heldout, "cache": caches,
            "cache_formula_bytes_batch1": formula, "eval_seconds": round(time.perf_counter() - t0, 1),
        }
        print(f"[{name}] held-out: " + ", ".join(f"ctx {c}: {v['loss']:.4f}" for c, v in heldout.items()), flush=True)
        print(f"[{name}] cache bytes: " + ", ".join(f"{c['seen_tokens']}: {c['total_bytes']}" for c in caches),
              flush=True)
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
    h, m = result["arms"]["hybrid_3to1"], result["arms"]["all_mla"]
    c = str(args.context)
    result["summary"] = {
        "heldout_loss_hybrid_minus_all_mla_at_train_context": h["heldout"][c]["loss"] - m["heldout"][c]["loss"],
        "cache_bytes_ratio_hybrid_over_all_mla": {str(a["seen_tokens"]): a["total_bytes"] / b["total_bytes"]
                                                  for a, b in zip(h["cache"], m["cache"])},
    }
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result["summary"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
