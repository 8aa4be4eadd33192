#!/usr/bin/env python
"""Train the embedded default model: a small KimiHybrid (3:1 KDA:MLA, MoE) on the CPython stdlib sources.

The data are the uint16 id arrays written by ``examples/tokenize_corpus.py`` (``train_ids.npy`` /
``heldout_ids.npy``: files joined with [EOS], held-out split by module, see ``models/kimi-hybrid-stdlib/
corpus_manifest.json``). Training samples random windows of ``context + 1`` ids from the train array (seeded
``torch.Generator``); the held-out loss is the mean next-token cross-entropy over every non-overlapping window of
``context`` ids of the held-out array (each window predicts its ids 1..context-1 from the ids before them).

Model (``stdlib_config``): hidden 256, 8 layers ``[KDA, KDA, KDA, MLA] x 2``, KDA 4 heads x 64, NoPE MLA 4 heads
(nope 64, rope 32, v 64, kv_lora_rank 128), layer 0 a dense SiLU-GLU MLP (1024), layers 1-7 MoE with 8 routed
experts (128 wide) top-2 + 1 shared expert, sigmoid router with the auxiliary-loss-free balancing bias of
DeepSeek-V3 / Kimi (``e_score_correction_bias`` nudged towards equal load after every step), vocab 8448 =
8192 BPE ranks + 256 Kimi specials.

Optimisation: AdamW (betas 0.9/0.95, weight decay 0.1 on matrices only), linear warm-up then cosine decay to
``min_lr``, gradient clipping 1.0, fp32 master weights with bf16 autocast on CUDA (fp32 on CPU).

``--steps 0`` (default) sizes the run to ``--time-budget`` seconds, not counting the first two steps (their
start-up cost on a fresh GPU machine was minutes once): warm-up steps 3..``--calib-steps`` are timed and the total is
fixed from them. The warm-up does not depend on the total, so the run equals ``--steps N`` with the N it logs.

``--out`` becomes the shipped model folder (the layout of ``models/kimi-hybrid-stdlib``): config.json,
generation_config.json, bf16 safetensors (``A_log``, ``dt_bias`` and the router bias stay fp32), the tokenizer files
and ``tokenization_kimi_hybrid.py``, ``train_metrics.json``, ``samples.txt`` and a model card README.md written
from the metrics.

Usage (GPU, a few minutes):
  python examples/train_default_model.py --data data --out models/kimi-hybrid-stdlib --time-budget 180
CPU smoke test:
  python examples/train_default_model.py --steps 3 --context 128 --batch-size 2 --device cpu --out /tmp/m
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from kimi_hybrid import KimiHybridConfig, KimiHybridForCausalLM
from kimi_hybrid.modeling_kimi_hybrid import KimiRouter
from kimi_hybrid.tokenization_kimi_hybrid import KimiHybridTokenizer

ROOT = Path(__file__).resolve().parents[1]

KDA, MLA = "linear_attention", "full_attention"
FP32_PARAMS = ("A_log", "dt_bias", "e_score_correction_bias")
DEFAULT_PROMPTS = [
    "import os\nimport sys\n\n\ndef main(",
    "def fibonacci(n):\n",
    "class Stack:\n    \"\"\"A simple stack.\"\"\"\n\n    def __init__(self):\n",
    "# Read a JSON file and print its keys\nimport json\n\n",
]


# ---------------------------------------------------------------------------------------------------------------
# model
# ---------------------------------------------------------------------------------------------------------------

def stdlib_config(tokenizer: KimiHybridTokenizer, layer_types: Optional[List[str]] = None,
                  **overrides: Any) -> KimiHybridConfig:
    """The shipped model's config (see module doc); ``layer_types`` / ``overrides`` for the ablation."""
    layer_types = layer_types or [KDA, KDA, KDA, MLA] * 2
    n = len(layer_types)
    kw: Dict[str, Any] = dict(
        vocab_size=len(tokenizer), hidden_size=256, intermediate_size=1024, num_hidden_layers=n,
        num_attention_heads=4, num_key_value_heads=4, head_dim=64, hidden_act="silu", rms_norm_eps=1e-5,
        max_position_embeddings=8192, tie_word_embeddings=False, initializer_range=0.02,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        q_lora_rank=None, kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64,
        mla_use_nope=True, num_experts=8, num_experts_per_token=2, moe_intermediate_size=128,
        num_shared_experts=1, first_k_dense_replace=1, moe_layer_freq=1, routed_scaling_factor=1.0,
        moe_router_activation_func="sigmoid", use_grouped_topk=True, num_expert_group=1, topk_group=1,
        moe_renormalize=True, layer_types=list(layer_types), mlp_layer_types=["dense"] + ["sparse"] * (n - 1),
        linear_attn_config={"head_dim": 64, "num_heads": 4, "short_conv_kernel_size": 4},
    )
    kw.update(overrides)
    cfg = KimiHybridConfig(**kw)
    if cfg.vocab_size != len(tokenizer):
        raise ValueError(f"vocab_size {cfg.vocab_size} != len(tokenizer) {len(tokenizer)}")
    return cfg


def count_params(model: torch.nn.Module) -> Dict[str, int]:
    """Total parameters, and the ones a token touches (routed experts counted top-k / E)."""
    total = sum(p.numel() for p in model.parameters())
    cfg = model.config
    routed = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    active = total - routed + int(routed * cfg.num_experts_per_token / max(cfg.num_experts or 1, 1))
    embed = model.model.embed_tokens.weight.numel() + model.lm_head.weight.numel()
    return {"total": total, "active_per_token": active, "embeddings_and_head": embed, "routed_experts": routed}


# ---------------------------------------------------------------------------------------------------------------
# data
# ---------------------------------------------------------------------------------------------------------------

def load_ids(path: Path) -> torch.Tensor:
    """1-D uint16 ``.npy`` -> int64 tensor (CPU)."""
    arr = np.load(path)
    if arr.ndim != 1:
        raise ValueError(f"{path}: expected a 1-D id array, got shape {arr.shape}")
    return torch.from_numpy(arr.astype(np.int64))


def sample_batch(ids: torch.Tensor, context: int, batch_size: int, gen: torch.Generator) -> torch.Tensor:
    """``[batch, context + 1]`` random windows (uniform start offsets from ``gen``)."""
    starts = torch.randint(0, ids.numel() - context - 1, (batch_size,), generator=gen)
    return torch.stack([ids[s:s + context + 1] for s in starts.tolist()])


def eval_windows(ids: torch.Tensor, context: int, max_windows: Optional[int] = None) -> torch.Tensor:
    """Non-overlapping ``[N, context]`` windows covering the array (the tail shorter than a window is dropped)."""
    n = ids.numel() // context
    if max_windows is not None:
        n = min(n, max_windows)
    return ids[: n * context].view(n, context)


@torch.no_grad()
def evaluate(model, ids: torch.Tensor, context: int, batch_size: int, device: torch.device,
             amp_dtype: Optional[torch.dtype], max_windows: Optional[int] = None) -> Dict[str, float]:
    """Mean next-token loss (nats) and perplexity over non-overlapping windows of ``context`` ids."""
    was_training = model.training
    model.eval()
    windows = eval_windows(ids, context, max_windows)
    total, count = 0.0, 0
    for i in range(0, windows.shape[0], batch_size):
        x = windows[i:i + batch_size].to(device)
        with _autocast(device, amp_dtype):
            logits = model(input_ids=x, use_cache=False).logits
        loss = F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1),
                               reduction="sum")
        total += float(loss)
        count += x[:, 1:].numel()
    model.train(was_training)
    mean = total / max(count, 1)
    return {"loss": mean, "ppl": math.exp(mean), "tokens": count, "context": context}


def _autocast(device: torch.device, amp_dtype: Optional[torch.dtype]):
    if amp_dtype is None:
        return torch.autocast(device_type=device.type, enabled=False)
    return torch.autocast(device_type=device.type, dtype=amp_dtype)


# ---------------------------------------------------------------------------------------------------------------
# MoE load balancing without an auxiliary loss (DeepSeek-V3 section 2.1.2, used by Kimi)
# ---------------------------------------------------------------------------------------------------------------

class BiasBalancer:
    """Counts the experts each router picks during a step; ``update()`` moves ``e_score_correction_bias`` by
    ``rate * sign(mean_load - load)`` (the bias only changes which experts are chosen, never the weights)."""

    def __init__(self, model: torch.nn.Module, rate: float = 1e-3):
        self.rate = rate
        self.routers = [m for m in model.modules() if isinstance(m, KimiRouter)]
        self.counts = [None] * len(self.routers)
        self.handles = [r.register_forward_hook(self._hook(i)) for i, r in enumerate(self.routers)]

    def _hook(self, i: int) -> Callable:
        def hook(module, inputs, output):
            if not module.training:
                return
            idx = output[2].detach()
            c = torch.bincount(idx.reshape(-1), minlength=module.num_experts).float()
            self.counts[i] = c if self.counts[i] is None else self.counts[i] + c
        return hook

    @torch.no_grad()
    def update(self) -> float:
        """Apply the nudge; returns the mean max/mean load ratio over routers (1.0 = perfectly balanced)."""
        ratios = []
        for i, router in enumerate(self.routers):
            c = self.counts[i]
            if c is None:
                continue
            mean = c.mean()
            router.e_score_correction_bias.add_(self.rate * torch.sign(mean - c))
            ratios.append(float(c.max() / mean.clamp_min(1.0)))
            self.counts[i] = None
        return sum(ratios) / len(ratios) if ratios else 1.0

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


# ---------------------------------------------------------------------------------------------------------------
# training
# ---------------------------------------------------------------------------------------------------------------

def lr_at(step: int, total: int, peak: float, warmup: int, min_ratio: float) -> float:
    """Linear warm-up over ``warmup`` steps, then cosine from ``peak`` to ``peak * min_ratio`` at ``total``."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def make_optimizer(model: torch.nn.Module, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.dim() >= 2 and "norm" not in name else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    fused = next(model.parameters()).is_cuda
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8, fused=fused)


def train(model, train_ids: torch.Tensor, *, context: int, batch_size: int, steps: int, time_budget: float,
          lr: float, warmup: int, min_lr_ratio: float, weight_decay: float, seed: int, device: torch.device,
          amp_dtype: Optional[torch.dtype], log: Callable[[str], None], max_steps: int = 100000,
          calib_steps: int = 12, log_every: int = 25, desc: str = "train") -> Dict[str, Any]:
    """Train in place. ``steps > 0``: exactly that many; ``steps == 0``: time warm-up steps 3..``calib_steps`` and
    fix the total so that the steps after the first two take about ``time_budget`` seconds (capped at
    ``max_steps``).
    Returns a summary (steps, tokens, seconds, loss curve)."""
    if steps == 0 and calib_steps >= warmup:
        raise ValueError(f"calib_steps={calib_steps} must be < warmup={warmup} (the total is fixed during warm-up)")
    gen = torch.Generator().manual_seed(seed)
    opt = make_optimizer(model, lr, weight_decay)
    balancer = BiasBalancer(model) if any(isinstance(m, KimiRouter) for m in model.modules()) else None
    model.train()
    total = steps if steps > 0 else max_steps
    curve: List[Dict[str, float]] = []
    t0 = time.perf_counter()
    t_calib = None
    bar = tqdm(total=total, desc=desc, dynamic_ncols=True, mininterval=2.0, file=sys.stdout)
    step = 0
    ema = None
    while step < total:
        for g in opt.param_groups:
            g["lr"] = lr_at(step, total, lr, warmup, min_lr_ratio)
        batch = sample_batch(train_ids, context, batch_size, gen).to(device, non_blocking=True)
        with _autocast(device, amp_dtype):
            out = model(input_ids=batch[:, :-1], use_cache=False)
        loss = F.cross_entropy(out.logits.float().reshape(-1, out.logits.shape[-1]), batch[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        balance = balancer.update() if balancer is not None else 1.0
        step += 1
        if steps == 0 and step == 2:
            if device.type == "cuda":
                torch.cuda.synchronize()
            t_calib = time.perf_counter()
        if steps == 0 and step == calib_steps:
            if device.type == "cuda":
                torch.cuda.synchronize()
            spent = time.perf_counter() - t_calib
            per_step = spent / (calib_steps - 2)
            # the budget starts after the first two steps: their one-off start-up cost (CUDA context, library
            # loading, which took minutes on a fresh machine) does not shorten the training
            total = int(max(calib_steps + 1, min(max_steps, (time_budget - spent) / per_step + calib_steps)))
            total = max(total, warmup + 1)
            bar.total = total
            bar.refresh()
            log(f"[{desc}] {per_step * 1000:.0f} ms/step -> {total} steps in a {time_budget:.0f} s budget "
                f"(reproduce with --steps {total})")
        if step % log_every == 0 or step == total or step == 1:
            lv = float(loss.detach())
            ema = lv if ema is None else 0.9 * ema + 0.1 * lv
            rec = {"step": step, "loss": round(lv, 4), "lr": opt.param_groups[0]["lr"],
                   "grad_norm": round(float(gnorm), 3), "max_over_mean_expert_load": round(balance, 3),
                   "seconds": round(time.perf_counter() - t0, 1)}
            curve.append(rec)
            bar.set_postfix(loss=f"{lv:.3f}", lr=f"{rec['lr']:.2e}")
            log(json.dumps(rec))
        bar.update(1)
    bar.close()
    if balancer is not None:
        balancer.remove()
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    return {"steps": step, "tokens": step * batch_size * context, "seconds": round(seconds, 1),
            "tokens_per_second": round(step * batch_size * context / seconds), "curve": curve}


def cast_for_shipping(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Cast every parameter to ``dtype`` except the ones the architecture keeps in fp32."""
    for name, p in model.named_parameters():
        if not any(k in name for k in FP32_PARAMS):
            p.data = p.data.to(dtype)
    model.config.dtype = str(dtype).replace("torch.", "")


@torch.no_grad()
def write_samples(model, tokenizer, prompts: Iterable[str], device: torch.device, seed: int,
                  max_new_tokens: int = 160) -> List[Dict[str, str]]:
    model.eval()
    out = []
    for i, prompt in enumerate(prompts):
        torch.manual_seed(seed + i)
        ids = tokenizer(prompt, return_tensors="pt").input_ids.to(device)
        gen = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=True, temperature=0.8, top_p=0.95,
                             top_k=50, pad_token_id=tokenizer.pad_token_id)
        out.append({"prompt": prompt, "completion": tokenizer.decode(gen[0, ids.shape[1]:])})
        greedy = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False,
                                pad_token_id=tokenizer.pad_token_id)
        out[-1]["greedy"] = tokenizer.decode(greedy[0, ids.shape[1]:])
    return out


TOKENIZER_FILES = ("tiktoken.model", "tokenizer_config.json", "special_tokens_map.json")


def save_model_folder(model, tokenizer, out_dir: Path, max_shard_size: str = "2GB",
                      copy_tokenizer: bool = True) -> None:
    """Write the shipped layout: config.json (without the model ``auto_map``: the bundle code is not in this
    folder, the installed package provides it; ``kimi_hybrid.app.hub`` makes self-contained Hub folders),
    generation_config.json, safetensors weights, and the tokenizer files + ``tokenization_kimi_hybrid.py`` (so
    ``AutoTokenizer.from_pretrained(folder, trust_remote_code=True)`` works)."""
    import shutil

    out_dir.mkdir(parents=True, exist_ok=True)
    for old in list(out_dir.glob("model*.safetensors")) + list(out_dir.glob("model.safetensors.index.json")):
        old.unlink()
    model.save_pretrained(out_dir, max_shard_size=max_shard_size)
    for f in out_dir.glob("*_kimi_hybrid.py"):  # copied by save_pretrained for auto_map; not shipped here
        f.unlink()
    cfg_path = out_dir / "config.json"
    cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    cfg.pop("auto_map", None)
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    if copy_tokenizer:
        src = Path(tokenizer.vocab_file).resolve().parent
        for name in TOKENIZER_FILES:
            if (src / name).is_file() and (src / name).resolve() != (out_dir / name).resolve():
                shutil.copyfile(src / name, out_dir / name)
        tok_py = ROOT / "modeling_kimi_hybrid" / "tokenization_kimi_hybrid.py"
        shutil.copyfile(tok_py, out_dir / tok_py.name)


def model_card(config, metrics: Dict[str, Any], samples: List[Dict[str, str]]) -> str:
    """The model card of the embedded model, written from the training metrics."""
    p, h, tr = metrics["params"], metrics["heldout"], metrics["train"]
    kinds = ["KDA" if t == KDA else "MLA" for t in config.layer_types]
    meta = metrics.get("data_meta", {}).get("splits", {})
    n_train, n_held = meta.get("train", {}), meta.get("heldout", {})
    lines = [
        "---", "library_name: transformers", "license: mit", "pipeline_tag: text-generation",
        "tags:", "- kimi-hybrid", "- kda", "- mla", "- moe", "- code", "---", "",
        "# kimi-hybrid-stdlib", "",
        "The embedded default model of kimi-hybrid: a small KimiHybrid (Kimi Linear architecture: Kimi Delta "
        "Attention + NoPE MLA + MoE) trained from scratch on the CPython standard library sources. It completes "
        "Python-like code; it is a demonstration of the architecture and the tooling, not an assistant.", "",
        "## Architecture", "",
        "| | |", "|---|---|",
        f"| parameters | {p['total']:,} total, {p['active_per_token']:,} active per token "
        f"({p['embeddings_and_head']:,} in the embedding + LM head) |",
        f"| layers | {config.num_hidden_layers}: `{' '.join(kinds)}` (3:1 KDA:MLA) |",
        f"| hidden size | {config.hidden_size} |",
        f"| KDA | {config.linear_num_heads} heads x {config.linear_head_dim}, short conv "
        f"{config.linear_conv_kernel_size}, fp32 state {config.linear_head_dim}x{config.linear_head_dim} per head |",
        f"| MLA (NoPE) | {config.num_attention_heads} heads, nope {config.qk_nope_head_dim} / rope "
        f"{config.qk_rope_head_dim} / v {config.v_head_dim}, kv_lora_rank {config.kv_lora_rank} |",
        f"| MLP | layer 0 dense SiLU-GLU ({config.intermediate_size}); layers 1-{config.num_hidden_layers - 1} MoE: "
        f"{config.num_experts} routed experts ({config.moe_intermediate_size} wide) top-"
        f"{config.num_experts_per_token} + {config.num_shared_experts} shared, sigmoid router with the "
        f"auxiliary-loss-free balancing bias |",
        f"| vocabulary | {config.vocab_size} = 8192 byte-level BPE ranks + 256 Kimi special tokens "
        f"(`tiktoken.model`, Kimi chat template) |",
        f"| weights | {metrics['save_dtype']} safetensors (`A_log`, `dt_bias`, router bias in fp32) |", "",
        "## Data", "",
        "The `.py` files of the CPython "
        f"{metrics.get('data_meta', {}).get('python_version', '3.11')} standard library (no test suites), split "
        "into train and held-out **by module** (see `corpus_manifest.json`): "
        f"{n_train.get('num_files', '?')} train files ({n_train.get('num_text_tokens', 0):,} tokens), "
        f"{n_held.get('num_files', '?')} held-out files ({n_held.get('num_text_tokens', 0):,} tokens, modules "
        "colorsys, contextlib, inspect, logging, multiprocessing, plistlib, sysconfig, tarfile, tokenize). Files "
        "are joined with [EOS]. Licence of the data: Python Software Foundation License (PSF-2.0).", "",
        "## Training", "",
        f"`{metrics.get('command', 'python examples/train_default_model.py')}` on {metrics['device']} "
        f"(torch {metrics['torch']}): seed {metrics['seed']}, context {metrics['context']}, batch "
        f"{metrics['batch_size']}, {tr['steps']} steps ({tr['tokens']:,} tokens, {tr['seconds']} s), AdamW "
        f"(lr {metrics['lr']}, betas 0.9/0.95, weight decay {metrics['weight_decay']}), {metrics['warmup']} warm-up "
        f"steps then cosine to {metrics['min_lr_ratio']} x lr, bf16 autocast on CUDA, gradient clipping 1.0.", "",
        "## Evaluation", "",
        f"Held-out next-token loss over every non-overlapping window of {h['context']} tokens "
        f"({h['tokens']:,} predicted tokens), with the shipped {metrics['save_dtype']} weights:", "",
        "| split | loss (nats/token) | perplexity | bits per byte |", "|---|---|---|---|",
        f"| held-out | {h['loss']:.4f} | {h['ppl']:.2f} | "
        f"{h.get('bits_per_byte', float('nan')):.4f} ({h.get('bytes_per_token', '?')} bytes/token) |",
        f"| train (same number of windows) | {metrics['train_eval']['loss']:.4f} | "
        f"{metrics['train_eval']['ppl']:.2f} | |", "",
        "## Usage", "",
        "```bash", "kimi-hybrid generate --prompt 'def fibonacci(n):' --max-new-tokens 128", "```", "",
        "```python", "import kimi_hybrid  # registers the classes (or use `kimi-hybrid export` for a "
        "trust_remote_code folder)", "from transformers import AutoModelForCausalLM, AutoTokenizer", "",
        'tok = AutoTokenizer.from_pretrained("models/kimi-hybrid-stdlib", trust_remote_code=True)',
        'model = AutoModelForCausalLM.from_pretrained("models/kimi-hybrid-stdlib")', "```", "",
    ]
    if samples:
        lines += ["## Samples (seeded, temperature 0.8, top-p 0.95, top-k 50)", ""]
        for s in samples[:2]:
            lines += ["```python", s["prompt"] + s["completion"], "```", ""]
    lines += ["Files: `train_metrics.json` (the full training record and loss curve)"
              + (", `samples.txt`." if samples else ".")]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", default=str(ROOT / "data"), help="folder with train_ids.npy, heldout_ids.npy")
    p.add_argument("--tokenizer", default=str(ROOT / "models" / "kimi-hybrid-stdlib"))
    p.add_argument("--out", default=str(ROOT / "out" / "kimi-hybrid-stdlib"),
                   help="the model folder to write (the layout of models/kimi-hybrid-stdlib)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--steps", type=int, default=0, help="0 = fit the run to --time-budget")
    p.add_argument("--time-budget", type=float, default=180.0, help="seconds of training when --steps 0")
    p.add_argument("--max-steps", type=int, default=4000)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--save-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--eval-batch-size", type=int, default=16)
    p.add_argument("--eval-max-windows", type=int, default=None, help="cap on held-out windows (smoke tests)")
    p.add_argument("--samples-max-new-tokens", type=int, default=160, help="0 = write no samples")
    p.add_argument("--calib-steps", type=int, default=12)
    p.add_argument("--train-eval-windows", type=int, default=0,
                   help="windows of the train split to evaluate (0 = as many as the held-out split has)")
    p.add_argument("--no-cudnn", action="store_true",
                   help="run the depthwise short convs without cuDNN (its first call on a fresh machine can be slow)")
    p.add_argument("--max-shard-size", default="2GB", help="save_pretrained shard size (e.g. 15MB)")
    p.add_argument("--no-tokenizer-files", action="store_true",
                   help="do not copy the tokenizer files (and tokenization_kimi_hybrid.py) into --out")
    args = p.parse_args(argv)

    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    amp = torch.bfloat16 if device.type == "cuda" else None
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        if args.no_cudnn:
            torch.backends.cudnn.enabled = False
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    log_path = out_dir / "train_log.txt"
    log_f = open(log_path, "w", encoding="utf-8")

    def log(msg: str) -> None:
        tqdm.write(msg, file=sys.stdout)
        log_f.write(msg + "\n")
        log_f.flush()

    tokenizer = KimiHybridTokenizer.from_pretrained(args.tokenizer)
    data = Path(args.data)
    train_ids, heldout_ids = load_ids(data / "train_ids.npy"), load_ids(data / "heldout_ids.npy")
    meta = json.loads((data / "tokenized_meta.json").read_text()) if (data / "tokenized_meta.json").exists() else {}
    config = stdlib_config(tokenizer)
    model = KimiHybridForCausalLM(config).to(device)
    params = count_params(model)
    log(f"params: {json.dumps(params)}")
    log(f"data: train {train_ids.numel()} ids, held-out {heldout_ids.numel()} ids; device {device}, "
        f"torch {torch.__version__}")

    summary = train(model, train_ids, context=args.context, batch_size=args.batch_size, steps=args.steps,
                    time_budget=args.time_budget, lr=args.lr, warmup=args.warmup, min_lr_ratio=args.min_lr_ratio,
                    weight_decay=args.weight_decay, seed=args.seed, device=device, amp_dtype=amp, log=log,
                    max_steps=args.max_steps, calib_steps=args.calib_steps)
    save_dtype = getattr(torch, args.save_dtype)
    cast_for_shipping(model, save_dtype)
    ev_amp = amp if save_dtype == torch.float32 else None
    heldout = evaluate(model, heldout_ids, args.context, args.eval_batch_size, device, ev_amp,
                       args.eval_max_windows)
    train_eval = evaluate(model, train_ids, args.context, args.eval_batch_size, device, ev_amp,
                          args.train_eval_windows or args.eval_max_windows
                          or max(1, heldout["tokens"] // (args.context - 1)))
    bpt = meta.get("splits", {}).get("heldout", {}).get("bytes_per_token")
    if bpt:
        heldout["bytes_per_token"] = bpt
        heldout["bits_per_byte"] = heldout["loss"] / math.log(2) / bpt
    log(f"held-out: {json.dumps(heldout)}")
    log(f"train (same number of windows): {json.dumps(train_eval)}")

    from transformers import GenerationConfig

    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, do_sample=True, temperature=0.8, top_p=0.95, top_k=50,
        max_new_tokens=256)
    save_model_folder(model, tokenizer, out_dir, args.max_shard_size, copy_tokenizer=not args.no_tokenizer_files)
    samples = []
    if args.samples_max_new_tokens > 0:
        samples = write_samples(model, tokenizer, DEFAULT_PROMPTS, device, args.seed, args.samples_max_new_tokens)
        with open(out_dir / "samples.txt", "w", encoding="utf-8") as f:
            for s in samples:
                f.write(f"=== prompt ===\n{s['prompt']}\n=== sampled (T=0.8, top-p 0.95, top-k 50) ===\n"
                        f"{s['completion']}\n=== greedy ===\n{s['greedy']}\n\n")
    metrics = {
        "seed": args.seed, "context": args.context, "batch_size": args.batch_size, "lr": args.lr,
        "warmup": args.warmup, "min_lr_ratio": args.min_lr_ratio, "weight_decay": args.weight_decay,
        "save_dtype": args.save_dtype, "params": params, "train": {k: v for k, v in summary.items() if k != "curve"},
        "curve": summary["curve"], "heldout": heldout, "train_eval": train_eval,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "data_meta": meta,
        "command": "python examples/train_default_model.py " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    (out_dir / "train_metrics.json").write_text(json.dumps(metrics, indent=1))
    (out_dir / "README.md").write_text(model_card(model.config, metrics, samples), encoding="utf-8")
    size = sum(f.stat().st_size for f in out_dir.iterdir() if f.is_file() and f.name != "train_log.txt")
    log(f"saved {out_dir} ({size / 1e6:.1f} MB)")
    log_f.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
