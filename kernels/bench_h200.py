"""H200 benchmark: kimi-hybrid vs transformers' native ``kimi_linear`` (FLA path), same weights, one run.

Model (default): the FULL Kimi-Linear-48B-A3B depth in the released layer plan (27 layers: MLA at 0-based 3, 7, 11,
15, 19, 23, 26, KDA elsewhere; layer 0 dense MLP, 256 experts top-8 elsewhere; vocab 163840), random weights, bf16.
``--layers N`` benchmarks the first N layers of that plan instead (labelled a slice in the JSON); ``--tiny`` runs the
whole script on a tiny config (CPU or GPU) to rehearse it. The native model is built first (random init) and its
state dict is mapped into ours with ``kimi_hybrid.conversion.native.native_state_dict_views`` (tensors shared, not copied): both hold the same
weights.

Sections (each in its own try/except, the JSON rewritten after each; a wall-clock budget ``--budget-s`` skips what
would not finish, in this order of priority):
  setup      build, parameters, HBM bandwidth (device-to-device copy, read + write bytes) and bf16 GEMM rate measured
             now; the fused kernel the blockwise MLA chose (``mla_kimi_hybrid.fused_backend``)
  cold       first prefill (4K) of each model: Triton autotuning included
  prefill    128K tokens (``--prefill``), batch 1, one call: seconds, tokens/s, peak memory over the weights
  decode     batch 1 at 4K: CUDA graph over a static cache, torch.compile-d (``GraphDecoder(compile=True)``) and plain;
             native's own eager loop; ``compiled_check`` (:func:`decode_check`): the compiled step's logits vs eager
             read against the model's own sensitivity to one bf16 rounding, and per layer teacher-forced
  long       ``--long`` tokens (1M) prefilled in ``--long-chunk`` pieces through the cache (the MLA attends over the
             cached prefix key block by key block), then graph decoding; peak memory vs weights + cache; cache bytes
             vs the closed-form formula
  decode2    batch 1 at 128K and batch 32 at 4K (compiled graph while the budget allows, else plain), native likewise
  perlayer   per-layer prefill time at 128K (CUDA events), the work each layer kind must do, and a torch.profiler
             kernel table of one KDA+MoE and one MLA+MoE layer (written to ``--profile-out``); decode kernel count
             per layer kind (one eager step of a layer, profiled)
  parity     teacher-forced, layer by layer, bf16, T = 512: every layer of ours and of native fed the same input
             (native's own input to that layer); per-layer relative error; compiled vs eager per layer likewise
  fp32       fp32 on CUDA at small shapes: FLA ``chunk_kda`` (Triton fp32 dots: TF32 by default; IEEE when
             ``TRITON_F32_DEFAULT=ieee``) vs the fp64 reference, and whether a row's output depends on the other rows
             of the batch (:func:`batch_composition`: FLA chunk / recurrent KDA, our Triton KDA decode and expert
             GEMVs, the tiny model's logits; fp32 and bf16; a row alone vs inside batches of 2 .. 9); run in two
             subprocesses, one per dot precision
Floors: bytes a decode step must read (embedding rows, attention weights, router + shared expert + the routed experts
hit, final norm + lm_head, KDA states and MLA latents) / the HBM bandwidth measured in this run.

A top-level ``summary`` holds the record (layers, date, commit, gpu, prefill_128k_tok_s {ours, native},
decode_b1_4k_ms + floor, decode_b1_128k_ms + floor, decode_b32_4k_ms + floor, native_decode_b1_4k_ms,
long_1m {prefill_s, peak_gib, decode_ms, cache_bytes_exact}); a short table is printed last.

Usage (repo root on PYTHONPATH, FLA + transformers 5.23 importable):
    python -m kernels.bench_h200 --out results.json [--layers 27] [--budget-s 480]
    python -m kernels.bench_h200 --tiny --out tiny.json        # rehearsal, any device
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
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
    return {"kda_moe_flop": kda_proj + kda_core + moe, "mla_moe_flop": mla_proj + mla_attn + moe,
            "detail": {"moe": moe, "kda_proj": kda_proj, "kda_core_approx": kda_core, "mla_proj": mla_proj,
                       "mla_attention": mla_attn}}


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
                from kimi_hybrid.kernels.moe_gemv import moe_decode_gemv

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
            del k, v
    return out


# ------------------------------------------------------------------------------------------------------ main
def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=None, help="first N layers of the released plan (a slice)")
    ap.add_argument("--tiny", action="store_true", help="rehearsal on the tiny config (any device)")
    ap.add_argument("--skip-native", action="store_true")
    ap.add_argument("--prefill", type=int, default=131072)
    ap.add_argument("--decode-ctx", type=int, default=4096)
    ap.add_argument("--decode-long-ctx", type=int, default=131072)
    ap.add_argument("--batch32", type=int, default=32)
    ap.add_argument("--long", type=int, default=1048576)
    ap.add_argument("--long-chunk", type=int, default=32768)
    ap.add_argument("--long-max-s", type=float, default=300.0, help="stop the long prefill after this many seconds")
    ap.add_argument("--long-reserve-s", type=float, default=110.0,
                    help="seconds of the budget the long prefill leaves for what follows it")
    ap.add_argument("--parity-T", type=int, default=512)
    ap.add_argument("--sections", default="setup,mlaprobe,cold,prefill,long,decode,decode2,perlayer,parity,fp32")
    ap.add_argument("--budget-s", type=float, default=1e9, help="wall-clock seconds for the whole run")
    ap.add_argument("--no-compile", action="store_true", help="plain CUDA graphs only (no torch.compile)")
    ap.add_argument("--no-compile-decode2", action="store_true",
                    help="decode2 (128K, batch 32): plain CUDA graphs only (saves ~50 s of compilation per case)")
    ap.add_argument("--fp32-only", action="store_true", help="(internal) print the fp32 notes as JSON and exit")
    ap.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                    help="combine the results of several runs (later files fill what earlier ones lack) into --out")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "bench_h200.json"))
    ap.add_argument("--profile-out", default=None, help="kernel table file (default: next to --out)")
    args = ap.parse_args()
    if args.fp32_only:
        from kimi_hybrid.kernels.testing import limit_triton_autotuning  # one config per kernel: a probe, not a timing

        limit_triton_autotuning()
        print("FP32JSON " + json.dumps(fp32_notes(args.tiny)))
        return
    if args.merge:
        merge_results(args.merge, args.out)
        return
    t_start = time.perf_counter()
    n_layers = args.layers or (4 if args.tiny else 27)
    if args.tiny:  # rehearsal sizes
        for a, v in (("prefill", 512), ("decode_ctx", 64), ("decode_long_ctx", 256), ("batch32", 4), ("long", 1000),
                     ("long_chunk", 300), ("parity_T", 64)):
            if getattr(args, a) == ap.get_default(a):
                setattr(args, a, v)
    sections = args.sections.split(",")
    R = {"summary": {}, "started_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
         "versions": versions(), "args": vars(args), "setup": {}, "ours": {}, "native": {},
         "skipped": {}, "errors": []}
    prof_out = args.profile_out or os.path.join(os.path.dirname(os.path.abspath(args.out)), "profile_128k.txt")

    def left():
        return args.budget_s - (time.perf_counter() - t_start)

    def save():
        R["elapsed_s"] = round(time.perf_counter() - t_start, 1)
        R["summary"] = summarise(R, n_layers, args)
        with open(args.out, "w") as f:
            json.dump(R, f, indent=1, default=str)

    def guard(name, fn, need_s=0.0, into=None):
        """Run section ``fn`` unless unselected or out of budget; its result is stored at ``into`` = (dict, key)
        before the JSON is rewritten (a run killed later keeps it)."""
        if name.split(" ")[0] not in sections:
            return None
        if left() < need_s:
            R["skipped"][name] = f"{left():.0f} s left < {need_s:.0f} s estimated"
            print("SKIP", name, R["skipped"][name], flush=True)
            save()
            return None
        t0 = time.perf_counter()
        try:
            r = fn()
            if into is not None:
                into[0][into[1]] = r
            return r
        except Exception as e:  # noqa: BLE001
            R["errors"].append({"where": name, "error": f"{type(e).__name__}: {str(e)[:400]}",
                                "trace": traceback.format_exc()[-1500:]})
            print("ERROR", name, type(e).__name__, str(e)[:300], flush=True)
            return None
        finally:
            R.setdefault("section_s", {})[name] = round(time.perf_counter() - t0, 1)
            if CUDA:
                torch.cuda.empty_cache()
            save()

    # -- setup ---------------------------------------------------------------------------------------------------
    t_build, (native, ours, cfg) = timed(lambda: build(n_layers, args.tiny, args.skip_native))
    lt = list(cfg.layer_types)
    R["setup"] = {"model": ("tiny rehearsal config" if args.tiny else
                            ("FULL depth, released plan" if n_layers == 27 else f"SLICE: first {n_layers} layers")),
                  "layers": n_layers, "slice": n_layers != 27 or args.tiny,
                  "plan": {"kda": lt.count(LIN), "mla": lt.count(FULL),
                           "mla_at_0based": [i for i, t in enumerate(lt) if t == FULL],
                           "dense_at": [i for i, t in enumerate(cfg.mlp_layer_types) if t == "dense"]},
                  "params_B": round(sum(p.numel() for p in ours.parameters()) / 1e9, 3), "build_s": round(t_build, 1),
                  "weights_GiB": gib(param_bytes(ours)), "weights_bytes": param_bytes(ours)}
    weights_b = param_bytes(ours)
    gen = torch.Generator(device=DEV).manual_seed(0)
    rand = lambda B, T: torch.randint(0, cfg.vocab_size, (B, T), device=DEV, generator=gen)  # noqa: E731

    def measure_device():
        out = {}
        if CUDA:
            n = 2**30  # 2 GiB bf16 each way
            a = torch.empty(n, dtype=torch.bfloat16, device="cuda").normal_()
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
    R["setup"].update(guard("setup device", measure_device) or {})
    bps = (R["setup"].get("hbm_GBps") or HBM_BPS / 1e9) * 1e9
    print("setup", {k: v for k, v in R["setup"].items() if k != "mla_backend_checks"}, flush=True)
    save()

    # -- fused MLA key-block kernels: time per backend and key length (the long prefill's block shapes) ------------
    if CUDA:
        qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        R["mla_block_probe"] = guard("mlaprobe", lambda: mla_block_probe(
            cfg.num_attention_heads, qk, cfg.v_head_dim, min(args.long_chunk, 32768),
            [32768, 65536, 98304] if not args.tiny else [300, 700]), need_s=60, into=(R, "mla_block_probe"))
        print("mla block probe", R["mla_block_probe"], flush=True)
        probe = R.get("mla_block_probe") or {}
        if probe:  # fastest first, by each kernel's worst block shape (one slow shape is what a long run pays for)
            worst = {}
            for name in mla._FUSED:
                vals = [v["TFLOPs_useful"] for k, v in probe.items()
                        if k.startswith(name + "_") and isinstance(v, dict)]
                n_shapes = sum(1 for k in probe if k.startswith(name + "_"))
                worst[name] = min(vals) if vals and len(vals) == n_shapes else 0.0
            mla.FUSED_ORDER = tuple(sorted(worst, key=lambda n: -worst[n]))
            mla._CHOSEN.clear()
            R["mla_fused_order"] = {"order": mla.FUSED_ORDER, "worst_TFLOPs_useful": worst,
                                    "chosen": mla.fused_backend(torch.device(DEV), torch.bfloat16, qk, cfg.v_head_dim)}
            print("mla fused order", R["mla_fused_order"], flush=True)

    # -- cold ----------------------------------------------------------------------------------------------------
    def cold():
        ids = rand(1, 4096 if not args.tiny else 128)
        r = {}
        with torch.no_grad():
            r["ours_first_prefill_4096_s"] = round(timed(lambda: ours(ids, use_cache=False, logits_to_keep=1))[0], 2)
            if native is not None:
                r["native_first_prefill_4096_s"] = round(
                    timed(lambda: native(ids, use_cache=False, logits_to_keep=1))[0], 2)
        return r
    R["cold"] = guard("cold", cold, into=(R, "cold"))
    autotune_tgz = os.path.join(os.path.dirname(os.path.abspath(args.out)), "triton_autotune.tgz")
    R["autotune_files_saved"] = save_autotune(autotune_tgz)

    # -- prefill -------------------------------------------------------------------------------------------------
    def prefill(model):
        T = args.prefill
        ids = rand(1, T)
        with torch.no_grad():
            model(ids[:, :1024], use_cache=True, logits_to_keep=1)
            reset_peak()
            base = mem_alloc()
            first, _ = timed(lambda: model(ids, use_cache=True, logits_to_keep=1))
            reset_peak()
            dt, _ = timed(lambda: model(ids, use_cache=True, logits_to_keep=1))
        return {"T": T, "first_s": round(first, 3), "s": round(dt, 3), "tok_s": round(T / dt),
                "peak_GiB": gib(mem_peak()), "peak_over_weights_GiB": gib(mem_peak() - base)}
    for name, model in (("ours", ours), ("native", native)):
        if model is not None:
            R[name]["prefill"] = guard(f"prefill {name}", lambda m=model: prefill(m), need_s=40,
                                       into=(R[name], "prefill"))
            print(name, "prefill", R[name]["prefill"], flush=True)

    # -- decode (ours: graph over a static cache; native: its eager loop) -----------------------------------------
    def ours_decode(B, T, compile_, check_layers=()):
        ids = rand(B, T)
        dyn, last = ours_prefill(ours, cfg, ids, chunk=65536 // B if T * B > 65536 else None)
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
            key = "compiled_graph" if comp else "graph"
            res[key] = {"ms_per_step": round(pipe * 1e3, 4), "ms_synced": round(synced * 1e3, 4),
                        "build_s": round(tc, 1), "vs_eager_rel_err": ((got - ref).norm() / ref.norm()).item(),
                        "argmax_agrees_with_eager": bool((got.argmax(-1) == ref.argmax(-1)).all())}
            del dec
            if comp:  # is a compiled / eager difference a bug or this random model's sensitivity? (decode_check)
                try:
                    res["compiled_check"] = decode_check(ours, st, snap, first, got, check_layers, left)
                except Exception as e:  # noqa: BLE001
                    res["compiled_check"] = f"{type(e).__name__}: {str(e)[:300]}"
                st.restore(snap)
        fb, det = floor_bytes(ours, cfg, B, T)
        best = best_ms(res)
        res.update({"ms_per_step": best, "tokens_per_s": round(B / best * 1e3, 1),
                    "floor_ms": round(fb / bps * 1e3, 4), "x_floor": round(best / (fb / bps * 1e3), 2),
                    "floor_bytes": fb, "floor_detail": det, "cache": cache_check(st, cfg)})
        return res

    def native_dec(B, T):
        return {"B": B, "context": T, "ms_per_step": round(native_decode(native, rand(B, T)) * 1e3, 2)}

    # -- long context --------------------------------------------------------------------------------------------
    def run_long():
        L = args.long
        ids = rand(1, L)
        reset_peak()
        base = mem_alloc()
        chunk_s = []
        deadline = time.perf_counter() + min(args.long_max_s, left() - args.long_reserve_s)
        mla.PROFILE = [] if CUDA else None
        dt, (dyn, last) = timed(lambda: ours_prefill(ours, cfg, ids, chunk=args.long_chunk, times=chunk_s,
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
        res = {"tokens": L, "asked_tokens": args.long, "chunk": args.long_chunk, "prefill_s": round(dt, 2),
               "prefill_tok_s": round(L / dt),
               "chunk_s": chunk_s, "peak_GiB": gib(peak), "weights_GiB": gib(weights_b),
               "cache_GiB": gib(rep["total_bytes"]),
               "peak_over_weights_and_cache_GiB": gib(peak - weights_b - rep["total_bytes"]),
               "peak_over_start_GiB": gib(peak - base), "cache_after_prefill": rep,
               "mla_blocks_calls_s": {k: [v[0], round(v[1], 3)] for k, v in sorted(blocks.items())},
               "mla_backend_log": {str(k): v for k, v in mla._CHECK_LOG.items()},
               "mla_backend_failed": {str(k): sorted(v) for k, v in mla._FAILED.items()}}
        R["ours"]["long"] = res
        save()
        if True:
            dec = decoder(ours, st)
            pipe, synced = graph_decode_time(dec, last.argmax(-1, keepdim=True), steps=16)
            fb, det = floor_bytes(ours, cfg, 1, L)
            res.update({"decode": "CUDA graph, not compiled", "decode_ms": round(pipe * 1e3, 3),
                        "decode_ms_synced": round(synced * 1e3, 3), "floor_ms": round(fb / bps * 1e3, 3),
                        "x_floor": round(pipe / (fb / bps), 2), "cache_static": cache_check(st, cfg)})
            del dec
        return res
    R["ours"]["long"] = guard("long", run_long, need_s=150 if not args.tiny else 0, into=(R["ours"], "long"))
    R["autotune_files_saved"] = save_autotune(autotune_tgz)
    print("long", {k: v for k, v in (R["ours"]["long"] or {}).items() if k != "chunk_s"}, flush=True)

    compile_ok = CUDA and not args.no_compile
    R["ours"].setdefault("decode", {})
    R["native"].setdefault("decode", {})
    key = f"B1_T{args.decode_ctx}"
    kinds_seen, check_layers = set(), []
    for i, l in enumerate(ours.model.layers):  # the first layer of each kind: KDA+dense, KDA+MoE, MLA+MoE
        kind = (l.layer_type, hasattr(l.mlp, "experts"))
        if kind not in kinds_seen:
            kinds_seen.add(kind)
            check_layers.append(i)
    R["ours"]["decode"][key] = guard("decode ours b1", lambda: ours_decode(1, args.decode_ctx, compile_ok,
                                                                           check_layers), need_s=90,
                                     into=(R["ours"]["decode"], key))
    print("decode ours", key, R["ours"]["decode"][key], flush=True)
    if native is not None:
        R["native"]["decode"][key] = guard("decode native b1", lambda: native_dec(1, args.decode_ctx), need_s=20,
                                           into=(R["native"]["decode"], key))
        print("decode native", key, R["native"]["decode"][key], flush=True)

    # -- decode at 128K and batch 32 -----------------------------------------------------------------------------
    for B, T in ((1, args.decode_long_ctx), (args.batch32, args.decode_ctx)):
        key = f"B{B}_T{T}"
        comp = compile_ok and not args.no_compile_decode2 and left() > 170
        R["ours"]["decode"][key] = guard(f"decode2 ours {key}", lambda B=B, T=T, c=comp: ours_decode(B, T, c),
                                         need_s=60, into=(R["ours"]["decode"], key))
        print("decode ours", key, R["ours"]["decode"][key], flush=True)
        if native is not None:
            R["native"]["decode"][key] = guard(f"decode2 native {key}", lambda B=B, T=T: native_dec(B, T), need_s=40,
                                               into=(R["native"]["decode"], key))
            print("decode native", key, R["native"]["decode"][key], flush=True)

    # -- per-layer prefill, profile, decode kernel counts ----------------------------------------------------------
    def perlayer():
        T = args.prefill
        ids = rand(1, T)
        out = {"T": T}
        if CUDA:
            reset_peak()
            base = mem_alloc()
            total, per = prefill_layer_times(ours, ids)
            out["total_s"] = round(total, 3)
            out["peak_activation_GiB"] = gib(mem_peak() - base)
            out["layers_ms"] = {k: round(v * 1e3, 2) for k, v in per.items()}
            work = layer_work(cfg, T)
            rate = (R["setup"].get("bf16_gemm_TFLOPs") or 700) * 1e12
            kda = [v for k, v in per.items() if "linear" in k and "moe" in k]
            mlas = [v for k, v in per.items() if "full" in k]
            out["table"] = {
                "KDA+MoE": {"measured_ms_median": round(sorted(kda)[len(kda) // 2] * 1e3, 2) if kda else None,
                            "work_TFLOP": round(work["kda_moe_flop"] / 1e12, 3),
                            "work_ms_at_measured_gemm_rate": round(work["kda_moe_flop"] / rate * 1e3, 2)},
                "MLA+MoE": {"measured_ms_median": round(sorted(mlas)[len(mlas) // 2] * 1e3, 2) if mlas else None,
                            "work_TFLOP": round(work["mla_moe_flop"] / 1e12, 3),
                            "work_ms_at_measured_gemm_rate": round(work["mla_moe_flop"] / rate * 1e3, 2)},
                "work_detail_FLOP": work["detail"]}
            # profiler: one KDA+MoE and one MLA+MoE layer at T
            from torch.profiler import ProfilerActivity, profile

            li = next(i for i, l in enumerate(ours.model.layers) if l.layer_type == LIN and hasattr(l.mlp, "experts"))
            mi = next(i for i, l in enumerate(ours.model.layers) if l.layer_type == FULL)
            h = (torch.randn(1, T, cfg.hidden_size, device=DEV, generator=gen) * 0.5).to(torch.bfloat16)
            lines = []
            for i in (li, mi):
                layer = ours.model.layers[i]
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
                for e in evs[:40]:
                    lines.append(f"{e.self_device_time_total / 1e3:9.2f} ms {e.count:5d}x  {e.key[:150]}")
                out[f"profile_layer{i}_kernel_ms"] = round(tot / 1e3, 2)
                out[f"profile_layer{i}_top"] = [(e.key[:90], round(e.self_device_time_total / 1e3, 2), e.count)
                                                for e in evs[:12]]
            with open(prof_out, "w") as f:
                f.write("\n".join(lines) + "\n")
        return out
    R["ours"]["prefill_per_layer"] = guard("perlayer", perlayer, need_s=25,
                                           into=(R["ours"], "prefill_per_layer"))

    def decode_census():
        """Kernels one eager decode step of a layer launches (B=1, 4K static cache), per layer kind; each layer fed
        its real input of an eager step (inputs captured with hooks)."""
        from torch.profiler import ProfilerActivity, profile

        T = args.decode_ctx
        dyn, last = ours_prefill(ours, cfg, rand(1, T))
        st = to_static_cache(dyn, T + 8)
        del dyn
        first = last.argmax(-1, keepdim=True)
        snap = st.snapshot()
        calls, _ = capture_layer_calls(ours, lambda: ours(first, past_key_values=st, use_cache=True))
        st.restore(snap)
        out = {}
        seen = set()
        for i, l in enumerate(ours.model.layers):
            kind = f"{l.layer_type}+{'moe' if hasattr(l.mlp, 'experts') else 'dense'}"
            if kind in seen:
                continue
            seen.add(kind)
            a, kw, _ = calls[i]
            with torch.no_grad():
                l(*a, **kw)
                st.restore(snap)
                sync()
                with profile(activities=[ProfilerActivity.CUDA]) as p:
                    l(*a, **kw)
                    sync()
                st.restore(snap)
            evs = [e for e in p.key_averages() if e.device_type.name == "CUDA"]
            out[f"layer{i}:{kind}"] = {"kernels": sum(e.count for e in evs),
                                       "kernel_us": round(sum(e.self_device_time_total for e in evs), 1),
                                       "top": [(e.key[:80], e.count, round(e.self_device_time_total, 1))
                                               for e in sorted(evs, key=lambda e: -e.self_device_time_total)[:8]]}
        return out
    if CUDA:
        R["ours"]["decode_kernels_per_layer_eager"] = guard("perlayer census", decode_census, need_s=15,
                                                            into=(R["ours"], "decode_kernels_per_layer_eager"))

    # -- teacher-forced parity -----------------------------------------------------------------------------------
    def parity():
        T = args.parity_T
        ids = rand(1, T)
        n_in, n_out, hooks = {}, {}, []
        for i, l in enumerate(native.model.layers):
            def pre(mod, a, kw, i=i):
                n_in[i] = (a[0] if a else kw["hidden_states"]).detach()

            def post(mod, a, kw, o, i=i):
                n_out[i] = (o[0] if isinstance(o, tuple) else o).detach()
            hooks += [l.register_forward_pre_hook(pre, with_kwargs=True),
                      l.register_forward_hook(post, with_kwargs=True)]
        try:
            with torch.no_grad():
                nl = native(ids, use_cache=False).logits.float()
        finally:
            for hk in hooks:
                hk.remove()
        res = {"T": T, "dtype": "bf16", "per_layer_rel_err_ours_vs_native": {}}
        with torch.no_grad():
            ol = ours(ids, use_cache=False).logits.float()
            for i, l in enumerate(ours.model.layers):
                o = l(n_in[i], attention_mask=None, past_key_values=None)[0]
                res["per_layer_rel_err_ours_vs_native"][i] = round(rel_err(o, n_out[i]), 5)
                # the layer's own update (output - input): the residual stream alone would hide its error
                res.setdefault("per_layer_update_rel_err_ours_vs_native", {})[i] = round(
                    rel_err(o.float() - n_in[i].float(), n_out[i].float() - n_in[i].float()), 5)
        res["end_to_end_logits_rel_err"] = ((ol - nl).norm() / nl.norm()).item()
        errs = list(res["per_layer_rel_err_ours_vs_native"].values())
        res["max_layer_rel_err"] = max(errs)
        R["parity"] = res
        save()
        if compile_ok:  # compiled vs eager, each layer fed native's input to it
            res["per_layer_rel_err_compiled_vs_eager"] = {}
            torch._dynamo.config.cache_size_limit = max(64, torch._dynamo.config.cache_size_limit)
            res["compiled_layers"] = "the first layer of each kind (KDA+dense, KDA+MoE, MLA+MoE)"
            for i in check_layers:
                l = ours.model.layers[i]
                if left() < 40:
                    res["compiled_vs_eager_stopped_at_layer"] = i
                    break
                cl = torch.compile(l, dynamic=False)
                with torch.no_grad():
                    e = l(n_in[i], attention_mask=None, past_key_values=None)[0].float()
                    c = cl(n_in[i], attention_mask=None, past_key_values=None)[0].float()
                res["per_layer_rel_err_compiled_vs_eager"][i] = round(rel_err(c, e), 5)
                res.setdefault("per_layer_update_rel_err_compiled_vs_eager", {})[i] = round(
                    rel_err(c - n_in[i].float(), e - n_in[i].float()), 5)
                R["parity"] = res
                save()
        return res
    if native is not None:
        R["parity"] = guard("parity", parity, need_s=20, into=(R, "parity"))

    # -- fp32 notes (subprocesses: the Triton fp32 dot precision is read when kernels compile) --------------------
    def fp32():
        out = {}
        for prec in ("tf32", "ieee"):
            if left() < 45:
                out[prec] = "skipped: budget"
                continue
            env = dict(os.environ, TRITON_F32_DEFAULT=prec)
            cmd = [sys.executable, "-m", "kimi_hybrid.kernels.bench_h200", "--fp32-only"] + (["--tiny"] if args.tiny else [])
            p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=max(30, min(600, left() - 10)))
            line = [x for x in p.stdout.splitlines() if x.startswith("FP32JSON ")]
            out[prec] = json.loads(line[-1][9:]) if line else {"rc": p.returncode, "stderr": p.stderr[-800:]}
        return out
    R["fp32"] = guard("fp32", fp32, need_s=45, into=(R, "fp32"))
    R["autotune_files_saved"] = save_autotune(autotune_tgz)
    save()
    print_table(R)


def merge_results(paths, out):
    """One record from several runs of the same model and commit (e.g. the long run in one device call, the rest in
    another): each section (and each of ``ours`` / ``native``'s measurements, each decode case separately) is taken
    whole from the first file that has it non-empty, so list the preferred run first; errors and skipped sections
    are concatenated with the run they came from; the summary is recomputed."""
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
                    if kk == "decode" and isinstance(vv, dict) and isinstance(dst.get(kk), dict):  # per case
                        dst[kk] = {**{c: x for c, x in vv.items() if x}, **{c: x for c, x in dst[kk].items() if x}}
                    elif not dst.get(kk) and vv:
                        dst[kk] = vv
            elif not M.get(k) and v:
                M[k] = v
        M["errors"] += [{**e, "run": os.path.basename(p)} for e in r.get("errors", [])]
        M["skipped"].update({f"{os.path.basename(p)}: {k}": v for k, v in r.get("skipped", {}).items()})
    M["started_utc"] = runs[0].get("started_utc")
    M["summary"] = summarise(M, layers.pop(), argparse.Namespace(**runs[0]["args"]))
    with open(out, "w") as f:
        json.dump(M, f, indent=1, default=str)
    print_table(M)


def summarise(R, n_layers, args):
    o, n = R.get("ours", {}), R.get("native", {})
    dec = o.get("decode") or {}
    ndec = n.get("decode") or {}

    def d(key, field="ms_per_step", src=dec):
        r = src.get(key) or {}
        return r.get(field)
    long_ = o.get("long") or {}
    pre, npre = o.get("prefill") or {}, n.get("prefill") or {}
    v = R.get("versions", {})
    return {
        "layers": n_layers, "slice": bool(R.get("setup", {}).get("slice")), "model": R.get("setup", {}).get("model"),
        "date": R.get("started_utc") or datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": v.get("commit"), "gpu": v.get("gpu"),
        "versions": {k: v.get(k) for k in ("torch", "cuda", "transformers", "triton", "fla_core")},
        "hbm_GBps_measured": R.get("setup", {}).get("hbm_GBps"),
        "prefill_128k_s": {"ours": pre.get("s"), "native": npre.get("s")}, "prefill_tokens": pre.get("T"),
        "prefill_128k_tok_s": {"ours": pre.get("tok_s"), "native": npre.get("tok_s")},
        "prefill_128k_peak_over_weights_gib": pre.get("peak_over_weights_GiB"),
        "decode_b1_4k_ms": d(f"B1_T{args.decode_ctx}"),
        "decode_b1_4k_floor_ms": d(f"B1_T{args.decode_ctx}", "floor_ms"),
        "decode_b1_128k_ms": d(f"B1_T{args.decode_long_ctx}"),
        "decode_b1_128k_floor_ms": d(f"B1_T{args.decode_long_ctx}", "floor_ms"),
        "decode_b32_4k_ms": d(f"B{args.batch32}_T{args.decode_ctx}"),
        "decode_b32_4k_floor_ms": d(f"B{args.batch32}_T{args.decode_ctx}", "floor_ms"),
        "native_decode_b1_4k_ms": d(f"B1_T{args.decode_ctx}", src=ndec),
        "native_decode_b1_128k_ms": d(f"B1_T{args.decode_long_ctx}", src=ndec),
        "native_decode_b32_4k_ms": d(f"B{args.batch32}_T{args.decode_ctx}", src=ndec),
        "long_1m": {"tokens": long_.get("tokens"), "asked_tokens": long_.get("asked_tokens"),
                    "complete": bool(long_) and long_.get("tokens") == long_.get("asked_tokens"),
                    "chunk": long_.get("chunk"), "prefill_s": long_.get("prefill_s"),
                    "peak_gib": long_.get("peak_GiB"),
                    "peak_over_weights_and_cache_gib": long_.get("peak_over_weights_and_cache_GiB"),
                    "decode_ms": long_.get("decode_ms"), "decode_floor_ms": long_.get("floor_ms"),
                    "cache_bytes_exact": (long_.get("cache_after_prefill") or {}).get("exact"),
                    "cache_bytes": (long_.get("cache_after_prefill") or {}).get("total_bytes")},
        "errors": len(R.get("errors", [])), "skipped": sorted(R.get("skipped", {})),
    }


def print_table(R):
    s = R["summary"]
    f = lambda x, nd=3: "-" if x is None else (f"{x:.{nd}f}" if isinstance(x, float) else str(x))  # noqa: E731
    print(f"\n{s['model']} ({s['layers']} layers), {s['gpu']}, commit {s['commit']}, HBM {s['hbm_GBps_measured']} GB/s")
    print("| metric | ours | native | floor |")
    print("|---|---|---|---|")
    p = s["prefill_128k_tok_s"]
    print(f"| prefill 128K tok/s | {f(p['ours'])} | {f(p['native'])} | |")
    for k, nk in (("decode_b1_4k", "native_decode_b1_4k_ms"), ("decode_b1_128k", "native_decode_b1_128k_ms"),
                  ("decode_b32_4k", "native_decode_b32_4k_ms")):
        ms, fl = s.get(f"{k}_ms"), s.get(f"{k}_floor_ms")
        x = f" ({ms / fl:.2f}x)" if ms and fl else ""
        print(f"| {k} ms | {f(ms)}{x} | {f(s.get(nk))} | {f(fl)} |")
    lg = s["long_1m"]
    print(f"| long {lg['tokens']}: prefill s / peak GiB / decode ms / cache exact | {f(lg['prefill_s'])} / "
          f"{f(lg['peak_gib'])} / {f(lg['decode_ms'])} / {lg['cache_bytes_exact']} | | {f(lg['decode_floor_ms'])} |")
    print("errors:", [e["where"] for e in R["errors"]], "skipped:", list(R["skipped"]), "elapsed", R.get("elapsed_s"))


if __name__ == "__main__":
    main()
