#!/usr/bin/env python
"""Train the embedded default model: a small KimiHybrid (3:1 KDA:MLA, MoE) on permissively licensed Python code.

The data are the uint16 id arrays written by ``examples/tokenize_corpus.py`` from the manifest of
``examples/build_python_corpus.py`` (``train_ids.npy``, ``heldout_packages_ids.npy``, ``heldout_stdlib_ids.npy``:
files joined with [EOS]; the held-out splits are whole packages / whole stdlib modules). Training samples random
windows of ``context + 1`` ids from the train array (seeded ``torch.Generator``). Held-out figures are the mean
next-token cross-entropy over every non-overlapping window of ``context`` ids (each window predicts its ids
1..context-1 from the ids before them), and bits per byte = summed loss / ln 2 / the UTF-8 bytes of the predicted
tokens (each token's own byte length; [EOS] counts 0 bytes).

Model (``default_config``): hidden 384, 8 layers ``[KDA, KDA, KDA, MLA] x 2``, KDA 6 heads x 64, NoPE MLA 6 heads
(nope 64, rope 32, v 64, kv_lora_rank 192), layer 0 a dense SiLU-GLU MLP (1536), layers 1-7 MoE with 8 routed
experts (192 wide) top-2 + 1 shared expert, sigmoid router with the auxiliary-loss-free balancing bias of
DeepSeek-V3 / Kimi (``e_score_correction_bias`` nudged towards equal load after every step), vocab 8448 =
8192 BPE ranks + 256 Kimi specials: 27.6 M parameters, 55 MB in bf16. ``stdlib_config`` is a smaller shape
(hidden 256), the one ``examples/ablation_ratio.py`` uses.

Optimisation: AdamW (betas 0.9/0.95, weight decay 0.1 on matrices only), linear warm-up then cosine decay to
``min_lr``, gradient clipping 1.0, fp32 master weights with bf16 autocast on CUDA (fp32 on CPU).

``--steps 0`` (default) sizes the run to ``--time-budget`` seconds, not counting the first two steps (on a fresh GPU
machine their start-up cost, kernel compilation and autotuning, can take minutes): warm-up steps 3..``--calib-steps`` are timed and the total is
fixed from them. ``--deadline`` (a Unix time) caps that budget so that training ends by then, whatever the start-up
cost was. The warm-up does not depend on the total, so the run equals ``--steps N`` with the N it logs.

``--out`` becomes the shipped model folder (the layout of ``models/kimi-hybrid-stdlib``): config.json,
generation_config.json, bf16 safetensors in shards of ``--max-shard-size`` (``A_log``, ``dt_bias`` and the router
bias stay fp32), the tokenizer files, the corpus manifest, ``train_metrics.json``, ``samples.txt`` and a model card
README.md written from the metrics. The weights and metrics are written before the samples, and a training run
that fails part-way still saves what it has (the error is recorded in the metrics).

Usage (GPU, a few minutes):
  python examples/train_default_model.py --data data --out models/kimi-hybrid-stdlib --time-budget 300
CPU smoke test:
  python examples/train_default_model.py --steps 3 --context 128 --batch-size 2 --device cpu --out /tmp/m \
      --tiny --eval-max-windows 2 --samples-max-new-tokens 8
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from kimi_hybrid import KimiHybridConfig, KimiHybridForCausalLM
from kimi_hybrid.kda_kimi_hybrid import fla_available
from kimi_hybrid.modeling_kimi_hybrid import KimiRouter
from kimi_hybrid.tokenization_kimi_hybrid import KimiHybridTokenizer

ROOT = Path(__file__).resolve().parents[1]
KDA, MLA = "linear_attention", "full_attention"
FP32_PARAMS = ("A_log", "dt_bias", "e_score_correction_bias")
DEFAULT_PROMPTS = [
    "def read_config(path):\n",
    "import os\nimport sys\n\n\ndef main(",
    "def fibonacci(n):\n",
    "class Stack:\n    \"\"\"A simple stack.\"\"\"\n\n    def __init__(self):\n",
    "# Read a JSON file and print its keys\nimport json\n\n",
    "import numpy as np\n\n\ndef normalize(x):\n",
    "class LRUCache:\n    def __init__(self, capacity):\n",
    "import argparse\n\n\ndef parse_args():\n",
]
# decoding settings whose repetition is measured (greedy; the CLI's defaults are chosen from these figures)
DECODING_SETTINGS = {
    "greedy": {},
    "greedy_rp1.3_nr4": {"repetition_penalty": 1.3, "no_repeat_ngram_size": 4},
    "greedy_rp1.3": {"repetition_penalty": 1.3},
}
SPLITS = ("train", "heldout_packages", "heldout_stdlib")


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


DEFAULT_SHAPE: Dict[str, Any] = dict(
    hidden_size=384, intermediate_size=1536, num_attention_heads=6, num_key_value_heads=6, kv_lora_rank=192,
    moe_intermediate_size=192, linear_attn_config={"head_dim": 64, "num_heads": 6, "short_conv_kernel_size": 4},
)
# a few-layer shape for CPU smoke tests of the whole script (--tiny)
TINY_SHAPE: Dict[str, Any] = dict(
    hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=32,
    moe_intermediate_size=32, linear_attn_config={"head_dim": 32, "num_heads": 2, "short_conv_kernel_size": 4},
    head_dim=32, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, num_experts=4,
)


def default_config(tokenizer: KimiHybridTokenizer, tiny: bool = False) -> KimiHybridConfig:
    """The shipped model's config (see module doc): ``stdlib_config`` widened by ``DEFAULT_SHAPE``
    (``tiny=True``: the same layer pattern at toy width, for smoke tests)."""
    return stdlib_config(tokenizer, **(TINY_SHAPE if tiny else DEFAULT_SHAPE))


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
    """Non-overlapping ``[N, context]`` windows covering the array (the tail shorter than a window is dropped);
    with ``max_windows`` below N, that many windows evenly spaced over the array (every package is sampled)."""
    n = ids.numel() // context
    windows = ids[: n * context].view(n, context)
    if max_windows is not None and max_windows < n:
        windows = windows[torch.linspace(0, n - 1, max_windows).round().long()]
    return windows


def token_byte_lengths(tokenizer: KimiHybridTokenizer) -> torch.Tensor:
    """``[len(tokenizer)]`` int64: UTF-8 bytes each id stands for (BPE ranks: their byte string; specials: 0)."""
    enc = tokenizer.tiktoken_encoding
    lengths = torch.zeros(len(tokenizer), dtype=torch.long)
    for i in range(tokenizer.n_ranks):
        lengths[i] = len(enc.decode_single_token_bytes(i))
    return lengths


@torch.no_grad()
def evaluate(model, ids: torch.Tensor, context: int, batch_size: int, device: torch.device,
             amp_dtype: Optional[torch.dtype], max_windows: Optional[int] = None,
             byte_lengths: Optional[torch.Tensor] = None) -> Dict[str, float]:
    """Mean next-token loss (nats) and perplexity over non-overlapping windows of ``context`` ids.

    With ``byte_lengths`` (``token_byte_lengths``) also the UTF-8 bytes of the predicted tokens and
    ``bits_per_byte`` = summed loss / ln 2 / those bytes."""
    was_training = model.training
    model.eval()
    windows = eval_windows(ids, context, max_windows)
    total, count, n_bytes = 0.0, 0, 0
    for i in range(0, windows.shape[0], batch_size):
        x = windows[i:i + batch_size].to(device)
        with _autocast(device, amp_dtype):
            logits = model(input_ids=x, use_cache=False).logits
        loss = F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1),
                               reduction="sum")
        total += float(loss)
        count += x[:, 1:].numel()
        if byte_lengths is not None:
            n_bytes += int(byte_lengths[windows[i:i + batch_size, 1:]].sum())
    model.train(was_training)
    mean = total / max(count, 1)
    out = {"loss": mean, "ppl": math.exp(mean), "tokens": count, "windows": int(windows.shape[0]),
           "context": context}
    if byte_lengths is not None:
        out["bytes"] = n_bytes
        out["bits_per_byte"] = total / math.log(2) / max(n_bytes, 1)
    return out


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
          calib_steps: int = 12, log_every: int = 25, desc: str = "train",
          deadline: Optional[float] = None) -> Dict[str, Any]:
    """Train in place. ``steps > 0``: exactly that many; ``steps == 0``: time warm-up steps 3..``calib_steps`` and
    fix the total so that the steps after the first two take about ``time_budget`` seconds (capped at
    ``max_steps``), or fewer so that training ends by ``deadline`` (Unix time). Past ``deadline`` (plus 15 s)
    training stops whatever the planned total.

    An exception inside a step (or Ctrl-C / SIGINT) ends training (the model keeps the weights of the last finished
    step) and is recorded in the summary under ``error``.
    Returns a summary (steps, tokens, seconds, tokens/s, loss curve)."""
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
    bar = tqdm(total=total, desc=desc, dynamic_ncols=True, mininterval=10.0, file=sys.stdout)
    step = 0
    error = None
    stopped_at_deadline = False
    calib = {}
    while step < total:
        try:
            for g in opt.param_groups:
                g["lr"] = lr_at(step, total, lr, warmup, min_lr_ratio)
            batch = sample_batch(train_ids, context, batch_size, gen).to(device, non_blocking=True)
            with _autocast(device, amp_dtype):
                out = model(input_ids=batch[:, :-1], use_cache=False)
            loss = F.cross_entropy(out.logits.float().reshape(-1, out.logits.shape[-1]), batch[:, 1:].reshape(-1))
            del out
            opt.zero_grad(set_to_none=True)
            loss.backward()
            gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            balance = balancer.update() if balancer is not None else 1.0
        except (Exception, KeyboardInterrupt) as exc:  # keep the last finished step's weights; the caller saves them
            error = f"step {step + 1}: {type(exc).__name__}: {exc}"
            log(f"[{desc}] training stopped by an error at {error}\n{traceback.format_exc()}")
            break
        step += 1
        if steps == 0 and step == 2:
            if device.type == "cuda":
                torch.cuda.synchronize()
            t_calib = time.perf_counter()
            log(f"[{desc}] first two steps (start-up, kernel compilation): {t_calib - t0:.1f} s")
        if steps == 0 and step == calib_steps:
            if device.type == "cuda":
                torch.cuda.synchronize()
            spent = time.perf_counter() - t_calib
            per_step = spent / (calib_steps - 2)
            budget = time_budget
            if deadline is not None:
                budget = min(budget, deadline - time.time() + spent)
            # the budget starts after the first two steps: their one-off start-up cost (CUDA context, library
            # loading, which took minutes on a fresh machine) does not shorten the training
            total = int(max(calib_steps + 1, min(max_steps, (budget - spent) / per_step + calib_steps)))
            total = max(total, warmup + 1)
            bar.total = total
            bar.refresh()
            calib = {"ms_per_step": round(per_step * 1000, 1),
                     "tokens_per_second": round(batch_size * context / per_step), "budget_s": round(budget, 1)}
            log(f"[{desc}] {per_step * 1000:.0f} ms/step = {batch_size * context / per_step:,.0f} tokens/s -> "
                f"{total} steps in a {budget:.0f} s budget (reproduce with --steps {total})")
        if step % log_every == 0 or step == total or step == 1:
            lv = float(loss.detach())
            rec = {"step": step, "loss": round(lv, 4), "lr": opt.param_groups[0]["lr"],
                   "grad_norm": round(float(gnorm), 3), "max_over_mean_expert_load": round(balance, 3),
                   "seconds": round(time.perf_counter() - t0, 1)}
            curve.append(rec)
            bar.set_postfix(loss=f"{lv:.3f}", lr=f"{rec['lr']:.2e}")
            log(json.dumps(rec))
        bar.update(1)
        if deadline is not None and steps == 0 and step < total and time.time() > deadline + 15.0:
            stopped_at_deadline = True
            log(f"[{desc}] past the deadline: stopping at step {step} of {total}")
            break
    bar.close()
    if balancer is not None:
        balancer.remove()
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    summary = {"steps": step, "planned_steps": total, "tokens": step * batch_size * context,
               "seconds": round(seconds, 1), "tokens_per_second": round(step * batch_size * context / seconds),
               "calibration": calib, "curve": curve}
    if t_calib is not None and step > 2:  # the first two steps hold the one-off kernel compilation
        t_end = t0 + seconds
        summary["startup_seconds"] = round(t_calib - t0, 1)
        summary["tokens_per_second_after_startup"] = round((step - 2) * batch_size * context / (t_end - t_calib))
    if stopped_at_deadline:
        summary["stopped_at_deadline"] = True
    if error:
        summary["error"] = error
    return summary


def cast_for_shipping(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Cast every parameter to ``dtype`` except the ones the architecture keeps in fp32."""
    for name, p in model.named_parameters():
        if not any(k in name for k in FP32_PARAMS):
            p.data = p.data.to(dtype)
    model.config.dtype = str(dtype).replace("torch.", "")


def distinct_ngram_ratio(ids: List[int], n: int = 4) -> float:
    """Distinct n-grams / all n-grams of a token sequence (1.0 = no n-gram repeats; nan when shorter than n)."""
    grams = [tuple(ids[i:i + n]) for i in range(len(ids) - n + 1)]
    return len(set(grams)) / len(grams) if grams else float("nan")


@torch.no_grad()
def measure_decoding(model, tokenizer, prompts: Iterable[str], device: torch.device, max_new_tokens: int = 200,
                     settings: Optional[Dict[str, Dict[str, Any]]] = None, deadline: Optional[float] = None,
                     log: Callable[[str], None] = print) -> Dict[str, Any]:
    """Greedy completions of each prompt under each decoding setting, with the distinct-4-gram ratio of the
    generated tokens. Returns ``{setting: {"kwargs", "mean_distinct_4", "min_distinct_4", "completions": [...]}}``;
    settings not reached before ``deadline`` (Unix time) are left out."""
    model.eval()
    settings = DECODING_SETTINGS if settings is None else settings
    result: Dict[str, Any] = {}
    for name, kwargs in settings.items():
        if deadline is not None and time.time() > deadline:
            log(f"decoding: deadline reached, {name} not measured")
            break
        t0 = time.perf_counter()
        rows = []
        for prompt in prompts:
            ids = tokenizer(prompt, return_tensors="pt").input_ids.to(device)
            gen = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id, **kwargs)
            new_ids = gen[0, ids.shape[1]:].tolist()
            rows.append({"prompt": prompt, "completion": tokenizer.decode(new_ids), "new_tokens": len(new_ids),
                         "distinct_4": round(distinct_ngram_ratio(new_ids, 4), 4)})
        ratios = [r["distinct_4"] for r in rows if not math.isnan(r["distinct_4"])]
        result[name] = {"kwargs": kwargs, "max_new_tokens": max_new_tokens,
                        "mean_distinct_4": round(sum(ratios) / len(ratios), 4) if ratios else float("nan"),
                        "min_distinct_4": round(min(ratios), 4) if ratios else float("nan"),
                        "seconds": round(time.perf_counter() - t0, 1), "completions": rows}
        log(f"decoding {name}: mean distinct-4 {result[name]['mean_distinct_4']}, min "
            f"{result[name]['min_distinct_4']} ({result[name]['seconds']} s)")
    return result


@torch.no_grad()
def write_samples(model, tokenizer, prompts: Iterable[str], device: torch.device, seed: int,
                  max_new_tokens: int = 160) -> List[Dict[str, str]]:
    """Seeded sampled completions (temperature 0.8, top-p 0.95, top-k 50) of each prompt."""
    model.eval()
    out = []
    for i, prompt in enumerate(prompts):
        torch.manual_seed(seed + i)
        ids = tokenizer(prompt, return_tensors="pt").input_ids.to(device)
        gen = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=True, temperature=0.8, top_p=0.95,
                             top_k=50, pad_token_id=tokenizer.pad_token_id)
        out.append({"prompt": prompt, "completion": tokenizer.decode(gen[0, ids.shape[1]:])})
    return out


TOKENIZER_FILES = ("tiktoken.model", "tokenizer_config.json", "special_tokens_map.json")


def save_model_folder(model, tokenizer, out_dir: Path, max_shard_size: str = "15MB",
                      copy_tokenizer: bool = True) -> List[str]:
    """Write the shipped layout: config.json (without ``auto_map``: the installed package provides the code;
    ``kimi-hybrid export`` writes self-contained Hub folders), generation_config.json, safetensors weights in
    shards of at most ``max_shard_size`` (with ``model.safetensors.index.json`` when there are several) and the
    tokenizer files. No code files are written into the folder. Returns the weight file names."""
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
    return sorted(f.name for f in out_dir.glob("model*.safetensors"))


def corpus_summary(manifest: Dict[str, Any], meta: Dict[str, Any], top: int = 15) -> Dict[str, Any]:
    """What the model card says about the corpus: per split packages / files / bytes / tokens, the licences, the
    largest train packages by tokens, and how many distributions were left out."""
    licences: Dict[str, int] = {}
    for p in manifest.get("packages", []):
        licences[p["licence"]] = licences.get(p["licence"], 0) + p["num_bytes"]
    tokens = meta.get("splits", {}).get("train", {}).get("tokens_per_package", {})
    splits = {}
    for name, info in manifest.get("splits", {}).items():
        m = meta.get("splits", {}).get(name, {})
        splits[name] = {k: info.get(k) for k in ("num_packages", "num_files", "num_bytes")}
        splits[name].update({"tokens": m.get("num_text_tokens"), "bytes_per_token": m.get("bytes_per_token")})
        if name != "train":
            splits[name]["packages"] = info.get("packages")
    splits.get("heldout_stdlib", {})["modules"] = manifest.get("splits", {}).get("heldout_stdlib", {}).get("modules")
    versions = {p["name"]: p["version"] for p in manifest.get("packages", [])}
    return {
        "python_version": manifest.get("python_version"), "site_packages": manifest.get("site_packages"),
        "splits": splits, "bytes_by_licence": dict(sorted(licences.items(), key=lambda kv: -kv[1])),
        "top_train_packages_by_tokens": [[k, versions.get(k, ""), v] for k, v in
                                         sorted(tokens.items(), key=lambda kv: -kv[1])[:top]],
        "excluded_distributions": len(manifest.get("excluded_distributions", [])),
        "excluded_examples": [e["name"] for e in manifest.get("excluded_distributions", [])][:12],
        "skipped_files": manifest.get("skipped"), "rules": manifest.get("rules"),
    }


def _fmt_int(x: Any) -> str:
    return f"{x:,}" if isinstance(x, int) else str(x)


def model_card(config, metrics: Dict[str, Any], samples: List[Dict[str, str]]) -> str:
    """The model card of the embedded model, written from the training metrics."""
    p, tr = metrics["params"], metrics["train"]
    ev = metrics.get("eval", {})
    corpus = metrics.get("corpus", {})
    kinds = ["KDA" if t == KDA else "MLA" for t in config.layer_types]
    sp = corpus.get("splits", {})
    lines = [
        "---", "library_name: transformers", "license: mit", "pipeline_tag: text-generation",
        "tags:", "- kimi-hybrid", "- kda", "- mla", "- moe", "- code", "---", "",
        "# kimi-hybrid-stdlib", "",
        "The embedded default model of kimi-hybrid: a small KimiHybrid (Kimi Linear architecture: Kimi Delta "
        "Attention + NoPE MLA + MoE) trained from scratch on permissively licensed Python source code (the "
        "standard library and the installed packages of a machine learning Python environment). It completes "
        "Python code; it is a demonstration of the architecture and the tooling, not an assistant: it has no chat "
        "or instruction training.", "",
        "Loading it needs the `kimi_hybrid` package (the code is not in this folder) and `tiktoken` (the "
        "tokenizer).", "",
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
        f"(`tiktoken.model`, trained on the CPython 3.11 standard library, see `corpus_manifest.json`) |",
        f"| weights | {metrics['save_dtype']} safetensors in {len(metrics.get('weight_files', [])) or '?'} shards of "
        f"at most {metrics.get('max_shard_size', '?')} (`A_log`, `dt_bias`, router bias in fp32) |", "",
        "## Data", "",
    ]
    if sp:
        tr_s, hp, hs = sp.get("train", {}), sp.get("heldout_packages", {}), sp.get("heldout_stdlib", {})
        lic = corpus.get("bytes_by_licence", {})
        lines += [
            f"Built on the training machine from its own Python {corpus.get('python_version')} environment by "
            "`examples/build_python_corpus.py` (nothing uploaded): the `.py` files of the standard library and of "
            "every installed distribution whose `METADATA` declares a permissive licence (`License-Expression`, "
            "else the `License ::` classifiers, else the `License` field; MIT, BSD, Apache-2.0, PSF, ISC, ...), "
            "without test suites, vendored third-party code or files over 1 MB, deduplicated by sha256. "
            f"{corpus.get('excluded_distributions', 0)} distributions were left out for their licence (e.g. "
            f"{', '.join(corpus.get('excluded_examples', [])[:6])}). Every file is listed with its package, "
            "version, licence and sha256 in `python_corpus_manifest.json.gz`; files are joined with [EOS].", "",
            "| split | packages | files | bytes | tokens | bytes/token |", "|---|---|---|---|---|---|",
            f"| train | {_fmt_int(tr_s.get('num_packages'))} | {_fmt_int(tr_s.get('num_files'))} | "
            f"{_fmt_int(tr_s.get('num_bytes'))} | {_fmt_int(tr_s.get('tokens'))} | {tr_s.get('bytes_per_token')} |",
            f"| held-out packages: {', '.join(hp.get('packages') or [])} | {_fmt_int(hp.get('num_packages'))} | "
            f"{_fmt_int(hp.get('num_files'))} | {_fmt_int(hp.get('num_bytes'))} | {_fmt_int(hp.get('tokens'))} | "
            f"{hp.get('bytes_per_token')} |",
            f"| held-out stdlib modules: {', '.join(hs.get('modules') or [])} | - | {_fmt_int(hs.get('num_files'))} "
            f"| {_fmt_int(hs.get('num_bytes'))} | {_fmt_int(hs.get('tokens'))} | {hs.get('bytes_per_token')} |", "",
            "The split is by whole package: no file of a held-out package or stdlib module is in the train split "
            "(a held-out file identical to a train file is dropped). Train bytes by licence: "
            + ", ".join(f"{k} {v / 1e6:.1f} MB" for k, v in list(lic.items())[:8]) + ". Largest train packages "
            "(tokens): " + ", ".join(f"{n} {v} ({t / 1e6:.1f} M)" for n, v, t in
                                      corpus.get("top_train_packages_by_tokens", [])[:12]) + ".", "",
        ]
    lines += [
        "## Training", "",
        f"`{metrics.get('command', 'python examples/train_default_model.py')}` on one {metrics['device']} "
        f"(torch {metrics['torch']}, FLA kernels: {metrics.get('fla', '?')}): seed {metrics['seed']}, context "
        f"{metrics['context']}, batch {metrics['batch_size']}, {tr['steps']} steps ({tr['tokens']:,} tokens in "
        f"{tr['seconds']} s"
        + (f", of which {tr['startup_seconds']} s were the first two steps' kernel compilation; "
           f"{tr['tokens_per_second_after_startup']:,} tokens/s after it" if "startup_seconds" in tr else
           f", {tr['tokens_per_second']:,} tokens/s")
        + f"), AdamW (lr {metrics['lr']}, betas "
        f"0.9/0.95, weight decay {metrics['weight_decay']}), {metrics['warmup']} warm-up steps then cosine to "
        f"{metrics['min_lr_ratio']} x lr, bf16 autocast, fp32 master weights, gradient clipping 1.0.", "",
    ]
    for note in metrics.get("card_notes", []):
        lines += [note, ""]
    if ev:
        lines += [
            "## Evaluation", "",
            "Next-token loss over non-overlapping windows of the context length (at most "
            f"{metrics.get('eval_max_windows')} evenly spaced windows per split), with the shipped "
            f"{metrics['save_dtype']} weights; bits per byte = summed loss / ln 2 / UTF-8 bytes of the predicted "
            "tokens:", "",
            "| split | context | predicted tokens | loss (nats/token) | perplexity | bits per byte |",
            "|---|---|---|---|---|---|",
        ]
        for name, label in (("heldout_packages", "held-out packages"), ("heldout_stdlib", "held-out stdlib modules"),
                            ("train", "train (sample)")):
            e = ev.get(name)
            if e:
                lines.append(f"| {label} | {e['context']} | {e['tokens']:,} | {e['loss']:.4f} | {e['ppl']:.2f} | "
                             f"{e.get('bits_per_byte', float('nan')):.4f} |")
        lines.append("")
    dec = metrics.get("decoding", {})
    if dec:
        lines += [
            f"Repetition of greedy completions ({next(iter(dec.values()))['max_new_tokens']} new tokens, "
            f"{len(next(iter(dec.values()))['completions'])} prompts; distinct-4-gram ratio of the generated "
            "tokens, 1.0 = no 4-gram repeats; `no_repeat_ngram_size=4` makes it 1.0 by construction"
            + (f"; {metrics['decoding_note']}" if metrics.get("decoding_note") else "") + "):", "",
            "| decoding | mean distinct-4 | min distinct-4 |", "|---|---|---|",
        ]
        for name, d in dec.items():
            kw = ", ".join(f"{k}={v}" for k, v in d["kwargs"].items()) or "plain greedy"
            lines.append(f"| {kw} | {d['mean_distinct_4']} | {d['min_distinct_4']} |")
        lines.append("")
    lines += [
        "## Usage", "",
        "```bash", "kimi-hybrid generate --prompt 'def read_config(path):' --max-new-tokens 128", "```", "",
        "```python", "import kimi_hybrid  # registers the classes (or use `kimi-hybrid export` for a "
        "trust_remote_code folder)", "from transformers import AutoModelForCausalLM, AutoTokenizer", "",
        'tok = AutoTokenizer.from_pretrained("models/kimi-hybrid-stdlib")',
        'model = AutoModelForCausalLM.from_pretrained("models/kimi-hybrid-stdlib")', "```", "",
    ]
    greedy = dec.get("greedy_rp1.3_nr4") or dec.get("greedy")
    if greedy:
        kw = ", ".join(f"{k}={v}" for k, v in greedy["kwargs"].items()) or "plain greedy"
        lines += [f"## Samples (greedy, {kw})", ""]
        for r in greedy["completions"][:3]:
            lines += ["```python", r["prompt"] + r["completion"], "```", ""]
    if samples:
        lines += ["## Samples (seeded, temperature 0.8, top-p 0.95, top-k 50)", ""]
        for s in samples[:2]:
            lines += ["```python", s["prompt"] + s["completion"], "```", ""]
    lines += ["Files: `train_metrics.json` (the full training record, loss curve and every measured completion), "
              "`samples.txt`, `python_corpus_manifest.json.gz` (the training corpus), `corpus_manifest.json` (the "
              "tokenizer's corpus)."]
    return "\n".join(lines) + "\n"


def write_samples_txt(path: Path, decoding: Dict[str, Any], samples: List[Dict[str, str]]) -> None:
    """Every measured greedy completion and the sampled ones, as plain text."""
    with open(path, "w", encoding="utf-8") as f:
        for name, d in decoding.items():
            for r in d["completions"]:
                f.write(f"=== {name} {d['kwargs']} (distinct-4 {r['distinct_4']}, {r['new_tokens']} tokens) ===\n"
                        f"{r['prompt']}{r['completion']}\n\n")
        for s in samples:
            f.write(f"=== sampled (T=0.8, top-p 0.95, top-k 50) ===\n{s['prompt']}{s['completion']}\n\n")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", default=str(ROOT / "data"),
                   help="folder with train_ids.npy, heldout_packages_ids.npy, heldout_stdlib_ids.npy, "
                        "tokenized_meta.json")
    p.add_argument("--manifest", default=None,
                   help="python_corpus_manifest.json.gz (default: the one in --data); copied into --out")
    p.add_argument("--tokenizer", default=str(ROOT / "models" / "kimi-hybrid-stdlib"))
    p.add_argument("--out", default=str(ROOT / "out" / "kimi-hybrid-stdlib"),
                   help="the model folder to write (the layout of models/kimi-hybrid-stdlib)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--steps", type=int, default=0, help="0 = fit the run to --time-budget / --deadline")
    p.add_argument("--time-budget", type=float, default=300.0, help="seconds of training when --steps 0")
    p.add_argument("--deadline", type=float, default=None,
                   help="Unix time by which training must end (caps --time-budget)")
    p.add_argument("--samples-deadline", type=float, default=None,
                   help="Unix time after which no further decoding setting is measured")
    p.add_argument("--max-steps", type=int, default=20000)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--save-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--eval-batch-size", type=int, default=32)
    p.add_argument("--eval-max-windows", type=int, default=2000, help="cap on evaluated windows per split")
    p.add_argument("--train-eval-windows", type=int, default=200, help="windows of the train split to evaluate")
    p.add_argument("--samples-max-new-tokens", type=int, default=200, help="0 = measure and write no samples")
    p.add_argument("--decoding-prompts", type=int, default=len(DEFAULT_PROMPTS),
                   help="how many of the built-in prompts the decoding measurement uses")
    p.add_argument("--calib-steps", type=int, default=12)
    p.add_argument("--max-shard-size", default="15MB", help="save_pretrained shard size")
    p.add_argument("--tiny", action="store_true", help="a toy-width model (smoke tests of this script)")
    p.add_argument("--no-tokenizer-files", action="store_true", help="do not copy the tokenizer files into --out")
    args = p.parse_args(argv)

    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    amp = torch.bfloat16 if device.type == "cuda" else None
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    log_f = open(out_dir / "train_log.txt", "w", encoding="utf-8")

    def log(msg: str) -> None:
        tqdm.write(msg, file=sys.stdout)
        log_f.write(msg + "\n")
        log_f.flush()

    tokenizer = KimiHybridTokenizer.from_pretrained(args.tokenizer)
    data = Path(args.data)
    ids = {s: load_ids(data / f"{s}_ids.npy") for s in SPLITS}
    meta = json.loads((data / "tokenized_meta.json").read_text()) if (data / "tokenized_meta.json").exists() else {}
    manifest_path = Path(args.manifest) if args.manifest else data / "python_corpus_manifest.json.gz"
    manifest: Dict[str, Any] = {}
    if manifest_path.is_file():
        import gzip

        with gzip.open(manifest_path, "rt", encoding="utf-8") as fh:
            manifest = json.load(fh)
        if manifest_path.resolve() != (out_dir / "python_corpus_manifest.json.gz").resolve():
            shutil.copyfile(manifest_path, out_dir / "python_corpus_manifest.json.gz")
    config = default_config(tokenizer, tiny=args.tiny)
    model = KimiHybridForCausalLM(config).to(device)
    params = count_params(model)
    fla = bool(device.type == "cuda" and fla_available())
    log(f"params: {json.dumps(params)}; bf16 bytes ~{params['total'] * 2 / 1e6:.1f} MB")
    log("data: " + ", ".join(f"{s} {v.numel():,} ids" for s, v in ids.items()) +
        f"; device {device}, torch {torch.__version__}, FLA kernels {fla}")

    metrics: Dict[str, Any] = {
        "seed": args.seed, "context": args.context, "batch_size": args.batch_size, "lr": args.lr,
        "warmup": args.warmup, "min_lr_ratio": args.min_lr_ratio, "weight_decay": args.weight_decay,
        "save_dtype": args.save_dtype, "max_shard_size": args.max_shard_size, "params": params,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "fla": fla, "eval_max_windows": args.eval_max_windows,
        "corpus": corpus_summary(manifest, meta) if manifest else {}, "data_meta": meta,
        "command": "python examples/train_default_model.py " + " ".join(argv if argv is not None else sys.argv[1:]),
    }

    def write_metrics(samples: List[Dict[str, str]]) -> None:
        (out_dir / "train_metrics.json").write_text(json.dumps(metrics, indent=1) + "\n", encoding="utf-8")
        (out_dir / "README.md").write_text(model_card(model.config, metrics, samples), encoding="utf-8")

    summary = train(model, ids["train"], context=args.context, batch_size=args.batch_size, steps=args.steps,
                    time_budget=args.time_budget, lr=args.lr, warmup=args.warmup, min_lr_ratio=args.min_lr_ratio,
                    weight_decay=args.weight_decay, seed=args.seed, device=device, amp_dtype=amp, log=log,
                    max_steps=args.max_steps, calib_steps=args.calib_steps, deadline=args.deadline)
    metrics["train"] = {k: v for k, v in summary.items() if k != "curve"}
    metrics["curve"] = summary["curve"]
    save_dtype = getattr(torch, args.save_dtype)
    cast_for_shipping(model, save_dtype)
    from transformers import GenerationConfig

    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, do_sample=True, temperature=0.8, top_p=0.95, top_k=50,
        max_new_tokens=256)
    metrics["weight_files"] = save_model_folder(model, tokenizer, out_dir, args.max_shard_size,
                                                copy_tokenizer=not args.no_tokenizer_files)
    write_metrics([])
    log(f"saved weights: {metrics['weight_files']}")

    samples: List[Dict[str, str]] = []
    try:
        byte_lengths = token_byte_lengths(tokenizer)
        ev_amp = amp if save_dtype == torch.float32 else None
        metrics["eval"] = {}
        for split in ("heldout_packages", "heldout_stdlib", "train"):
            cap = args.train_eval_windows if split == "train" else args.eval_max_windows
            t0 = time.perf_counter()
            metrics["eval"][split] = evaluate(model, ids[split], args.context, args.eval_batch_size, device, ev_amp,
                                              cap, byte_lengths)
            log(f"eval {split}: {json.dumps(metrics['eval'][split])} ({time.perf_counter() - t0:.1f} s)")
            write_metrics([])
        if args.samples_max_new_tokens > 0:
            metrics["decoding"] = measure_decoding(model, tokenizer, DEFAULT_PROMPTS[:args.decoding_prompts],
                                                   device, args.samples_max_new_tokens,
                                                   deadline=args.samples_deadline, log=log)
            write_metrics([])
            if args.samples_deadline is None or time.time() < args.samples_deadline:
                samples = write_samples(model, tokenizer, DEFAULT_PROMPTS[:2], device, args.seed,
                                        min(160, args.samples_max_new_tokens))
    except (Exception, KeyboardInterrupt) as exc:  # the weights are saved; record what failed
        metrics["late_error"] = f"{type(exc).__name__}: {exc}"
        log(f"after training: {metrics['late_error']}\n{traceback.format_exc()}")
    if metrics.get("decoding") or samples:
        write_samples_txt(out_dir / "samples.txt", metrics.get("decoding", {}), samples)
    write_metrics(samples)
    size = sum(f.stat().st_size for f in out_dir.glob("model*.safetensors"))
    log(f"saved {out_dir} (weights {size / 1e6:.1f} MB)")
    log_f.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
