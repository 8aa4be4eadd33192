#!/usr/bin/env python
"""LoRA training throughput and peak memory: KimiHybrid vs transformers' native ``kimi_linear``, one run, same
config, same weights, same PEFT config.

What is measured. One optimizer step = forward + backward (gradient checkpointing over the decoder layers,
non-reentrant) + AdamW on the LoRA parameters, on random token ids ``[batch, seq_len]`` with ``labels = input_ids``.
``tokens_per_s = batch * seq_len / median step time`` after ``--warmup`` untimed steps (the first steps include
Triton autotuning of the FLA kernels). ``peak_GiB`` is ``torch.cuda.max_memory_allocated`` over the timed steps,
``weights_GiB`` the allocated memory before LoRA is attached (the frozen base weights, shared by both models).

``first_step_s`` is the first step alone (on a fresh machine: FLA's forward and backward autotuning), and a line is
printed before it so the wait is not silent. The JSON's ``summary`` holds the headline numbers ``{ours, native}``:
``lora_train_tok_s``, ``lora_train_peak_gib``, ``lora_first_step_s``, ``lora_step_s``.

The model. The 48B-A3B widths (hidden 2304, 32 KDA heads x 128, MLA 32 heads with kv_lora_rank 512, 256 experts
top-8 with moe_intermediate 1024 + 1 shared expert, vocab 163840), bf16, at full depth by default: ``--layers 27``
runs the released plan (MLA at 0-based 3, 7, 11, 15, 19, 23, 26, dense layer 0, KDA + MoE elsewhere); another
depth runs a slice of layers-1 KDA + 1 MLA, every layer MoE (``--plan slice``). The native model is built first on
the GPU; its weights are mapped to our layout with ``conversion.native.native_state_dict_views`` and *assigned* to
our model (the same storage: no copy), so both route the same tokens to the same experts. A parity line reports
the max |logit difference| on one batch.

LoRA: ``kimi_hybrid.app.lora.recommended_lora_config`` (r=16, alpha=32): attention q/k/v/o, MLA kv_a/kv_b,
shared-expert MLP, routed experts through ``target_parameters``. The same module / parameter names exist in the
native model, so one ``LoraConfig`` serves both.

Usage (GPU, full depth, ~4-5 min on an H200 with FLA's autotune results restored):
``python examples/bench_lora.py --out examples/results/bench_lora_h200.json``. CPU smoke run on small widths:
``python examples/bench_lora.py --tiny --layers 4 --device cpu --seq-len 32 --steps 1`` (or ``--config small.json``,
a file of KimiHybridConfig arguments).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]

LIN, FULL = "linear_attention", "full_attention"


#: ``--tiny``: small widths for a CPU smoke run (any depth; the layer plan comes from ``--plan``)
TINY_WIDTHS = {
    "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4,
    "num_key_value_heads": 4, "hidden_act": "silu", "rms_norm_eps": 1e-5, "max_position_embeddings": 4096,
    "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "q_lora_rank": None,
    "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "mla_use_nope": True,
    "num_experts": 8, "num_experts_per_token": 2, "moe_intermediate_size": 32, "num_shared_experts": 1,
    "routed_scaling_factor": 2.446, "moe_router_activation_func": "sigmoid", "moe_renormalize": True,
    "linear_attn_config": {"head_dim": 16, "num_heads": 4, "short_conv_kernel_size": 4},
}


def layer_plan(args):
    """``(layer_types, mlp_layer_types)``: ``released`` = Kimi-Linear-48B-A3B's plan (27 layers, MLA at 0-based
    3, 7, 11, 15, 19, 23, 26, dense layer 0); ``slice`` = layers-1 KDA + 1 MLA, every layer MoE."""
    if args.plan == "released":
        from kimi_hybrid import KimiHybridConfig

        ref = KimiHybridConfig.from_preset("kimi-linear-48b-a3b")
        if args.layers != ref.num_hidden_layers:
            raise SystemExit(f"--plan released has {ref.num_hidden_layers} layers; pass --layers "
                             f"{ref.num_hidden_layers} or --plan slice")
        return list(ref.layer_types), list(ref.mlp_layer_types)
    return [LIN] * (args.layers - 1) + [FULL], ["sparse"] * args.layers


def plan_text(args):
    lt, mt = layer_plan(args)
    mla = [i for i, t in enumerate(lt) if t == FULL]
    dense = [i for i, t in enumerate(mt) if t == "dense"]
    return f"{args.plan}: {len(lt)} layers, MLA at {mla}, dense at {dense or 'none'}, the rest KDA + MoE"


def build_configs(args):
    """Our config and the equivalent transformers ``KimiLinearConfig``."""
    from transformers import KimiLinearConfig

    from kimi_hybrid import KimiHybridConfig

    layer_types, mlp_types = layer_plan(args)
    plan = dict(num_hidden_layers=args.layers, layer_types=layer_types, mlp_layer_types=mlp_types,
                first_k_dense_replace=mlp_types.count("dense"))
    if args.tiny:
        ours = KimiHybridConfig(**{**TINY_WIDTHS, **plan}, num_expert_group=1, topk_group=1)
    elif args.config:
        ours = KimiHybridConfig.from_preset(args.config, **plan, num_expert_group=1, topk_group=1)
    else:
        ours = KimiHybridConfig.from_preset("kimi-linear-48b-a3b", **plan)
    lac = ours.linear_attn_config
    native = KimiLinearConfig(
        vocab_size=ours.vocab_size, hidden_size=ours.hidden_size, intermediate_size=ours.intermediate_size,
        moe_intermediate_size=ours.moe_intermediate_size, num_hidden_layers=ours.num_hidden_layers,
        num_attention_heads=ours.num_attention_heads, num_key_value_heads=ours.num_attention_heads,
        n_shared_experts=ours.num_shared_experts, routed_scaling_factor=ours.routed_scaling_factor,
        kv_lora_rank=ours.kv_lora_rank, q_lora_rank=ours.q_lora_rank, qk_rope_head_dim=ours.qk_rope_head_dim,
        v_head_dim=ours.v_head_dim, qk_nope_head_dim=ours.qk_nope_head_dim, n_group=ours.num_expert_group,
        topk_group=ours.topk_group, num_experts_per_tok=ours.num_experts_per_token,
        norm_topk_prob=ours.moe_renormalize, hidden_act="silu", rms_norm_eps=ours.rms_norm_eps,
        num_local_experts=ours.num_experts, mlp_layer_types=mlp_types, layer_types=layer_types,
        linear_head_dim=int(lac["head_dim"]), linear_num_heads=int(lac["num_heads"]),
        linear_conv_kernel_dim=int(lac["short_conv_kernel_size"]), tie_word_embeddings=False,
        pad_token_id=ours.pad_token_id, bos_token_id=ours.bos_token_id, eos_token_id=ours.eos_token_id,
    )
    return ours, native


def build_models(args, device, dtype):
    """Native model with random weights on ``device``; ours sharing its tensors."""
    from transformers import KimiLinearForCausalLM

    from kimi_hybrid.conversion.native import native_state_dict_views
    from kimi_hybrid import KimiHybridForCausalLM

    ours_cfg, native_cfg = build_configs(args)
    torch.manual_seed(0)
    with torch.device(device):
        native = KimiLinearForCausalLM._from_config(native_cfg, dtype=dtype)
    with torch.device("meta"):
        ours = KimiHybridForCausalLM(ours_cfg)
    sd = native_state_dict_views(native.state_dict())
    res = ours.load_state_dict(sd, strict=False, assign=True)
    if res.missing_keys or res.unexpected_keys:
        raise RuntimeError(f"weight mapping: missing {res.missing_keys[:5]}, unexpected {res.unexpected_keys[:5]}")
    with torch.no_grad():
        for mod in ours.modules():  # the fp32-always parameters (a copy: small)
            for name in ("A_log", "dt_bias", "e_score_correction_bias"):
                p = getattr(mod, name, None)
                if isinstance(p, torch.nn.Parameter) and p.dtype != torch.float32:
                    setattr(mod, name, torch.nn.Parameter(p.detach().float(), requires_grad=False))
    for p in ours.parameters():
        p.requires_grad_(False)
    return ours.eval(), native.eval(), ours_cfg


def parity(ours, native, ids):
    with torch.no_grad():
        a = ours(input_ids=ids, use_cache=False).logits.float()
        b = native(input_ids=ids, use_cache=False).logits.float()
    return {"max_abs_logit_diff": (a - b).abs().max().item(), "logit_scale": b.abs().max().item(),
            "argmax_agreement": (a.argmax(-1) == b.argmax(-1)).float().mean().item()}


def bench_one(name, model, cfg, args, device, deadline, progress=lambda d: None):
    from peft import get_peft_model

    from kimi_hybrid.app.lora import enable_gradient_checkpointing, recommended_lora_config

    lc = recommended_lora_config(cfg, r=args.rank, alpha=2 * args.rank, include_experts=not args.no_experts)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    if device.type == "cuda":
        sync()
        torch.cuda.reset_peak_memory_stats()
        weights = torch.cuda.memory_allocated() / 2**30
    else:
        weights = None
    pm = get_peft_model(model, lc)
    enable_gradient_checkpointing(pm)
    pm.train()
    trainable = [p for p in pm.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-4)
    g = torch.Generator(device="cpu").manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq_len), generator=g).to(device)

    def step():
        loss = pm(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    out = {"trainable_params": sum(p.numel() for p in trainable), "weights_GiB": weights,
           "status": "first step (a fresh machine autotunes FLA's Triton kernels here)"}
    progress(out)
    print(f"[{name}] first step: on a fresh machine FLA's Triton kernels autotune here, forward and backward "
          "(minutes without restored results; docs/lora.md 'Training speed')", flush=True)
    t0 = time.perf_counter()
    out["first_loss"] = step()
    sync()
    out["first_step_s"] = round(time.perf_counter() - t0, 3)
    for _ in range(args.warmup - 1):
        step()
    sync()
    out["warmup_s"] = round(time.perf_counter() - t0, 3)
    out["status"] = "timing"
    progress(out)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(args.steps):
        if time.perf_counter() > deadline:
            out["note"] = "stopped early: time budget"
            break
        t = time.perf_counter()
        out["last_loss"] = step()
        sync()
        times.append(time.perf_counter() - t)
    if times:
        med = statistics.median(times)
        out.update(step_s=[round(x, 4) for x in times], median_step_s=round(med, 4),
                   tokens_per_s=round(args.batch * args.seq_len / med, 1))
    if device.type == "cuda":
        out["peak_GiB"] = round(torch.cuda.max_memory_allocated() / 2**30, 3)
    out["status"] = "done"
    pm.unload()  # remove the LoRA wrappers, keep the (shared) base weights
    pm = opt = trainable = None  # (rebound, not deleted: the step closure refers to them) free before the next model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def summary(result):
    """The headline numbers, ``{ours, native}`` each: ``lora_train_tok_s`` (tokens / median step), ``lora_train_peak_gib``
    (peak allocated over the timed steps, weights included), ``lora_first_step_s`` (the first step, autotuning
    included on a cold machine), ``lora_step_s`` (median timed step)."""
    fields = {"lora_train_tok_s": "tokens_per_s", "lora_train_peak_gib": "peak_GiB",
              "lora_first_step_s": "first_step_s", "lora_step_s": "median_step_s"}
    runs = {m: result[m] for m in ("ours", "native") if isinstance(result.get(m), dict)}
    out = {k: {m: r.get(v) for m, r in runs.items()} for k, v in fields.items()}
    out["layer_plan"] = result["setup"]["layer_plan"]
    return out


def environment(device):
    import transformers

    info = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
            "machine": platform.node(), "device": str(device)}
    for mod in ("peft", "accelerate", "fla", "triton"):
        try:
            info[mod] = __import__(mod).__version__
        except Exception as e:  # noqa: BLE001
            info[mod] = f"unavailable ({type(e).__name__})"
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(0)
    try:
        from kimi_hybrid.kda_kimi_hybrid import fla_available

        info["kimi_hybrid_uses_fla"] = bool(fla_available()) and device.type == "cuda"
    except Exception:  # noqa: BLE001
        pass
    try:
        from transformers.utils.import_utils import is_flash_linear_attention_available

        info["native_uses_fla"] = bool(is_flash_linear_attention_available()) and device.type == "cuda"
    except Exception:  # noqa: BLE001
        pass
    commit = os.environ.get("KIMI_HYBRID_COMMIT")
    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                    timeout=10).stdout.strip() or None
        except Exception:  # noqa: BLE001
            commit = None
    info["commit"] = commit
    return info


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=27, help="depth (default 27: the released model)")
    ap.add_argument("--plan", choices=("released", "slice"), default=None,
                    help="released: Kimi-Linear-48B-A3B's 27-layer plan (MLA at 3, 7, ..., 23, 26, dense layer 0; "
                         "the default at 27 layers); slice: layers-1 KDA + 1 MLA, all MoE (the default otherwise)")
    ap.add_argument("--tiny", action="store_true", help="small built-in widths (CPU smoke run)")
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--steps", type=int, default=3, help="timed steps")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps (Triton autotuning happens here)")
    ap.add_argument("--no-experts", action="store_true", help="do not adapt the routed experts")
    ap.add_argument("--models", default="ours,native", help="comma list, run in this order")
    ap.add_argument("--budget-s", type=float, default=1e9, help="stop timing once this many seconds have passed")
    ap.add_argument("--config", default=None,
                    help="a .json file of KimiHybridConfig arguments whose widths replace the 48B ones (a small "
                         "config: CPU smoke test)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="bfloat16 (default on CUDA) or float32 (default on CPU)")
    ap.add_argument("--out", default=None, help="write the JSON here (also after each model)")
    ap.add_argument("--one-config-autotune", action="store_true",
                    help="Triton autotuning limited to one config per kernel (kernels/testing.py): a cold start in "
                         "seconds instead of minutes; both models run the same untuned FLA kernels")
    args = ap.parse_args(argv)
    if args.plan is None:
        args.plan = "released" if args.layers == 27 else "slice"
    if args.one_config_autotune:
        from kimi_hybrid.kernels.testing import limit_triton_autotuning

        limit_triton_autotuning()
    start = time.perf_counter()
    deadline = start + args.budget_s
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)

    result = {"benchmark": "lora_training", "env": environment(device),
              "setup": {"layers": args.layers, "layer_plan": plan_text(args),
                        "widths": "tiny" if args.tiny else args.config or "Kimi-Linear-48B-A3B", "batch": args.batch,
                        "seq_len": args.seq_len, "dtype": str(dtype).replace("torch.", ""), "lora_rank": args.rank,
                        "lora_alpha": 2 * args.rank, "experts_adapted": not args.no_experts,
                        "gradient_checkpointing": "non-reentrant, every decoder layer", "optimizer": "AdamW",
                        "warmup_steps": args.warmup, "timed_steps": args.steps,
                        "triton_autotuning": "one config per kernel" if args.one_config_autotune else "full"}}

    def dump():
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(result, indent=1) + "\n")

    t = time.perf_counter()
    ours, native, cfg = build_models(args, device, dtype)
    result["setup"]["build_s"] = round(time.perf_counter() - t, 2)
    result["setup"]["params_B"] = round(sum(p.numel() for p in native.parameters()) / 1e9, 3)
    result["setup"]["native_experts_implementation"] = getattr(native.config, "_experts_implementation", None)
    ids = torch.randint(0, cfg.vocab_size, (1, min(args.seq_len, 256)), generator=torch.Generator().manual_seed(2))
    result["parity"] = parity(ours, native, ids.to(device))
    dump()
    print(json.dumps(result["parity"]), flush=True)
    models = {"ours": ours, "native": native}
    for name in [m.strip() for m in args.models.split(",") if m.strip()]:
        if time.perf_counter() > deadline:
            result[name] = {"skipped": "time budget"}
            continue
        try:
            def progress(d, name=name):
                result[name] = d
                dump()

            result[name] = bench_one(name, models[name], cfg, args, device, deadline, progress)
        except Exception as e:  # noqa: BLE001  (keep the other model's numbers)
            result[name] = {"error": f"{type(e).__name__}: {str(e)[:800]}"}
        print(name, json.dumps(result[name]), flush=True)
        dump()
    result["total_s"] = round(time.perf_counter() - start, 1)
    result["summary"] = summary(result)
    if "tokens_per_s" in result.get("ours", {}) and "tokens_per_s" in result.get("native", {}):
        result["speedup_ours_over_native"] = round(result["ours"]["tokens_per_s"] / result["native"]["tokens_per_s"],
                                                   3)
    dump()
    return result


if __name__ == "__main__":
    main()
