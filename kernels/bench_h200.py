"""H200 benchmark: kimi-hybrid vs transformers' native ``kimi_linear`` (FLA path), same weights, one run.

Model (default): the FULL Kimi-Linear-48B-A3B depth in the released layer plan (27 layers: MLA at 0-based 3, 7, 11,
15, 19, 23, 26, KDA elsewhere; layer 0 dense MLP, 256 experts top-8 elsewhere; vocab 163840), random weights, bf16.
``--layers N`` benchmarks the first N layers of that plan instead (labelled a slice in the JSON); ``--tiny`` runs the
whole script on a tiny config (CPU or GPU) to rehearse it. The native model is built first (random init) and its
state dict is mapped into ours with ``kimi_hybrid.conversion.native.native_state_dict_views`` (tensors shared, not
copied): both hold the same weights.

Sections are functions in a registry (:data:`SECTIONS`, ``--list-sections`` prints it): each takes the shared
:class:`Bench` context, declares what it needs (CUDA, the native model) and the seconds it needs to start at full
depth. ``--sections`` picks them; they run in registry order; one whose estimate exceeds what is left of
``--budget-s`` is skipped with the reason recorded (``skipped``), and so is each measurement inside a section. The
JSON is rewritten after every measurement, so a run killed later keeps what it measured.

  setup      parameters, HBM bandwidth (device-to-device copy, read + write bytes) and bf16 GEMM rate measured now;
             the fused kernel the blockwise MLA chose (``mla_kimi_hybrid.fused_backend``)
  mlaprobe   fused MLA key-block kernels timed per backend at the long prefill's block shapes; fastest first
  cold       first prefill (4K) of each model: Triton autotuning included
  prefill    128K tokens (``--prefill``), batch 1, one call: seconds, tokens/s, peak memory over the weights
  long       ``--long`` tokens (1M) prefilled in ``--long-chunk`` pieces through the cache, then graph decoding; peak
             memory vs weights + cache; cache bytes vs the closed-form formula
  decode     batch 1 at 4K: CUDA graph over a static cache, torch.compile-d and plain; native's own eager loop;
             ``compiled_check`` (:func:`decode_check`)
  generate   what users run: ``model.generate`` per new token (greedy B1 4K / 128K, B32 4K, top-p sampling, 4 beams,
             graphs off, the first call's overhead), native ``generate``, against our graph step and the floor
  decode2    batch 1 at 128K and batch 32 at 4K (compiled graph while the budget allows, else plain), native likewise
  perlayer   per-layer prefill time at 128K (CUDA events) against each layer's work, and a torch.profiler kernel
             table of one KDA+MoE and one MLA+MoE layer (written to ``--profile-out``)
  census     kernels one eager decode step of a layer launches, per layer kind, their time and achieved bandwidth
  parity     teacher-forced, layer by layer, bf16, T = 512: ours vs native per layer; compiled vs eager per layer
  fp32       fp32 on CUDA at small shapes: FLA ``chunk_kda`` vs the fp64 reference, and whether a row's output
             depends on the other rows of the batch (:func:`batch_composition`); two subprocesses, one per Triton
             fp32 dot precision (``TRITON_F32_DEFAULT`` tf32 / ieee)
Floors: bytes a decode step must read (embedding rows, attention weights, router + shared expert + the routed experts
hit, final norm + lm_head, KDA states and MLA latents) / the HBM bandwidth measured in this run.

A top-level ``summary`` holds the record (:func:`summarise`); a short table is printed last.

Usage (repo root installed as ``kimi_hybrid``, FLA + transformers importable):
    python -m kimi_hybrid.kernels.bench_h200 --out results.json [--layers 27] [--budget-s 480] [--sections ...]
    python -m kimi_hybrid.kernels.bench_h200 --tiny --out tiny.json        # rehearsal, any device
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import inspect
import json
import os
import platform
import subprocess
import sys
import time
import traceback

import torch

from kimi_hybrid import KimiHybridCache, KimiHybridConfig, KimiHybridForCausalLM
from kimi_hybrid import mla_kimi_hybrid as mla
from kimi_hybrid.conversion.native import native_state_dict_views
from kimi_hybrid.engine_kimi_hybrid import GraphDecoder, to_static_cache


HBM_BPS = 4.8e12  # datasheet; the benchmark measures its own (R["setup"]["hbm_GBps"]) and uses that
LIN, FULL = "linear_attention", "full_attention"
CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"


def sync():
    if CUDA:
        torch.cuda.synchronize()


def timed(fn):
    sync()
    t = time.perf_counter()
    r = fn()
    sync()
    return time.perf_counter() - t, r


def gib(x):
    return round(x / 2**30, 3)


def mem_alloc():
    return torch.cuda.memory_allocated() if CUDA else 0


def mem_peak():
    return torch.cuda.max_memory_allocated() if CUDA else 0


def reset_peak():
    if CUDA:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def versions():
    out = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name() if CUDA else "cpu",
           "python": platform.python_version(), "cuda": torch.version.cuda,
           "commit": os.environ.get("GIT_COMMIT", "unknown"), "host": platform.node()}
    for mod in ("transformers", "triton", "fla"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception as e:  # noqa: BLE001
            out[mod] = f"missing: {type(e).__name__}"
    try:
        out["fla_core"] = __import__("importlib.metadata").metadata.version("fla-core")
    except Exception:  # noqa: BLE001
        pass
    return out


# ------------------------------------------------------------------------------------------------------ models
# the rehearsal's tiny model (tests/presets.py "tiny-kda-first", restated: the benchmark does not import the tests)
TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=4, hidden_act="silu", rms_norm_eps=1e-5, max_position_embeddings=4096,
            tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0, q_lora_rank=None,
            kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, mla_use_nope=True, num_experts=8,
            num_experts_per_token=2, moe_intermediate_size=32, num_shared_experts=1, first_k_dense_replace=1,
            routed_scaling_factor=2.446, moe_router_activation_func="sigmoid", use_grouped_topk=True,
            num_expert_group=2, topk_group=1, moe_renormalize=True,
            layer_types=[LIN, LIN, LIN, FULL], mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
            linear_attn_config={"head_dim": 16, "num_heads": 4, "short_conv_kernel_size": 4})


def base_config(tiny=False, **over):
    if tiny:
        return KimiHybridConfig(**{**TINY, **over})
    return KimiHybridConfig.from_preset("kimi-linear-48b-a3b", **over)


def plan(n_layers, tiny=False):
    """(layer_types, mlp_layer_types) of the first n layers of the released plan (or the tiny config's)."""
    full = base_config(tiny)
    lt, mt = list(full.layer_types), list(full.mlp_layer_types)
    if n_layers > len(lt):
        raise ValueError(f"--layers {n_layers}: the plan has {len(lt)} layers")
    return lt[:n_layers], mt[:n_layers]


def our_config(n_layers, tiny=False):
    lt, mt = plan(n_layers, tiny)
    return base_config(tiny, num_hidden_layers=n_layers, layer_types=lt, mlp_layer_types=mt)


def native_config(cfg):
    from transformers import KimiLinearConfig

    la = cfg.linear_attn_config
    ncfg = KimiLinearConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        moe_intermediate_size=cfg.moe_intermediate_size, num_hidden_layers=cfg.num_hidden_layers,
        layer_types=list(cfg.layer_types), mlp_layer_types=list(cfg.mlp_layer_types),
        linear_num_heads=la["num_heads"], linear_head_dim=la["head_dim"],
        linear_conv_kernel_dim=la["short_conv_kernel_size"], num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_attention_heads, kv_lora_rank=cfg.kv_lora_rank, q_lora_rank=None,
        qk_nope_head_dim=cfg.qk_nope_head_dim, qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim,
        num_local_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_token,
        n_shared_experts=cfg.num_shared_experts, n_group=1, topk_group=1,
        routed_scaling_factor=cfg.routed_scaling_factor, tie_word_embeddings=False,
        max_position_embeddings=1048576, rms_norm_eps=cfg.rms_norm_eps, pad_token_id=cfg.pad_token_id,
        bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id)
    ncfg._attn_implementation = "sdpa"
    return ncfg


def build(n_layers, tiny=False, skip_native=False):
    """(native or None, ours, cfg): native built first, its weights mapped into ours (shared tensors)."""
    cfg = our_config(n_layers, tiny)
    dtype = torch.bfloat16
    torch.manual_seed(0)
    if skip_native:
        with torch.device(DEV):
            torch.set_default_dtype(dtype)
            ours = KimiHybridForCausalLM(cfg).eval()
            torch.set_default_dtype(torch.float32)
        return None, ours, cfg
    from transformers import KimiLinearForCausalLM

    if tiny:  # the tiny preset's router differs from Kimi-Linear's: use Kimi-Linear's routing on both sides
        cfg = base_config(True, num_hidden_layers=n_layers, layer_types=list(cfg.layer_types),
                          mlp_layer_types=list(cfg.mlp_layer_types), use_grouped_topk=False, num_expert_group=1,
                          topk_group=1)
    with torch.device(DEV):
        torch.set_default_dtype(dtype)
        native = KimiLinearForCausalLM(native_config(cfg)).eval()
        torch.set_default_dtype(torch.float32)
    with torch.device("meta"):
        ours = KimiHybridForCausalLM(cfg)
    mapped = native_state_dict_views(native.state_dict())
    missing, unexpected = ours.load_state_dict(mapped, strict=False, assign=True)
    if missing or unexpected:
        raise RuntimeError(f"weight mapping: missing {missing[:5]}, unexpected {unexpected[:5]}")
    ours.eval()
    return native, ours, cfg


# ------------------------------------------------------------------------------------------------------ floors
def param_bytes(mod):
    return sum(p.numel() * p.element_size() for p in mod.parameters())


def layer_weight_bytes(layer, distinct_experts):
    """Weights one decode step must read in a decoder layer (norms, attention, MLP; routed experts: only
    ``distinct_experts`` of them)."""
    b = param_bytes(layer.self_attn) + param_bytes(layer.input_layernorm) + param_bytes(layer.post_attention_layernorm)
    mlp = layer.mlp
    if hasattr(mlp, "experts"):
        ex = mlp.experts
        per = (ex.gate_up_proj[0].numel() + ex.down_proj[0].numel()) * ex.gate_up_proj.element_size()
        b += param_bytes(mlp.gate) + (param_bytes(mlp.shared_experts) if hasattr(mlp, "shared_experts") else 0)
        b += per * distinct_experts
    else:
        b += param_bytes(mlp)
    return b


def expected_distinct(E, k, B):
    return E * (1 - (1 - k / E) ** B)


def kda_state_bytes(cfg):
    la = cfg.linear_attn_config
    H, K, W = la["num_heads"], la["head_dim"], la["short_conv_kernel_size"]
    return 3 * H * K * W * 2 + H * K * K * 4


def floor_bytes(model, cfg, B, ctx):
    """(bytes, detail) one decode step of batch B at context ``ctx`` must read (this model's own layers)."""
    D = cfg.hidden_size
    E, k = cfg.num_experts, cfg.num_experts_per_token
    dist = min(E, expected_distinct(E, k, B)) if B > 1 else k
    layers = model.model.layers
    w = B * D * model.model.embed_tokens.weight.element_size()
    w += param_bytes(model.lm_head) + param_bytes(model.model.norm)
    w += sum(layer_weight_bytes(l, dist) for l in layers)
    lat = B * ctx * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 2
    cache = sum(B * kda_state_bytes(cfg) if l.layer_type == LIN else lat for l in layers)
    return w + cache, {"weights": w, "cache": cache, "distinct_experts_per_moe_layer": round(dist, 1)}


# ------------------------------------------------------------------------------------------------------ ours
@torch.no_grad()
def ours_prefill(model, cfg, ids, chunk=None, times=None, deadline=None):
    """Prefill through a dynamic cache, in pieces of ``chunk`` tokens; ``times`` (a list) receives each piece's
    seconds; ``deadline`` (a ``time.perf_counter()`` value): stop after the piece that passes it (the cache then
    holds fewer tokens: ``cache.seen_tokens``). Returns (cache, last logits [B, V])."""
    cache = KimiHybridCache(cfg)
    T = ids.shape[1]
    step = chunk or T
    out = None
    for s in range(0, T, step):
        if deadline is not None and s and time.perf_counter() > deadline:
            break
        t0 = time.perf_counter()
        out = model(ids[:, s:s + step], past_key_values=cache, use_cache=True, logits_to_keep=1)
        if times is not None:
            sync()
            times.append(round(time.perf_counter() - t0, 3))
    return cache, out.logits[:, -1]


def cache_check(cache, cfg):
    """The cache's own byte count vs the closed-form formula (KDA state per layer and sequence; 576 bf16 per token
    and MLA layer)."""
    rep = cache.memory_report()
    B, T = rep["batch_size"], cache.seen_tokens
    n_kda, n_mla = cfg.layer_types.count(LIN), cfg.layer_types.count(FULL)
    rows = cache.max_cache_len if cache.static else T
    formula_kda = B * n_kda * kda_state_bytes(cfg)
    formula_mla = B * n_mla * rows * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 2
    return {"seen_tokens": T, "static": cache.static, "rows_held": rows, "kda_bytes": rep["kda_bytes"],
            "kda_formula": formula_kda, "mla_bytes": rep["mla_bytes"], "mla_formula": formula_mla,
            "mask_bytes": rep["mask_bytes"], "total_bytes": rep["total_bytes"],
            "exact": rep["kda_bytes"] == formula_kda and rep["mla_bytes"] == formula_mla}


@torch.no_grad()
def graph_decode_time(dec, first, steps=48, warm=4):
    """(pipelined s/step over ``steps`` replays, median synchronised s/step over 16)."""
    dec.sync_position()  # the cache may have been restored since the decoder last stepped
    nxt = first
    for _ in range(warm):
        nxt = dec.step(nxt).argmax(-1, keepdim=True)
    sync()
    t = time.perf_counter()
    for _ in range(steps):
        nxt = dec.step(nxt).argmax(-1, keepdim=True)
    sync()
    pipelined = (time.perf_counter() - t) / steps
    per = []
    for _ in range(16):
        sync()
        t = time.perf_counter()
        nxt = dec.step(nxt).argmax(-1, keepdim=True)
        sync()
        per.append(time.perf_counter() - t)
    per.sort()
    return pipelined, per[len(per) // 2]


class EagerDecoder:
    """CPU stand-in for ``GraphDecoder`` in the rehearsal (same interface, eager steps)."""

    def __init__(self, model, cache, compile=False):
        self.model, self.cache, self.compiled = model, cache, False

    def sync_position(self):
        return self.cache.seen_tokens

    @torch.no_grad()
    def step(self, ids):
        return self.model(ids, past_key_values=self.cache, use_cache=True).logits[:, -1]


def decoder(model, cache, compile=False):
    return GraphDecoder(model, cache, compile=compile) if CUDA else EagerDecoder(model, cache)


def capture_layer_calls(model, run):
    """Run ``run()`` (one forward of ``model``) with hooks on every decoder layer. Returns ``({i: [args, kwargs,
    out]}, run's result)``: each layer's positional / keyword inputs (tensors cloned) and its output hidden state."""
    calls, hooks = {}, []
    for i, l in enumerate(model.model.layers):
        def pre(mod, a, kw, i=i):
            calls[i] = [tuple(x.detach().clone() if torch.is_tensor(x) else x for x in a), dict(kw), None]

        def post(mod, a, kw, o, i=i):
            calls[i][2] = (o[0] if isinstance(o, tuple) else o).detach().clone()
        hooks += [l.register_forward_pre_hook(pre, with_kwargs=True), l.register_forward_hook(post, with_kwargs=True)]
    try:
        with torch.no_grad():
            r = run()
    finally:
        for h in hooks:
            h.remove()
    return calls, r


def best_ms(res):
    """The fastest timed variant of a decode case (``graph``, ``compiled_graph``: dicts with ``ms_per_step``; other
    entries, such as ``compiled_check``, are not timings)."""
    return min(v["ms_per_step"] for v in res.values() if isinstance(v, dict) and "ms_per_step" in v)


def rel_err(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


@torch.no_grad()
def decode_check(model, st, snap, first, compiled_logits=None, layers=(), budget=lambda: 1e9,
                 compile_fn=lambda m: torch.compile(m, dynamic=False)):
    """What a compiled decode step's disagreement with eager means (one step from the snapshot ``snap`` of the
    static cache ``st``, input ``first [B, 1]``):

    * ``sensitivity_rel_err``: the eager step vs the same eager step with the embedding output moved by about one
      bf16 rounding (each value times 1 +- 2**-8, random signs): how far this model's logits move when any one
      early value rounds differently. With random weights and 26 top-8 routers, a near-tied expert choice flips.
    * ``compiled_vs_eager_rel_err`` / ``argmax_agree``: the compiled step's logits (when given) vs eager.
    * ``per_layer_compiled_vs_eager``: teacher-forced, each listed layer's eager decode step vs the same layer
      compiled (``torch.compile(layer, dynamic=False)``), both fed the eager step's input to that layer and the
      same cache state: a real compile bug shows there, rounding alone stays at the bf16 level (~1e-2).
    Logits magnitudes are given to read the errors against."""
    st.restore(snap)
    calls, ref = capture_layer_calls(model, lambda: model(first, past_key_values=st, use_cache=True).logits[:, -1])
    ref = ref.float()
    st.restore(snap)
    gen = torch.Generator(device=ref.device).manual_seed(11)

    def perturb(mod, a, o):
        sign = torch.randint(0, 2, o.shape, device=o.device, generator=gen).float() * 2 - 1
        return (o.float() * (1 + sign * 2 ** -8)).to(o.dtype)
    h = model.model.embed_tokens.register_forward_hook(perturb)
    try:
        pert = model(first, past_key_values=st, use_cache=True).logits[:, -1].float()
    finally:
        h.remove()
    st.restore(snap)
    out = {"logits_rms": ref.pow(2).mean().sqrt().item(), "logits_max_abs": ref.abs().max().item(),
           "sensitivity_rel_err": rel_err(pert, ref),
           "sensitivity_argmax_agree": bool((pert.argmax(-1) == ref.argmax(-1)).all())}
    if compiled_logits is not None:
        out["compiled_vs_eager_rel_err"] = rel_err(compiled_logits.float(), ref)
        out["compiled_argmax_agree"] = bool((compiled_logits.float().argmax(-1) == ref.argmax(-1)).all())
    per = {}
    for i in layers:
        if budget() < 30:
            per["stopped"] = f"budget, before layer {i}"
            break
        a, kw, o_ref = calls[i]
        layer = model.model.layers[i]
        st.restore(snap)
        e = layer(*a, **kw)[0].float()
        st.restore(snap)
        t0 = time.perf_counter()
        c = compile_fn(layer)(*a, **kw)[0].float()
        st.restore(snap)
        kind = f"{layer.layer_type}+{'moe' if hasattr(layer.mlp, 'experts') else 'dense'}"
        delta_ref = (o_ref.float() - a[0].float())  # the layer's own contribution (its output minus its input)
        per[f"layer{i}:{kind}"] = {"rel_err_output": rel_err(c, e),
                                   "rel_err_of_layer_update": rel_err(c - a[0].float(), e - a[0].float()),
                                   "eager_repeat_equal": bool(torch.equal(e, o_ref.float())),
                                   "update_rms": delta_ref.pow(2).mean().sqrt().item(),
                                   "compile_s": round(time.perf_counter() - t0, 1)}
    out["per_layer_compiled_vs_eager"] = per
    return out


def build_ours_only(n_layers):
    """Ours alone, its own random init, bf16 on the device (probe_h200 uses it)."""
    return build(n_layers, skip_native=True)


def prefill_layer_times(model, ids):
    """CUDA-event seconds of each decoder layer in one prefill (no cache): (total_s, {name: s})."""
    evs, hooks = {}, []
    for i, l in enumerate(model.model.layers):
        def pre(mod, args, i=i):
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            evs.setdefault(i, [None, None])[0] = e

        def post(mod, args, out, i=i):
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            evs[i][1] = e
        hooks += [l.register_forward_pre_hook(pre), l.register_forward_hook(post)]
    try:
        with torch.no_grad():
            total, _ = timed(lambda: model(ids, use_cache=False, logits_to_keep=1))
    finally:
        for h in hooks:
            h.remove()
    kinds = [f"{l.layer_type}+{'moe' if hasattr(l.mlp, 'experts') else 'dense'}" for l in model.model.layers]
    per = {f"layer{i}:{kinds[i]}": a.elapsed_time(b) / 1e3 for i, (a, b) in evs.items()}
    return total, per


def layer_work(cfg, T):
    """FLOPs a prefill of T tokens must do in one layer of each kind (projections, attention, MLP), bf16 matmuls."""
    D, H = cfg.hidden_size, cfg.num_attention_heads
    la = cfg.linear_attn_config
    Hk, K = la["num_heads"], la["head_dim"]
    qk, dv = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim
    r, rope = cfg.kv_lora_rank, cfg.qk_rope_head_dim
    moe = 2 * T * D * cfg.moe_intermediate_size * 3 * (cfg.num_experts_per_token + cfg.num_shared_experts)
    moe += 2 * T * D * cfg.num_experts  # router
    kda_proj = 2 * T * D * (3 * Hk * K) + 2 * T * D * Hk * K  # q, k, v, o
    kda_proj += 2 * T * (D * K + K * Hk * K) * 2 + 2 * T * D * Hk  # f_a/f_b, g_a/g_b (rank head_dim), beta
    kda_core = T * Hk * (4 * 64 * K + 6 * K * K)  # chunk form, 64-token chunks: intra-chunk + state terms (approx.)
    mla_proj = 2 * T * D * H * qk + 2 * T * D * (r + rope) + 2 * T * r * H * (cfg.qk_nope_head_dim + dv)
    mla_proj += 2 * T * H * dv * D
    mla_attn = T * T * H * (qk + dv)  # causal half of 2 * T * T * H * (qk + dv)
    dense = 2 * T * D * cfg.intermediate_size * 3
    return {"kda_moe_flop": kda_proj + kda_core + moe, "mla_moe_flop": mla_proj + mla_attn + moe,
            "kda_dense_flop": kda_proj + kda_core + dense, "mla_dense_flop": mla_proj + mla_attn + dense,
            "detail": {"moe": moe, "dense_mlp": dense, "kda_proj": kda_proj, "kda_core_approx": kda_core,
                       "mla_proj": mla_proj, "mla_attention": mla_attn}}


# ------------------------------------------------------------------------------------------------------ native
@torch.no_grad()
def native_decode(model, ids, steps=8):
    """Median seconds of one eager step of native's own loop (its cache), after a prefill of ``ids``."""
    o = model(ids, use_cache=True, logits_to_keep=1)
    pkv = o.past_key_values
    nxt = o.logits[:, -1:].argmax(-1)
    times = []
    for _ in range(steps + 2):
        dt, o = timed(lambda: model(nxt, past_key_values=pkv, use_cache=True))
        times.append(dt)
        pkv = o.past_key_values
        nxt = o.logits[:, -1:].argmax(-1)
    times = sorted(times[2:])
    return times[len(times) // 2]


# ------------------------------------------------------------------------------------------------------ fp32 notes
def fp32_notes(tiny):
    """fp32 on CUDA (or CPU): FLA chunk_kda vs the fp64 reference; row independence (a row alone vs in a batch)."""
    from kimi_hybrid.kda_kimi_hybrid import kda_chunk, recurrent_kda_ref

    out = {"TRITON_F32_DEFAULT": os.environ.get("TRITON_F32_DEFAULT", "(unset: tf32)")}
    g = torch.Generator().manual_seed(0)
    B, T, H, K = 4, 300, 4, 128
    q, k, v = (torch.randn(B, T, H, K, generator=g) for _ in range(3))
    gate = -torch.rand(B, T, H, K, generator=g) * 0.2
    beta = torch.rand(B, T, H, generator=g)
    ref, _ = recurrent_kda_ref(q.double(), k.double(), v.double(), gate.double(), beta.double(),
                               use_qk_l2norm_in_kernel=True)
    dev = [t.to(DEV) for t in (q, k, v, gate, beta)]
    with torch.no_grad():
        o, _ = kda_chunk(*dev, use_qk_l2norm_in_kernel=True)
        o1, _ = kda_chunk(*[t[:1] for t in dev], use_qk_l2norm_in_kernel=True)
    o = o.double().cpu()
    out["chunk_kda_rel_err_vs_fp64"] = ((o - ref).norm() / ref.norm()).item()
    out["chunk_kda_row0_alone_vs_in_batch4_max_abs"] = (o1.double().cpu()[0] - o[0]).abs().max().item()
    # a small model, fp32 end to end: row 0 alone vs in a batch of 4; and vs the CPU fp32 forward
    cfg = base_config(True)
    torch.manual_seed(0)
    m = KimiHybridForCausalLM(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (4, 200))
    with torch.no_grad():
        cpu = m(ids, use_cache=False).logits
        md = m.to(DEV)
        full = md(ids.to(DEV), use_cache=False).logits.cpu()
        one = md(ids[:1].to(DEV), use_cache=False).logits.cpu()
    out["tiny_model_rel_err_vs_cpu_fp32"] = ((full - cpu).norm() / cpu.norm()).item()
    out["tiny_model_row0_alone_vs_in_batch4_max_abs"] = (one[0] - full[0]).abs().max().item()
    out["tiny_model_row0_alone_vs_in_batch4_rel"] = ((one[0] - full[0]).norm() / full[0].norm()).item()
    out["batch_composition"] = batch_composition()
    return out


def _row_in_batches(fn, row, other, sizes=(2, 3, 5, 9)):
    """Whether ``fn``'s output for one row depends on the rest of its batch: ``row()`` / ``other()`` make a batch-1
    input tuple (tensors with the batch first; None kept); the row alone vs the same row at position N // 2 of a
    batch of N (N - 1 other random rows, fresh for each N). Returns max |diff| per N, the worst, and the row's
    output magnitude (max |out| alone)."""
    r = row()
    alone = fn(*r)
    per = {}
    for n in sizes:
        parts = [other() for _ in range(n - 1)]
        parts.insert(n // 2, r)
        batch = tuple(None if xs[0] is None else torch.cat(xs, 0) for xs in zip(*parts))
        got = fn(*batch)[n // 2:n // 2 + 1]
        per[f"B{n}"] = (got.double() - alone.double()).abs().max().item()
    worst = max(per.values())
    return {"max_abs_diff": worst, "bit_exact": worst == 0.0, "per_batch": per,
            "row_out_max_abs": alone.double().abs().max().item()}


@torch.no_grad()
def batch_composition():
    """A row alone vs the same row inside batches of 2 .. 9 rows (1 .. 8 other random rows), fp32 and bf16, on this
    device: FLA ``chunk_kda`` (T 300) and ``fused_recurrent_kda`` (T 1 from a state), our Triton KDA decode kernel
    (T 1 from a state), our Triton expert GEMVs (16 experts of the 48B-A3B widths, top-8), and the whole tiny model's
    logits (prefill T 64 without a cache; then one decode step through the cache). Max |diff| and the magnitude."""
    res = {"what": "row alone vs the same row at position N//2 of a batch of N in {2,3,5,9} (other rows random); "
                   "max |diff| over N; row_out_max_abs = max |output| of the row alone",
           "device": DEV}
    H, K = 4, 128
    g = torch.Generator(device=DEV).manual_seed(5)

    def rn(*shape, dtype=torch.float32):
        return torch.randn(*shape, device=DEV, generator=g).to(dtype)

    for dtype in (torch.float32, torch.bfloat16):
        d = res.setdefault(str(dtype).replace("torch.", ""), {})

        def kda_inputs(T, state):
            def make():
                q, k, v = rn(1, T, H, K, dtype=dtype), rn(1, T, H, K, dtype=dtype), rn(1, T, H, K, dtype=dtype)
                gate = -torch.rand(1, T, H, K, device=DEV, generator=g) * 0.2
                beta = torch.rand(1, T, H, device=DEV, generator=g).to(dtype)
                h0 = rn(1, H, K, K) * 0.1 if state else None
                return q, k, v, gate, beta, h0
            return make
        try:
            from kimi_hybrid.kda_kimi_hybrid import kda_chunk

            mk = kda_inputs(300, True)
            d["chunk_kda_T300"] = _row_in_batches(
                lambda q, k, v, gt, b, h0: kda_chunk(q, k, v, gt, b, initial_state=h0, use_qk_l2norm_in_kernel=True)[0],
                mk, mk)
        except Exception as e:  # noqa: BLE001
            d["chunk_kda_T300"] = f"{type(e).__name__}: {str(e)[:200]}"
        if CUDA:
            try:
                from fla.ops.kda import fused_recurrent_kda

                mk = kda_inputs(1, True)
                d["fused_recurrent_kda_T1"] = _row_in_batches(
                    lambda q, k, v, gt, b, h0: fused_recurrent_kda(q, k, v, gt.float(), b, initial_state=h0.float(),
                                                                   output_final_state=True,
                                                                   use_qk_l2norm_in_kernel=True)[0], mk, mk)
            except Exception as e:  # noqa: BLE001
                d["fused_recurrent_kda_T1"] = f"{type(e).__name__}: {str(e)[:200]}"
            try:
                from kimi_hybrid.kernels.kda_decode import kda_decode_triton

                mk = kda_inputs(1, True)
                d["triton_kda_decode_T1"] = _row_in_batches(
                    lambda q, k, v, gt, b, h0: kda_decode_triton(q, k, v, gt, b, h0)[0], mk, mk)
            except Exception as e:  # noqa: BLE001
                d["triton_kda_decode_T1"] = f"{type(e).__name__}: {str(e)[:200]}"
            try:
                from kimi_hybrid.kernels.moe_decode import moe_decode_gemv

                E, D, F_, k_top = 16, 2304, 1024, 8
                gate_up, down = rn(E, 2 * F_, D, dtype=dtype) * 0.02, rn(E, D, F_, dtype=dtype) * 0.02

                def mk_moe():
                    idx = torch.randperm(E, device=DEV, generator=g)[:k_top].view(1, k_top)
                    return rn(1, D, dtype=dtype), idx, torch.rand(1, k_top, device=DEV, generator=g)
                d["triton_moe_gemv_top8"] = _row_in_batches(
                    lambda x, idx, w: moe_decode_gemv(x, idx, w, gate_up, down), mk_moe, mk_moe)
            except Exception as e:  # noqa: BLE001
                d["triton_moe_gemv_top8"] = f"{type(e).__name__}: {str(e)[:200]}"
        # the whole tiny model
        try:
            cfg = base_config(True)
            torch.manual_seed(0)
            m = KimiHybridForCausalLM(cfg).eval().to(DEV, dtype)

            def mk_ids():
                return (torch.randint(3, cfg.vocab_size, (1, 64), device=DEV, generator=g),)
            d["tiny_model_prefill_logits_T64"] = _row_in_batches(lambda ids: m(ids, use_cache=False).logits, mk_ids,
                                                                 mk_ids)

            def step(ids):
                cache = KimiHybridCache(cfg)
                m(ids[:, :-1], past_key_values=cache, use_cache=True)
                return m(ids[:, -1:], past_key_values=cache, use_cache=True).logits
            d["tiny_model_decode_step_logits"] = _row_in_batches(step, mk_ids, mk_ids)
        except Exception as e:  # noqa: BLE001
            d["tiny_model"] = f"{type(e).__name__}: {str(e)[:200]}"
    return res


def save_autotune(dest):
    """Tar Triton's ``*.autotune.json`` results (under ``$TRITON_CACHE_DIR``) into ``dest`` (FLA's autotuning then
    restores on a fresh machine: ``kernels/device_run.sh`` unpacks it). Returns the number of files."""
    import tarfile

    root = os.environ.get("TRITON_CACHE_DIR")
    if not root or not dest or not os.path.isdir(root):
        return 0
    n = 0
    with tarfile.open(dest, "w:gz") as tf:
        for d, _, files in os.walk(root):
            for f in files:
                if f.endswith(".autotune.json"):
                    full = os.path.join(d, f)
                    tf.add(full, arcname=os.path.join("triton", os.path.relpath(full, root)))
                    n += 1
    return n


def mla_block_probe(H, qk, dv, Tq, k_lens):
    """Seconds of one fused key block (q ``Tq`` x k each of ``k_lens``, bf16, non-causal) per backend: the first call
    (cuDNN builds its plan there) and a second one when the first took under 2 s."""
    out = {}
    q = torch.randn(1, H, Tq, qk, device="cuda", dtype=torch.bfloat16)
    for name in ("flash", "cudnn", "efficient"):
        for S in k_lens:
            k = torch.randn(1, H, S, qk, device="cuda", dtype=torch.bfloat16)
            v = torch.randn(1, H, S, dv, device="cuda", dtype=torch.bfloat16)
            try:
                t1, _ = timed(lambda: mla._FUSED[name](q, k, v, qk ** -0.5, False))
                t2 = timed(lambda: mla._FUSED[name](q, k, v, qk ** -0.5, False))[0] if t1 < 2 else None
                flop = 2 * Tq * S * H * (qk + dv)
                out[f"{name}_k{S}"] = {"first_s": round(t1, 4), "second_s": round(t2, 4) if t2 else None,
                                       "TFLOPs_useful": round(flop / (t2 or t1) / 1e12, 1)}
            except Exception as e:  # noqa: BLE001
                out[f"{name}_k{S}"] = f"{type(e).__name__}: {str(e)[:150]}"
            k = v = None  # free this key block before the next is allocated
    return out



# ------------------------------------------------------------------------------------------------------ generate
GEN_SAMPLING = {"do_sample": True, "top_p": 0.95, "temperature": 0.8, "top_k": 0}


def generate_seconds(model, ids, new_tokens, **kw):
    """Seconds of one ``model.generate`` call making exactly ``new_tokens`` tokens per row (``min_new_tokens`` =
    ``max_new_tokens``, so no row stops early). Raises RuntimeError when the output has another length."""
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    mask = torch.ones_like(ids)

    def run():
        with torch.no_grad():
            return model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                  pad_token_id=pad, **kw)
    dt, out = timed(run)
    if out.shape[-1] - ids.shape[-1] != new_tokens:
        raise RuntimeError(f"generate made {out.shape[-1] - ids.shape[-1]} tokens, asked {new_tokens}")
    return dt


def generate_per_token(model, ids, n, warm_tokens=None, **kw):
    """Per-new-token time of ``generate`` = (time of n + 1 new tokens - time of 1) / n, both warm: a first call of
    ``warm_tokens`` (default n + 1) new tokens runs before them and is reported as ``first_call_s``; with the
    default it is the same request as the timed one, so ``first_call_overhead_s`` = first call - warm call."""
    first = generate_seconds(model, ids, warm_tokens or n + 1, **kw)
    t_many = generate_seconds(model, ids, n + 1, **kw)
    t_one = generate_seconds(model, ids, 1, **kw)
    out = {"batch": ids.shape[0], "context": ids.shape[1], "new_tokens": n, "first_call_s": round(first, 3),
           "n_plus_1_s": round(t_many, 6), "one_s": round(t_one, 6),
           "ms_per_token": round((t_many - t_one) / n * 1e3, 3)}
    if warm_tokens is None:
        out["first_call_overhead_s"] = round(first - t_many, 3)
    return out


def eager_generate_kwargs(model, ids):
    """(keywords that turn CUDA graphs off in ``model.generate``, a note): ``cuda_graphs=False`` when generate takes
    that keyword (its signature, else a one-token call), else none, and the note says the plain call is measured."""
    if "cuda_graphs" in inspect.signature(model.generate).parameters:
        return {"cuda_graphs": False}, "cuda_graphs=False"
    try:
        generate_seconds(model, ids[:, :8], 1, cuda_graphs=False)
        return {"cuda_graphs": False}, "cuda_graphs=False"
    except (TypeError, ValueError) as e:
        return {}, f"plain call: generate takes no cuda_graphs keyword ({type(e).__name__})"


def graph_step_ms(bench, B, T):
    """Our graph decode step (plain CUDA graph, not compiled) at batch B, context T: the decode sections' figure
    when they measured this case, else measured here."""
    done = (bench.R["ours"].get("decode") or {}).get(f"B{B}_T{T}") or {}
    if done.get("ms_per_step"):
        return done["ms_per_step"], "decode section"
    dyn, last = ours_prefill(bench.ours, bench.cfg, bench.rand(B, T), chunk=65536 // B if T * B > 65536 else None)
    st = to_static_cache(dyn, T + 64)
    del dyn
    dec = decoder(bench.ours, st)
    pipe, _ = graph_decode_time(dec, last.argmax(-1, keepdim=True), steps=16)
    del dec, st
    return round(pipe * 1e3, 4), "measured in the generate section"


def generate_cases(bench):
    """(model name, record key, seconds estimated at full depth, function) of each ``generate`` measurement, in
    priority order (the first is the first ``generate`` call of the run: it carries the first-call overhead)."""
    a, ours, n = bench.args, bench.ours, bench.args.gen_tokens
    ctx, lctx, b32 = a.decode_ctx, a.decode_long_ctx, a.batch32

    def eager_b1():
        ids = bench.rand(1, ctx)
        kw, mode = eager_generate_kwargs(ours, ids)
        return {**generate_per_token(ours, ids, n, warm_tokens=2, **kw), "mode": mode}

    def sample_b1():
        return {**generate_per_token(ours, bench.rand(1, ctx), n, warm_tokens=2, **GEN_SAMPLING),
                "sampling": GEN_SAMPLING}

    def beam4():
        return {**generate_per_token(ours, bench.rand(1, ctx), n, num_beams=4), "note": "per step of 4 beams"}

    return [
        ("ours", f"B1_T{ctx}", 25, lambda: generate_per_token(ours, bench.rand(1, ctx), n)),
        ("ours", f"B1_T{ctx}_eager", 12, eager_b1),
        ("native", f"B1_T{ctx}", 15, lambda: generate_per_token(bench.native, bench.rand(1, ctx), n, warm_tokens=2)),
        ("ours", f"B1_T{ctx}_sample", 10, sample_b1),
        ("ours", f"B1_T{ctx}_beam4", 20, beam4),
        ("ours", f"B{b32}_T{ctx}", 40, lambda: generate_per_token(ours, bench.rand(b32, ctx), n)),
        ("ours", f"B1_T{lctx}", 45, lambda: generate_per_token(ours, bench.rand(1, lctx), n, warm_tokens=2)),
    ]


def generate_comparison(bench):
    """Per greedy case: ``generate`` per token vs our graph step, the floor and native ``generate`` (ratios)."""
    a, gen = bench.args, bench.R["ours"].get("generate") or {}
    native = (bench.R["native"].get("generate") or {}).get(f"B1_T{a.decode_ctx}") or {}
    out = {}
    for B, T in ((1, a.decode_ctx), (1, a.decode_long_ctx), (a.batch32, a.decode_ctx)):
        key = f"B{B}_T{T}"
        g = (gen.get(key) or {}).get("ms_per_token")
        if g is None:
            continue
        est = 15 if T * B <= 8192 else 30
        if bench.left() < est:
            out[key] = {"generate_ms": g, "graph_step": f"skipped: {bench.left():.0f} s left < {est} s estimated"}
            continue
        step, src = graph_step_ms(bench, B, T)
        floor = floor_bytes(bench.ours, bench.cfg, B, T)[0] / bench.bps * 1e3
        row = {"generate_ms": g, "graph_step_ms": step, "graph_step_from": src, "floor_ms": round(floor, 4),
               "generate_vs_graph_step": round(g / step, 3), "generate_x_floor": round(g / floor, 2)}
        if B == 1 and T == a.decode_ctx and native.get("ms_per_token"):
            row["native_generate_ms"] = native["ms_per_token"]
            row["native_vs_generate"] = round(native["ms_per_token"] / g, 2)
        out[key] = row
    return out


# ------------------------------------------------------------------------------------------------------ registry
@dataclasses.dataclass
class Section:
    """One benchmark section: ``fn(bench)`` measures and stores into ``bench.R`` (``into``: the record path its
    return value goes to, or None when it stores its own measurements); ``need_s``: seconds it needs to start at full
    depth (``tiny_need_s`` on the tiny config); ``needs``: ``"cuda"`` and / or ``"native"``."""

    name: str
    fn: object
    need_s: float
    needs: tuple
    into: tuple | None
    tiny_need_s: float

    @property
    def summary(self):
        return (self.fn.__doc__ or "").strip().split("\n")[0]


SECTIONS: dict[str, Section] = {}


def section(name, need_s=0.0, needs=(), into=None, tiny_need_s=None):
    """Register the decorated ``fn(bench)`` as section ``name`` (run order = registration order)."""
    def register(fn):
        SECTIONS[name] = Section(name, fn, need_s, tuple(needs), into, need_s if tiny_need_s is None else tiny_need_s)
        return fn
    return register


class Bench:
    """What every section shares: the arguments, the two models (native may be None), the record ``R`` and the
    wall-clock budget. ``guard`` runs one measurement (budget check, error capture, JSON rewrite)."""

    def __init__(self, args, n_layers, t_start):
        self.args, self.n_layers, self.t_start = args, n_layers, t_start
        self.R = {"summary": {}, "started_utc": utc_now(), "versions": versions(), "args": vars(args), "setup": {},
                  "ours": {}, "native": {}, "skipped": {}, "errors": []}
        out_dir = os.path.dirname(os.path.abspath(args.out))
        self.prof_out = args.profile_out or os.path.join(out_dir, "profile_128k.txt")
        self.autotune_tgz = os.path.join(out_dir, "triton_autotune.tgz")
        t_build, (self.native, self.ours, self.cfg) = timed(lambda: build(n_layers, args.tiny, args.skip_native))
        self.build_s = t_build
        self.compile_ok = CUDA and not args.no_compile
        self.gen = torch.Generator(device=DEV).manual_seed(0)
        self.check_layers = first_layer_of_each_kind(self.ours)
        self.R["setup"] = self.plan_record()

    def plan_record(self):
        """The model's label, layer plan, parameters and weight bytes."""
        lt, n, tiny, ours = list(self.cfg.layer_types), self.n_layers, self.args.tiny, self.ours
        return {"model": "tiny rehearsal config" if tiny else
                ("FULL depth, released plan" if n == 27 else f"SLICE: first {n} layers"),
                "layers": n, "slice": n != 27 or tiny,
                "plan": {"kda": lt.count(LIN), "mla": lt.count(FULL),
                         "mla_at_0based": [i for i, t in enumerate(lt) if t == FULL],
                         "dense_at": [i for i, t in enumerate(self.cfg.mlp_layer_types) if t == "dense"]},
                "params_B": round(sum(p.numel() for p in ours.parameters()) / 1e9, 3),
                "build_s": round(self.build_s, 1), "weights_GiB": gib(param_bytes(ours)),
                "weights_bytes": param_bytes(ours)}

    def rand(self, B, T):
        return torch.randint(0, self.cfg.vocab_size, (B, T), device=DEV, generator=self.gen)

    @property
    def bps(self):
        return (self.R["setup"].get("hbm_GBps") or HBM_BPS / 1e9) * 1e9

    def left(self):
        return self.args.budget_s - (time.perf_counter() - self.t_start)

    def save(self):
        self.R["elapsed_s"] = round(time.perf_counter() - self.t_start, 1)
        self.R["summary"] = summarise(self.R, self.n_layers, self.args)
        with open(self.args.out, "w") as f:
            json.dump(self.R, f, indent=1, default=str)

    def skip(self, name, reason):
        self.R["skipped"][name] = reason
        print("SKIP", name, reason, flush=True)
        self.save()

    def guard(self, name, fn, need_s=0.0, into=None):
        """Run measurement ``fn`` unless fewer than ``need_s`` seconds are left; its result is stored at ``into`` =
        (dict, key) before the JSON is rewritten. Returns the result, or None (skipped or failed: recorded)."""
        if self.left() < need_s:
            self.skip(name, f"{self.left():.0f} s left < {need_s:.0f} s estimated")
            return None
        t0 = time.perf_counter()
        try:
            r = fn()
            if into is not None:
                into[0][into[1]] = r
            return r
        except Exception as e:  # noqa: BLE001
            self.R["errors"].append({"where": name, "error": f"{type(e).__name__}: {str(e)[:400]}",
                                     "trace": traceback.format_exc()[-1500:]})
            print("ERROR", name, type(e).__name__, str(e)[:300], flush=True)
            return None
        finally:
            self.R.setdefault("section_s", {})[name] = round(time.perf_counter() - t0, 1)
            if CUDA:
                torch.cuda.empty_cache()
            self.save()

    def run(self, sec):
        """Run section ``sec`` when what it needs is here and its estimate fits the budget."""
        missing = [n for n in sec.needs if (n == "cuda" and not CUDA) or (n == "native" and self.native is None)]
        if missing:
            self.skip(sec.name, f"needs {' and '.join(missing)}")
            return
        into = None
        if sec.into is not None:
            holder = self.R
            for k in sec.into[:-1]:
                holder = holder.setdefault(k, {})
            into = (holder, sec.into[-1])
        need = sec.tiny_need_s if self.args.tiny else sec.need_s
        self.guard(sec.name, lambda: sec.fn(self), need_s=need, into=into)


def utc_now():
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def layer_kind(layer):
    return f"{layer.layer_type}+{'moe' if hasattr(layer.mlp, 'experts') else 'dense'}"


def first_layer_of_each_kind(model):
    """Index of the first layer of each kind (KDA+dense, KDA+MoE, MLA+MoE in the released plan)."""
    seen, out = set(), []
    for i, l in enumerate(model.model.layers):
        if layer_kind(l) not in seen:
            seen.add(layer_kind(l))
            out.append(i)
    return out


# ------------------------------------------------------------------------------------------------------ sections
@section("setup")
def setup_section(bench):
    """HBM bandwidth and bf16 GEMM rate measured now; the blockwise MLA's fused kernel (the plan: ``Bench``)."""
    R = bench.R
    R["setup"].update(bench.guard("setup device", lambda: measure_device(bench.cfg)) or {})
    print("setup", {k: v for k, v in R["setup"].items() if k != "mla_backend_checks"}, flush=True)


def measure_device(cfg):
    """HBM GB/s (2 GiB device-to-device copies, read + write bytes), bf16 GEMM TFLOP/s (8192^3), the MLA backend."""
    out = {}
    if CUDA:
        a = torch.empty(2**30, dtype=torch.bfloat16, device="cuda").normal_()
        b = torch.empty_like(a)
        b.copy_(a)
        reps = 10
        dt, _ = timed(lambda: [b.copy_(a) for _ in range(reps)])
        out["hbm_GBps"] = round(2 * a.numel() * 2 * reps / dt / 1e9, 1)
        del a, b
        x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        x @ x
        dt, _ = timed(lambda: [x @ x for _ in range(10)])
        out["bf16_gemm_TFLOPs"] = round(10 * 2 * 8192**3 / dt / 1e12, 1)
        del x
    out["mla_fused_backend"] = mla.fused_backend(torch.device(DEV), torch.bfloat16, cfg.qk_nope_head_dim +
                                                 cfg.qk_rope_head_dim, cfg.v_head_dim) if CUDA else None
    out["mla_backend_checks"] = {str(k): v for k, v in mla._CHECK_LOG.items()}
    return out


@section("mlaprobe", need_s=60, needs=("cuda",), into=("mla_block_probe",))
def mlaprobe_section(bench):
    """Fused MLA key-block kernels per backend at the long prefill's block shapes; the fastest (by its worst
    shape: one slow shape is what a long run pays for) goes first in ``mla.FUSED_ORDER``."""
    cfg, a = bench.cfg, bench.args
    qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    probe = mla_block_probe(cfg.num_attention_heads, qk, cfg.v_head_dim, min(a.long_chunk, 32768),
                            [32768, 65536, 98304] if not a.tiny else [300, 700])
    print("mla block probe", probe, flush=True)
    worst = {}
    for name in mla._FUSED:
        vals = [v["TFLOPs_useful"] for k, v in probe.items() if k.startswith(name + "_") and isinstance(v, dict)]
        n_shapes = sum(1 for k in probe if k.startswith(name + "_"))
        worst[name] = min(vals) if vals and len(vals) == n_shapes else 0.0
    mla.FUSED_ORDER = tuple(sorted(worst, key=lambda n: -worst[n]))
    mla._CHOSEN.clear()
    bench.R["mla_fused_order"] = {"order": mla.FUSED_ORDER, "worst_TFLOPs_useful": worst,
                                  "chosen": mla.fused_backend(torch.device(DEV), torch.bfloat16, qk, cfg.v_head_dim)}
    print("mla fused order", bench.R["mla_fused_order"], flush=True)
    return probe


@section("cold", into=("cold",))
def cold_section(bench):
    """First prefill (4K) of each model, Triton autotuning included; the autotune results saved beside --out."""
    ids = bench.rand(1, 4096 if not bench.args.tiny else 128)
    r = {}
    with torch.no_grad():
        r["ours_first_prefill_4096_s"] = round(timed(lambda: bench.ours(ids, use_cache=False, logits_to_keep=1))[0],
                                               2)
        if bench.native is not None:
            r["native_first_prefill_4096_s"] = round(
                timed(lambda: bench.native(ids, use_cache=False, logits_to_keep=1))[0], 2)
    bench.R["autotune_files_saved"] = save_autotune(bench.autotune_tgz)
    return r


@section("prefill", need_s=40)
def prefill_section(bench):
    """``--prefill`` tokens (128K), batch 1, one call, each model: seconds, tokens/s, peak memory over the weights."""
    for name, model in (("ours", bench.ours), ("native", bench.native)):
        if model is not None:
            bench.guard(f"prefill {name}", lambda m=model: prefill_once(bench, m), need_s=40,
                        into=(bench.R[name], "prefill"))
            print(name, "prefill", bench.R[name].get("prefill"), flush=True)


def prefill_once(bench, model):
    T = bench.args.prefill
    ids = bench.rand(1, T)
    with torch.no_grad():
        model(ids[:, :1024], use_cache=True, logits_to_keep=1)
        reset_peak()
        base = mem_alloc()
        first, _ = timed(lambda: model(ids, use_cache=True, logits_to_keep=1))
        reset_peak()
        dt, _ = timed(lambda: model(ids, use_cache=True, logits_to_keep=1))
    return {"T": T, "first_s": round(first, 3), "s": round(dt, 3), "tok_s": round(T / dt),
            "peak_GiB": gib(mem_peak()), "peak_over_weights_GiB": gib(mem_peak() - base)}


@section("long", need_s=150, tiny_need_s=0, into=("ours", "long"))
def long_section(bench):
    """``--long`` tokens prefilled in ``--long-chunk`` pieces through the cache (stopped at ``--long-max-s``), then
    graph decoding at that context; peak memory vs weights + cache; cache bytes vs the formula."""
    a, cfg, ours = bench.args, bench.cfg, bench.ours
    ids = bench.rand(1, a.long)
    reset_peak()
    base = mem_alloc()
    chunk_s = []
    deadline = time.perf_counter() + min(a.long_max_s, bench.left() - a.long_reserve_s)
    mla.PROFILE = [] if CUDA else None
    dt, (dyn, last) = timed(lambda: ours_prefill(ours, cfg, ids, chunk=a.long_chunk, times=chunk_s,
                                                 deadline=deadline))
    L = dyn.seen_tokens  # all of them unless the deadline stopped it
    peak = mem_peak()
    blocks = {}
    for name, causal, qs, ks, e0, e1 in mla.PROFILE or []:
        b = blocks.setdefault(f"{name} {'causal' if causal else 'full'} q{qs[2]} k{ks[2]}", [0, 0.0])
        b[0] += 1
        b[1] += e0.elapsed_time(e1) / 1e3
    mla.PROFILE = None
    rep = cache_check(dyn, cfg)
    st = to_static_cache(dyn, L + 64)
    del dyn
    if CUDA:
        torch.cuda.empty_cache()
    weights_b = param_bytes(ours)
    res = {"tokens": L, "asked_tokens": a.long, "chunk": a.long_chunk, "prefill_s": round(dt, 2),
           "prefill_tok_s": round(L / dt), "chunk_s": chunk_s, "peak_GiB": gib(peak), "weights_GiB": gib(weights_b),
           "cache_GiB": gib(rep["total_bytes"]),
           "peak_over_weights_and_cache_GiB": gib(peak - weights_b - rep["total_bytes"]),
           "peak_over_start_GiB": gib(peak - base), "cache_after_prefill": rep,
           "mla_blocks_calls_s": {k: [v[0], round(v[1], 3)] for k, v in sorted(blocks.items())},
           "mla_backend_log": {str(k): v for k, v in mla._CHECK_LOG.items()},
           "mla_backend_failed": {str(k): sorted(v) for k, v in mla._FAILED.items()}}
    bench.R["ours"]["long"] = res
    bench.save()
    dec = decoder(ours, st)
    pipe, synced = graph_decode_time(dec, last.argmax(-1, keepdim=True), steps=16)
    fb, _ = floor_bytes(ours, cfg, 1, L)
    res.update({"decode": "CUDA graph, not compiled", "decode_ms": round(pipe * 1e3, 3),
                "decode_ms_synced": round(synced * 1e3, 3), "floor_ms": round(fb / bench.bps * 1e3, 3),
                "x_floor": round(pipe / (fb / bench.bps), 2), "cache_static": cache_check(st, cfg)})
    del dec
    bench.R["autotune_files_saved"] = save_autotune(bench.autotune_tgz)
    print("long", {k: v for k, v in res.items() if k != "chunk_s"}, flush=True)
    return res


def ours_decode(bench, B, T, compile_, check_layers=()):
    """Our graph decode step at batch B, context T (plain, and compiled when ``compile_``): ms per step, its
    agreement with the eager step, the floor, the cache's bytes; ``compiled_check`` on ``check_layers``."""
    ours, cfg = bench.ours, bench.cfg
    dyn, last = ours_prefill(ours, cfg, bench.rand(B, T), chunk=65536 // B if T * B > 65536 else None)
    st = to_static_cache(dyn, T + 128)
    del dyn
    if CUDA:
        torch.cuda.empty_cache()
    first = last.argmax(-1, keepdim=True)
    snap = st.snapshot()
    with torch.no_grad():
        ref = ours(first, past_key_values=st, use_cache=True).logits[:, -1].float()
    st.restore(snap)
    res = {"B": B, "context": T}
    for comp in ([False, True] if compile_ else [False]):
        tc, dec = timed(lambda: decoder(ours, st, compile=comp))
        st.restore(snap)
        got = dec.step(first).float()
        st.restore(snap)
        pipe, synced = graph_decode_time(dec, first, steps=32)
        st.restore(snap)
        res["compiled_graph" if comp else "graph"] = {
            "ms_per_step": round(pipe * 1e3, 4), "ms_synced": round(synced * 1e3, 4), "build_s": round(tc, 1),
            "vs_eager_rel_err": ((got - ref).norm() / ref.norm()).item(),
            "argmax_agrees_with_eager": bool((got.argmax(-1) == ref.argmax(-1)).all())}
        del dec
        if comp:  # is a compiled / eager difference a bug or this random model's sensitivity? (decode_check)
            try:
                res["compiled_check"] = decode_check(ours, st, snap, first, got, check_layers, bench.left)
            except Exception as e:  # noqa: BLE001
                res["compiled_check"] = f"{type(e).__name__}: {str(e)[:300]}"
            st.restore(snap)
    fb, det = floor_bytes(ours, cfg, B, T)
    best = best_ms(res)
    floor_ms = fb / bench.bps * 1e3
    res.update({"ms_per_step": best, "tokens_per_s": round(B / best * 1e3, 1), "floor_ms": round(floor_ms, 4),
                "x_floor": round(best / floor_ms, 2), "floor_bytes": fb, "floor_detail": det,
                "cache": cache_check(st, cfg)})
    return res


def native_dec(bench, B, T):
    return {"B": B, "context": T, "ms_per_step": round(native_decode(bench.native, bench.rand(B, T)) * 1e3, 2)}


def decode_case(bench, tag, B, T, compile_, need_ours, need_native, check_layers=()):
    """One decode case of ours (and of native when built), stored under ``decode`` as ``B{B}_T{T}``."""
    key = f"B{B}_T{T}"
    for who in ("ours", "native"):
        bench.R[who].setdefault("decode", {})
    bench.guard(f"{tag} ours {key if tag == 'decode2' else 'b1'}",
                lambda: ours_decode(bench, B, T, compile_, check_layers), need_s=need_ours,
                into=(bench.R["ours"]["decode"], key))
    print("decode ours", key, bench.R["ours"]["decode"].get(key), flush=True)
    if bench.native is not None:
        bench.guard(f"{tag} native {key if tag == 'decode2' else 'b1'}", lambda: native_dec(bench, B, T),
                    need_s=need_native, into=(bench.R["native"]["decode"], key))
        print("decode native", key, bench.R["native"]["decode"].get(key), flush=True)


@section("decode", need_s=90)
def decode_section(bench):
    """Batch 1 at ``--decode-ctx`` (4K): our CUDA graph, plain and compiled (with ``compiled_check``); native's
    eager loop."""
    decode_case(bench, "decode", 1, bench.args.decode_ctx, bench.compile_ok, 90, 20, bench.check_layers)


@section("generate", need_s=25)
def generate_section(bench):
    """``model.generate`` per new token, ours and native, against our graph step and the floor (cases in
    :func:`generate_cases`, each skipped with its reason when the budget is short)."""
    for who in ("ours", "native"):
        bench.R[who].setdefault("generate", {})
    for who, key, est, fn in generate_cases(bench):
        name = f"generate {who} {key}"
        if who == "native" and bench.native is None:
            bench.skip(name, "needs native")
            continue
        bench.guard(name, fn, need_s=est, into=(bench.R[who]["generate"], key))
        print(name, bench.R[who]["generate"].get(key), flush=True)
    bench.guard("generate comparison", lambda: generate_comparison(bench),
                into=(bench.R, "generate_comparison"))
    print("generate vs graph step / floor", bench.R.get("generate_comparison"), flush=True)


@section("decode2", need_s=60)
def decode2_section(bench):
    """Batch 1 at ``--decode-long-ctx`` (128K) and batch ``--batch32`` at 4K: compiled graph while the budget allows
    (and ``--no-compile-decode2`` is not given), else plain; native likewise."""
    a = bench.args
    for B, T in ((1, a.decode_long_ctx), (a.batch32, a.decode_ctx)):
        comp = bench.compile_ok and not a.no_compile_decode2 and bench.left() > 170
        decode_case(bench, "decode2", B, T, comp, 60, 40)


@section("perlayer", need_s=25, into=("ours", "prefill_per_layer"))
def perlayer_section(bench):
    """Per-layer prefill time at ``--prefill`` tokens (CUDA events) against each layer's work; a torch.profiler kernel
    table of one KDA+MoE and one MLA+MoE layer (``--profile-out``)."""
    T = bench.args.prefill
    out = {"T": T}
    if not CUDA:
        return out
    ids = bench.rand(1, T)
    reset_peak()
    base = mem_alloc()
    total, per = prefill_layer_times(bench.ours, ids)
    out["total_s"] = round(total, 3)
    out["peak_activation_GiB"] = gib(mem_peak() - base)
    out["layers_ms"] = {k: round(v * 1e3, 2) for k, v in per.items()}
    rate = (bench.R["setup"].get("bf16_gemm_TFLOPs") or 700) * 1e12
    out.update(layer_work_table(bench.cfg, T, per, rate))
    out.update(profile_prefill_layers(bench, T))
    return out


def layer_work_table(cfg, T, per, rate):
    """Each layer's measured prefill seconds ``per`` ({"layer{i}:{kind}": s}) against the FLOPs its kind must do at
    T tokens, timed at the measured bf16 GEMM ``rate`` (FLOP/s): the per-kind medians and the per-layer table."""
    work = layer_work(cfg, T)
    flop = {"linear_attention+moe": work["kda_moe_flop"], "full_attention+moe": work["mla_moe_flop"],
            "linear_attention+dense": work["kda_dense_flop"], "full_attention+dense": work["mla_dense_flop"]}
    kda = [v for k, v in per.items() if "linear" in k and "moe" in k]
    mlas = [v for k, v in per.items() if "full" in k]
    table = {"work_detail_FLOP": work["detail"]}
    for label, vals, f in (("KDA+MoE", kda, work["kda_moe_flop"]), ("MLA+MoE", mlas, work["mla_moe_flop"])):
        table[label] = {"measured_ms_median": round(sorted(vals)[len(vals) // 2] * 1e3, 2) if vals else None,
                        "work_TFLOP": round(f / 1e12, 3), "work_ms_at_measured_gemm_rate": round(f / rate * 1e3, 2)}
    rows = []
    for name, s in per.items():
        f = flop[name.split(":", 1)[1]]
        rows.append({"layer": name, "ms": round(s * 1e3, 2), "work_TFLOP": round(f / 1e12, 3),
                     "work_ms": round(f / rate * 1e3, 2), "x_work": round(s / (f / rate), 2)})
    return {"table": table, "per_layer_vs_work": rows}


def profile_prefill_layers(bench, T):
    """torch.profiler kernel table of the first KDA+MoE and the first MLA layer alone at T tokens: written to
    ``bench.prof_out``; their kernel ms and top kernels returned."""
    from torch.profiler import ProfilerActivity, profile

    layers = bench.ours.model.layers
    li = next(i for i, l in enumerate(layers) if l.layer_type == LIN and hasattr(l.mlp, "experts"))
    mi = next(i for i, l in enumerate(layers) if l.layer_type == FULL)
    h = (torch.randn(1, T, bench.cfg.hidden_size, device=DEV, generator=bench.gen) * 0.5).to(torch.bfloat16)
    lines, out = [], {}
    for i in (li, mi):
        layer = layers[i]
        with torch.no_grad():
            layer(h, attention_mask=None, past_key_values=None)
            sync()
            with profile(activities=[ProfilerActivity.CUDA]) as p:
                layer(h, attention_mask=None, past_key_values=None)
                sync()
        evs = [e for e in p.key_averages() if e.device_type.name == "CUDA"]
        tot = sum(e.self_device_time_total for e in evs)
        evs.sort(key=lambda e: -e.self_device_time_total)
        lines.append(f"== layer {i} ({layer.layer_type}+moe) at T={T}: {sum(e.count for e in evs)} kernels, "
                     f"{tot / 1e3:.1f} ms of kernel time")
        lines += [f"{e.self_device_time_total / 1e3:9.2f} ms {e.count:5d}x  {e.key[:150]}" for e in evs[:40]]
        out[f"profile_layer{i}_kernel_ms"] = round(tot / 1e3, 2)
        out[f"profile_layer{i}_top"] = [(e.key[:90], round(e.self_device_time_total / 1e3, 2), e.count)
                                        for e in evs[:12]]
    with open(bench.prof_out, "w") as f:
        f.write("\n".join(lines) + "\n")
    return out


@section("census", need_s=15, needs=("cuda",), into=("ours", "decode_kernels_per_layer_eager"))
def census_section(bench):
    """Kernels one eager decode step of a layer launches (B=1, ``--decode-ctx`` static cache), per layer kind, each
    layer fed its real input (captured with hooks): count, kernel time, the bytes the layer must read and the
    bandwidth that achieves; and the whole step's count (each kind's count times its layers)."""
    from torch.profiler import ProfilerActivity, profile

    ours, cfg, T = bench.ours, bench.cfg, bench.args.decode_ctx
    dyn, last = ours_prefill(ours, cfg, bench.rand(1, T))
    st = to_static_cache(dyn, T + 8)
    del dyn
    first = last.argmax(-1, keepdim=True)
    snap = st.snapshot()
    calls, _ = capture_layer_calls(ours, lambda: ours(first, past_key_values=st, use_cache=True))
    st.restore(snap)
    out, kinds = {}, [layer_kind(l) for l in ours.model.layers]
    lat = T * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 2
    for i in bench.check_layers:
        layer = ours.model.layers[i]
        a, kw, _ = calls[i]
        with torch.no_grad():
            layer(*a, **kw)
            st.restore(snap)
            sync()
            with profile(activities=[ProfilerActivity.CUDA]) as p:
                layer(*a, **kw)
                sync()
            st.restore(snap)
        evs = [e for e in p.key_averages() if e.device_type.name == "CUDA"]
        us = sum(e.self_device_time_total for e in evs)
        nbytes = layer_weight_bytes(layer, cfg.num_experts_per_token) + (
            kda_state_bytes(cfg) if layer.layer_type == LIN else lat)
        out[f"layer{i}:{kinds[i]}"] = {
            "kernels": sum(e.count for e in evs), "kernel_us": round(us, 1),
            "layers_of_this_kind": kinds.count(kinds[i]),
            "bytes": nbytes, "achieved_GBps": round(nbytes / (us * 1e-6) / 1e9, 1) if us else None,
            "x_floor": round(bench.bps * us * 1e-6 / nbytes, 2) if us else None,
            "top": [(e.key[:80], e.count, round(e.self_device_time_total, 1))
                    for e in sorted(evs, key=lambda e: -e.self_device_time_total)[:8]]}
    out["step_kernels_from_layers"] = sum(v["kernels"] * v["layers_of_this_kind"] for v in out.values())
    return out


@section("parity", need_s=20, needs=("native",), into=("parity",))
def parity_section(bench):
    """Teacher-forced, layer by layer, bf16, ``--parity-T`` tokens: every layer of ours fed native's input to that
    layer, vs native's output (the layer's update too); compiled vs eager per layer likewise."""
    ours, native = bench.ours, bench.native
    ids = bench.rand(1, bench.args.parity_T)
    n_in, n_out, hooks = {}, {}, []
    for i, l in enumerate(native.model.layers):
        def pre(mod, a, kw, i=i):
            n_in[i] = (a[0] if a else kw["hidden_states"]).detach()

        def post(mod, a, kw, o, i=i):
            n_out[i] = (o[0] if isinstance(o, tuple) else o).detach()
        hooks += [l.register_forward_pre_hook(pre, with_kwargs=True), l.register_forward_hook(post, with_kwargs=True)]
    try:
        with torch.no_grad():
            nl = native(ids, use_cache=False).logits.float()
    finally:
        for hk in hooks:
            hk.remove()
    res = {"T": bench.args.parity_T, "dtype": "bf16", "per_layer_rel_err_ours_vs_native": {},
           "per_layer_update_rel_err_ours_vs_native": {}}
    with torch.no_grad():
        ol = ours(ids, use_cache=False).logits.float()
        for i, l in enumerate(ours.model.layers):
            o = l(n_in[i], attention_mask=None, past_key_values=None)[0]
            res["per_layer_rel_err_ours_vs_native"][i] = round(rel_err(o, n_out[i]), 5)
            # the layer's own update (output - input): the residual stream alone would hide its error
            res["per_layer_update_rel_err_ours_vs_native"][i] = round(
                rel_err(o.float() - n_in[i].float(), n_out[i].float() - n_in[i].float()), 5)
    res["end_to_end_logits_rel_err"] = rel_err(ol, nl)
    res["max_layer_rel_err"] = max(res["per_layer_rel_err_ours_vs_native"].values())
    bench.R["parity"] = res
    bench.save()
    if bench.compile_ok:
        compiled_vs_eager_layers(bench, n_in, res)
    return res


def compiled_vs_eager_layers(bench, n_in, res):
    """Each of ``bench.check_layers`` compiled vs eager, fed native's input to it (into ``res``)."""
    res["per_layer_rel_err_compiled_vs_eager"], res["per_layer_update_rel_err_compiled_vs_eager"] = {}, {}
    torch._dynamo.config.cache_size_limit = max(64, torch._dynamo.config.cache_size_limit)
    res["compiled_layers"] = "the first layer of each kind (KDA+dense, KDA+MoE, MLA+MoE)"
    for i in bench.check_layers:
        l = bench.ours.model.layers[i]
        if bench.left() < 40:
            res["compiled_vs_eager_stopped_at_layer"] = i
            break
        cl = torch.compile(l, dynamic=False)
        with torch.no_grad():
            e = l(n_in[i], attention_mask=None, past_key_values=None)[0].float()
            c = cl(n_in[i], attention_mask=None, past_key_values=None)[0].float()
        res["per_layer_rel_err_compiled_vs_eager"][i] = round(rel_err(c, e), 5)
        res["per_layer_update_rel_err_compiled_vs_eager"][i] = round(rel_err(c - n_in[i].float(),
                                                                             e - n_in[i].float()), 5)
        bench.R["parity"] = res
        bench.save()


@section("fp32", need_s=45, into=("fp32",))
def fp32_section(bench):
    """fp32 notes (:func:`fp32_notes`) in two subprocesses, Triton's fp32 dots as tf32 and as IEEE (the precision is
    read when kernels compile)."""
    out = {}
    for prec in ("tf32", "ieee"):
        if bench.left() < 45:
            out[prec] = "skipped: budget"
            continue
        env = dict(os.environ, TRITON_F32_DEFAULT=prec)
        cmd = [sys.executable, "-m", "kimi_hybrid.kernels.bench_h200", "--fp32-only"] + (
            ["--tiny"] if bench.args.tiny else [])
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=max(30, min(600, bench.left() - 10)))
        line = [x for x in p.stdout.splitlines() if x.startswith("FP32JSON ")]
        out[prec] = json.loads(line[-1][9:]) if line else {"rc": p.returncode, "stderr": p.stderr[-800:]}
    return out


# ------------------------------------------------------------------------------------------------------ main
TINY_SIZES = (("prefill", 512), ("decode_ctx", 64), ("decode_long_ctx", 256), ("batch32", 4), ("long", 1000),
              ("long_chunk", 300), ("parity_T", 64), ("gen_tokens", 4))


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=None, help="first N layers of the released plan (a slice)")
    ap.add_argument("--tiny", action="store_true", help="rehearsal on the tiny config (any device)")
    ap.add_argument("--skip-native", action="store_true")
    ap.add_argument("--prefill", type=int, default=131072)
    ap.add_argument("--decode-ctx", type=int, default=4096)
    ap.add_argument("--decode-long-ctx", type=int, default=131072)
    ap.add_argument("--batch32", type=int, default=32)
    ap.add_argument("--gen-tokens", type=int, default=32, help="n of the generate section: (t(n+1) - t(1)) / n")
    ap.add_argument("--long", type=int, default=1048576)
    ap.add_argument("--long-chunk", type=int, default=32768)
    ap.add_argument("--long-max-s", type=float, default=300.0, help="stop the long prefill after this many seconds")
    ap.add_argument("--long-reserve-s", type=float, default=110.0,
                    help="seconds of the budget the long prefill leaves for what follows it")
    ap.add_argument("--parity-T", type=int, default=512)
    ap.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated, from --list-sections")
    ap.add_argument("--list-sections", action="store_true", help="print the sections and exit")
    ap.add_argument("--budget-s", type=float, default=1e9, help="wall-clock seconds for the whole run")
    ap.add_argument("--no-compile", action="store_true", help="plain CUDA graphs only (no torch.compile)")
    ap.add_argument("--no-compile-decode2", action="store_true",
                    help="decode2 (128K, batch 32): plain CUDA graphs only (saves ~50 s of compilation per case)")
    ap.add_argument("--fp32-only", action="store_true", help="(internal) print the fp32 notes as JSON and exit")
    ap.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                    help="combine the results of several runs (later files fill what earlier ones lack) into --out")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "bench_h200.json"))
    ap.add_argument("--profile-out", default=None, help="kernel table file (default: next to --out)")
    args = ap.parse_args(argv)
    if args.tiny:  # rehearsal sizes, where not given
        for a, v in TINY_SIZES:
            if getattr(args, a) == ap.get_default(a):
                setattr(args, a, v)
    unknown = [s for s in args.sections.split(",") if s not in SECTIONS]
    if unknown:
        ap.error(f"--sections: unknown {unknown}; the sections are {','.join(SECTIONS)}")
    return args


def list_sections():
    for s in SECTIONS.values():
        needs = f" [needs {', '.join(s.needs)}]" if s.needs else ""
        print(f"{s.name:9s} ~{s.need_s:4.0f} s to start{needs}: {s.summary}")


def main(argv=None):
    args = parse_args(argv)
    if args.list_sections:
        return list_sections()
    if args.fp32_only:
        from kimi_hybrid.kernels.testing import limit_triton_autotuning  # one config per kernel: a probe, not a timing

        limit_triton_autotuning()
        print("FP32JSON " + json.dumps(fp32_notes(args.tiny)))
        return None
    if args.merge:
        return merge_results(args.merge, args.out)
    bench = Bench(args, args.layers or (4 if args.tiny else 27), time.perf_counter())
    chosen = set(args.sections.split(","))
    for sec in SECTIONS.values():
        if sec.name in chosen:
            bench.run(sec)
    bench.R["autotune_files_saved"] = save_autotune(bench.autotune_tgz)
    bench.save()
    print_table(bench.R)
    return bench.R


def merge_results(paths, out):
    """One record from several runs of the same model and commit (e.g. the long run in one device call, the rest in
    another): each section (and each of ``ours`` / ``native``'s measurements, each decode and generate case
    separately) is taken whole from the first file that has it non-empty, so list the preferred run first; errors
    and skipped sections are concatenated with the run they came from; the summary is recomputed."""
    runs = [json.load(open(p)) for p in paths]
    layers = {r["summary"].get("layers") for r in runs}
    if len(layers) != 1:
        raise SystemExit(f"--merge: the runs measured different depths {sorted(map(str, layers))}")
    M = {"merged_from": [{"file": os.path.basename(p), "started_utc": r.get("started_utc"),
                          "commit": r.get("versions", {}).get("commit"), "sections": r.get("args", {}).get("sections")}
                         for p, r in zip(paths, runs)], "errors": [], "skipped": {}}
    for p, r in zip(paths, runs):
        for k, v in r.items():
            if k in ("summary", "errors", "skipped", "merged_from"):
                continue
            if k in ("ours", "native"):
                dst = M.setdefault(k, {})
                for kk, vv in v.items():
                    if kk in ("decode", "generate") and isinstance(vv, dict) and isinstance(dst.get(kk), dict):
                        dst[kk] = {**{c: x for c, x in vv.items() if x}, **{c: x for c, x in dst[kk].items() if x}}
                    elif not dst.get(kk) and vv:
                        dst[kk] = vv
            elif not M.get(k) and v:
                M[k] = v
        M["errors"] += [{**e, "run": os.path.basename(p)} for e in r.get("errors", [])]
        M["skipped"].update({f"{os.path.basename(p)}: {k}": v for k, v in r.get("skipped", {}).items()})
    M["started_utc"] = runs[0].get("started_utc")
    defaults = vars(parse_args([]))
    M["summary"] = summarise(M, layers.pop(), argparse.Namespace(**{**defaults, **runs[0]["args"]}))
    with open(out, "w") as f:
        json.dump(M, f, indent=1, default=str)
    print_table(M)
    return M


def generate_summary(R, args):
    """The ``generate_*`` fields of the summary (ms per new token; the first call's overhead in seconds)."""
    gen = (R.get("ours") or {}).get("generate") or {}
    ngen = (R.get("native") or {}).get("generate") or {}
    ctx, lctx, b32 = args.decode_ctx, args.decode_long_ctx, args.batch32

    def g(key, field="ms_per_token", src=gen):
        r = src.get(key) or {}
        return r.get(field) if isinstance(r, dict) else None
    return {"generate_b1_4k_ms": g(f"B1_T{ctx}"), "generate_b1_128k_ms": g(f"B1_T{lctx}"),
            "generate_b32_4k_ms": g(f"B{b32}_T{ctx}"), "generate_sample_b1_4k_ms": g(f"B1_T{ctx}_sample"),
            "generate_beam4_4k_ms": g(f"B1_T{ctx}_beam4"), "generate_eager_b1_4k_ms": g(f"B1_T{ctx}_eager"),
            "generate_eager_mode": g(f"B1_T{ctx}_eager", "mode"),
            "generate_first_call_overhead_s": g(f"B1_T{ctx}", "first_call_overhead_s"),
            "native_generate_b1_4k_ms": g(f"B1_T{ctx}", src=ngen)}


def summarise(R, n_layers, args):
    """The record's ``summary``: what the README and the issues quote, from the sections' results."""
    o, n = R.get("ours", {}), R.get("native", {})
    dec = o.get("decode") or {}
    ndec = n.get("decode") or {}

    def d(key, field="ms_per_step", src=dec):
        r = src.get(key) or {}
        return r.get(field)
    long_ = o.get("long") or {}
    pre, npre = o.get("prefill") or {}, n.get("prefill") or {}
    v = R.get("versions", {})
    ctx, lctx, b32 = args.decode_ctx, args.decode_long_ctx, args.batch32
    cache = long_.get("cache_after_prefill") or {}
    return {
        "layers": n_layers, "slice": bool(R.get("setup", {}).get("slice")), "model": R.get("setup", {}).get("model"),
        "date": R.get("started_utc") or utc_now(), "commit": v.get("commit"), "gpu": v.get("gpu"),
        "versions": {k: v.get(k) for k in ("torch", "cuda", "transformers", "triton", "fla_core")},
        "hbm_GBps_measured": R.get("setup", {}).get("hbm_GBps"),
        "prefill_128k_s": {"ours": pre.get("s"), "native": npre.get("s")}, "prefill_tokens": pre.get("T"),
        "prefill_128k_tok_s": {"ours": pre.get("tok_s"), "native": npre.get("tok_s")},
        "prefill_128k_peak_over_weights_gib": pre.get("peak_over_weights_GiB"),
        **generate_summary(R, args),
        "decode_b1_4k_ms": d(f"B1_T{ctx}"), "decode_b1_4k_floor_ms": d(f"B1_T{ctx}", "floor_ms"),
        "decode_b1_128k_ms": d(f"B1_T{lctx}"), "decode_b1_128k_floor_ms": d(f"B1_T{lctx}", "floor_ms"),
        "decode_b32_4k_ms": d(f"B{b32}_T{ctx}"), "decode_b32_4k_floor_ms": d(f"B{b32}_T{ctx}", "floor_ms"),
        "native_decode_b1_4k_ms": d(f"B1_T{ctx}", src=ndec),
        "native_decode_b1_128k_ms": d(f"B1_T{lctx}", src=ndec),
        "native_decode_b32_4k_ms": d(f"B{b32}_T{ctx}", src=ndec),
        "long_1m": {"tokens": long_.get("tokens"), "asked_tokens": long_.get("asked_tokens"),
                    "complete": bool(long_) and long_.get("tokens") == long_.get("asked_tokens"),
                    "chunk": long_.get("chunk"), "prefill_s": long_.get("prefill_s"),
                    "peak_gib": long_.get("peak_GiB"),
                    "peak_over_weights_and_cache_gib": long_.get("peak_over_weights_and_cache_GiB"),
                    "decode_ms": long_.get("decode_ms"), "decode_floor_ms": long_.get("floor_ms"),
                    "cache_bytes_exact": cache.get("exact"), "cache_bytes": cache.get("total_bytes")},
        "errors": len(R.get("errors", [])), "skipped": sorted(R.get("skipped", {})),
    }


def print_table(R):
    s = R["summary"]
    f = lambda x, nd=3: "-" if x is None else (f"{x:.{nd}f}" if isinstance(x, float) else str(x))  # noqa: E731
    print(f"\n{s['model']} ({s['layers']} layers), {s['gpu']}, commit {s['commit']}, HBM {s['hbm_GBps_measured']} GB/s")
    print("| metric | ours | native | floor |")
    print("|---|---|---|---|")
    for k, nk, fk in (("generate_b1_4k", "native_generate_b1_4k_ms", "decode_b1_4k_floor_ms"),
                      ("generate_b1_128k", None, "decode_b1_128k_floor_ms"),
                      ("generate_b32_4k", None, "decode_b32_4k_floor_ms"),
                      ("generate_sample_b1_4k", None, None), ("generate_beam4_4k", None, None),
                      ("generate_eager_b1_4k", None, None)):
        print(f"| {k} ms/token | {f(s.get(f'{k}_ms'))} | {f(s.get(nk))} | {f(s.get(fk))} |")
    print(f"| generate first-call overhead s | {f(s.get('generate_first_call_overhead_s'))} | | |")
    p = s["prefill_128k_tok_s"]
    print(f"| prefill 128K tok/s | {f(p['ours'])} | {f(p['native'])} | |")
    for k, nk in (("decode_b1_4k", "native_decode_b1_4k_ms"), ("decode_b1_128k", "native_decode_b1_128k_ms"),
                  ("decode_b32_4k", "native_decode_b32_4k_ms")):
        ms, fl = s.get(f"{k}_ms"), s.get(f"{k}_floor_ms")
        x = f" ({ms / fl:.2f}x)" if ms and fl else ""
        print(f"| {k} ms (graph step) | {f(ms)}{x} | {f(s.get(nk))} | {f(fl)} |")
    lg = s["long_1m"]
    print(f"| long {lg['tokens']}: prefill s / peak GiB / decode ms / cache exact | {f(lg['prefill_s'])} / "
          f"{f(lg['peak_gib'])} / {f(lg['decode_ms'])} / {lg['cache_bytes_exact']} | | {f(lg['decode_floor_ms'])} |")
    print("errors:", [e["where"] for e in R["errors"]], "skipped:", list(R["skipped"]), "elapsed", R.get("elapsed_s"))


if __name__ == "__main__":
    main()
