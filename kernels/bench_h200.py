"""H200 benchmark: kimi-hybrid vs transformers' native ``kimi_linear`` (FLA path), same weights, one run.

Model: a depth-reduced slice of Kimi-Linear-48B-A3B with the real widths (default 4 layers: KDA+dense, KDA+MoE,
KDA+MoE, MLA+MoE; 256 experts top-8; vocab 163840), random weights, bf16. The native model is built first
(random init) and its state dict is mapped into ours with ``conversion/native.py: native_state_dict_views``
(tensors shared, not copied), so both models hold the same weights.

Measured (each with ``torch.cuda.synchronize`` around wall-clock timers, after a warm-up call; the very first call
of each model is reported separately as the cold start, Triton autotuning included):
  * prefill tokens/s at each context (batch 1), peak GPU memory;
  * decode ms/token at batch 1 with each context and at batch 32: ours = one CUDA-graph replay per token over a
    static cache (``kernels/cuda_graph.py``), also eager for reference; native = its own eager loop with its cache;
  * per-layer decode cost (each decoder layer captured in its own graph) and per-layer prefill cost (CUDA events),
    extrapolated to the full 27-layer model (1 KDA+dense, 19 KDA+MoE, 7 MLA+MoE + embedding / head);
  * cache bytes: ``cache.memory_report()`` vs the closed-form formula;
  * HBM floor of a decode step: bytes that must be read (embedding rows, attention weights, router + shared expert
    + the routed experts hit, final norm + lm_head, the KDA states and the MLA latents of the context) / 4.8 TB/s;
  * long context: a chunked prefill of ``--long`` tokens through the cache, then graph decoding.

Usage (from the repo root, FLA + transformers >= 5.23 importable):
    python kernels/bench_h200.py --out results.json [--contexts 4096,32768,131072] [--long 1048576]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import time
import traceback

import torch


from kimi_hybrid.conversion.native import native_state_dict_views  # noqa: E402
from kimi_hybrid.kernels.cuda_graph import GraphDecoder, to_static_cache  # noqa: E402
from kimi_hybrid import KimiHybridCache, KimiHybridConfig, KimiHybridForCausalLM  # noqa: E402

HBM_BPS = 4.8e12
LIN, FULL = "linear_attention", "full_attention"


def sync():
    torch.cuda.synchronize()


def timed(fn):
    sync()
    t = time.perf_counter()
    r = fn()
    sync()
    return time.perf_counter() - t, r


def gib(x):
    return round(x / 2**30, 3)


def versions():
    out = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(), "python": platform.python_version(),
           "cuda": torch.version.cuda, "commit": os.environ.get("GIT_COMMIT", "unknown"), "host": platform.node()}
    for mod in ("transformers", "triton", "fla"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception as e:  # noqa: BLE001
            out[mod] = f"missing: {e}"
    try:
        out["fla_core"] = __import__("importlib.metadata").metadata.version("fla-core")
    except Exception:  # noqa: BLE001
        pass
    return out


# ------------------------------------------------------------------------------------------------------ models
def our_config(n_layers):
    layer_types = [LIN if (i % 4) != 3 else FULL for i in range(n_layers)]
    mlp_types = ["dense"] + ["sparse"] * (n_layers - 1)
    return KimiHybridConfig.from_preset(
        "kimi-linear-48b-a3b", num_hidden_layers=n_layers, layer_types=layer_types, mlp_layer_types=mlp_types,
        linear_attn_config={"head_dim": 128, "num_heads": 32, "short_conv_kernel_size": 4})


def build_ours_only(n_layers):
    cfg = our_config(n_layers)
    torch.manual_seed(0)
    with torch.device("cuda"):
        torch.set_default_dtype(torch.bfloat16)
        ours = KimiHybridForCausalLM(cfg).eval()
        torch.set_default_dtype(torch.float32)
    return None, ours, cfg


def build(n_layers):
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    layer_types = [LIN if (i % 4) != 3 else FULL for i in range(n_layers)]
    mlp_types = ["dense"] + ["sparse"] * (n_layers - 1)
    ncfg = KimiLinearConfig(
        vocab_size=163840, hidden_size=2304, intermediate_size=9216, moe_intermediate_size=1024,
        num_hidden_layers=n_layers, layer_types=layer_types, mlp_layer_types=mlp_types,
        linear_num_heads=32, linear_head_dim=128, linear_conv_kernel_dim=4,
        num_attention_heads=32, num_key_value_heads=32, kv_lora_rank=512, q_lora_rank=None,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        num_local_experts=256, num_experts_per_tok=8, n_shared_experts=1, n_group=1, topk_group=1,
        routed_scaling_factor=2.446, tie_word_embeddings=False, max_position_embeddings=1048576,
    )
    ncfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device("cuda"):
        torch.set_default_dtype(torch.bfloat16)
        native = KimiLinearForCausalLM(ncfg).eval()
        torch.set_default_dtype(torch.float32)
    cfg = our_config(n_layers)
    with torch.device("meta"):
        ours = KimiHybridForCausalLM(cfg)
    mapped = native_state_dict_views(native.state_dict())
    missing, unexpected = ours.load_state_dict(mapped, strict=False, assign=True)
    if missing or unexpected:
        raise RuntimeError(f"weight mapping: missing {missing[:5]}, unexpected {unexpected[:5]}")
    ours.eval()
    return native, ours, cfg


# ------------------------------------------------------------------------------------------------------ floor
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


def floor_bytes(model, cfg, B, ctx, n_layers_full=None):
    """(bytes, detail) a decode step of batch B at context ctx must read; with ``n_layers_full`` extrapolated to the
    27-layer plan of the full model (per-layer bytes of the slice's layer kinds)."""
    D = cfg.hidden_size
    E, k = cfg.num_experts, cfg.num_experts_per_token
    dist = min(E, expected_distinct(E, k, B)) if B > 1 else k
    layers = model.model.layers
    kinds = {}
    for l in layers:
        kind = (l.layer_type, "moe" if hasattr(l.mlp, "experts") else "dense")
        kinds[kind] = layer_weight_bytes(l, dist)
    emb = B * D * model.model.embed_tokens.weight.element_size()
    head = param_bytes(model.lm_head) + param_bytes(model.model.norm)
    H, K, W = 32, 128, 4
    kda_state = B * (3 * H * K * (W - 1) * 2 + H * K * K * 4)
    lat = B * ctx * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 2
    plan = [(l.layer_type, "moe" if hasattr(l.mlp, "experts") else "dense") for l in layers]
    if n_layers_full is not None:
        full = KimiHybridConfig.from_preset("kimi-linear-48b-a3b")
        plan = [(t, m if m == "dense" else "moe") for t, m in zip(full.layer_types,
                                                                  ["dense" if x == "dense" else "moe"
                                                                   for x in full.mlp_layer_types])]
    w = emb + head + sum(kinds[p] for p in plan)
    cache = sum(kda_state if t == LIN else lat for t, _ in plan)
    return w + cache, {"weights": w, "cache": cache, "distinct_experts_per_moe_layer": round(dist, 1),
                       "per_layer_kind_weight_bytes": {f"{a}+{b}": v for (a, b), v in kinds.items()},
                       "plan": f"{sum(1 for p in plan if p[0] == LIN)} KDA + {sum(1 for p in plan if p[0] == FULL)} MLA"}


# ------------------------------------------------------------------------------------------------------ ours
@torch.no_grad()
def ours_prefill(model, cfg, ids, chunk=None, times=None):
    """Prefill through a dynamic cache, in pieces of ``chunk`` tokens; ``times`` (a list) receives each piece's
    seconds."""
    cache = KimiHybridCache(cfg)
    T = ids.shape[1]
    step = chunk or T
    out = None
    for s in range(0, T, step):
        t0 = time.perf_counter()
        out = model(ids[:, s:s + step], past_key_values=cache, use_cache=True, logits_to_keep=1)
        if times is not None:
            sync()
            times.append(round(time.perf_counter() - t0, 3))
    return cache, out.logits[:, -1]


def cache_check(cache, cfg):
    rep = cache.memory_report()
    B, T = rep["batch_size"], cache.seen_tokens
    n_kda, n_mla = cfg.layer_types.count(LIN), cfg.layer_types.count(FULL)
    rows = cache.max_cache_len if cache.static else T
    formula_kda = B * n_kda * (3 * 32 * 128 * 3 * 2 + 32 * 128 * 128 * 4)
    formula_mla = B * n_mla * rows * 576 * 2
    return {"seen_tokens": T, "static": cache.static, "rows_held": rows, "kda_bytes": rep["kda_bytes"],
            "kda_formula": formula_kda, "mla_bytes": rep["mla_bytes"], "mla_formula": formula_mla,
            "mask_bytes": rep["mask_bytes"], "total_bytes": rep["total_bytes"],
            "exact": rep["kda_bytes"] == formula_kda and rep["mla_bytes"] == formula_mla}


@torch.no_grad()
def graph_decode_time(dec, first, steps=48, warm=4):
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


@torch.no_grad()
def per_layer_decode(model, cache, B, reps=50):
    """Each decoder layer (and the head) captured in its own CUDA graph at the cache's current length."""
    dev = cache._pos.device
    D = model.config.hidden_size
    keys = cache.key_mask.clone()
    keys[:, : cache.seen_tokens + 1] = True
    mask = model.model._mla_mask(B, 1, cache.seen_tokens, keys, None, cache, dev)
    ctx = {"token_mask": None, "cu_seqlens": None, "mla_mask": mask}
    h = torch.randn(B, 1, D, device=dev, dtype=torch.bfloat16) * 0.1
    snap = cache.snapshot()
    out = {}
    fns = [(f"layer{i}:{l.layer_type}+{'moe' if hasattr(l.mlp, 'experts') else 'dense'}",
            (lambda l=l: l(h, cache, ctx, None)[0])) for i, l in enumerate(model.model.layers)]
    fns.append(("norm+lm_head", lambda: model.lm_head(model.model.norm(h))))
    fns.append(("embedding", lambda: model.model.embed_tokens(torch.zeros(B, 1, dtype=torch.long, device=dev))))
    for name, fn in fns:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn()
            fn()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        g.replay()
        sync()
        t = time.perf_counter()
        for _ in range(reps):
            g.replay()
        sync()
        out[name] = (time.perf_counter() - t) / reps
        del g
    cache.restore(snap)
    return out


def prefill_layer_times(model, ids):
    """CUDA-event time of each decoder layer in one prefill (no cache)."""
    evs = {}
    hooks = []
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
            sync()
            t = time.perf_counter()
            model(ids, use_cache=False, logits_to_keep=1)
            sync()
            total = time.perf_counter() - t
    finally:
        for h in hooks:
            h.remove()
    per = {f"layer{i}:{model.model.layers[i].layer_type}": a.elapsed_time(b) / 1e3 for i, (a, b) in evs.items()}
    return total, per


# ------------------------------------------------------------------------------------------------------ native
@torch.no_grad()
def native_decode(model, ids, steps=16):
    o = model(ids, use_cache=True, logits_to_keep=1)
    pkv = o.past_key_values
    nxt = o.logits[:, -1:].argmax(-1)
    times = []
    for _ in range(steps + 3):
        sync()
        t = time.perf_counter()
        o = model(nxt, past_key_values=pkv, use_cache=True)
        sync()
        times.append(time.perf_counter() - t)
        pkv = o.past_key_values
        nxt = o.logits[:, -1:].argmax(-1)
    times = sorted(times[3:])
    return times[len(times) // 2]


# ------------------------------------------------------------------------------------------------------ main
def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--contexts", default="4096,32768,131072")
    ap.add_argument("--decode-contexts", default="4096,131072")
    ap.add_argument("--batch32-context", type=int, default=4096)
    ap.add_argument("--long", default="262144")
    ap.add_argument("--long-chunk", type=int, default=65536)
    ap.add_argument("--long-budget-s", type=float, default=150.0)
    ap.add_argument("--skip-native", action="store_true", help="build ours alone (its own random init)")
    ap.add_argument("--sections", default="prefill,decode,long")
    ap.add_argument("--compile-decode", action="store_true",
                    help="also time the torch.compile-d step captured in a CUDA graph (GraphDecoder(compile=True))")
    ap.add_argument("--long-warmup", action="store_true",
                    help="before each long run, prefill two chunks untimed (first calls at the chunk shapes)")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "bench_h200.json"))
    args = ap.parse_args()
    R = {"versions": versions(), "args": vars(args), "setup": {}, "ours": {}, "native": {}, "errors": []}

    def save():
        with open(args.out, "w") as f:
            json.dump(R, f, indent=1, default=str)

    def guard(name, fn):
        try:
            return fn()
        except Exception as e:  # noqa: BLE001
            R["errors"].append({"where": name, "error": f"{type(e).__name__}: {str(e)[:400]}",
                                "trace": traceback.format_exc()[-1500:]})
            print("ERROR", name, e, flush=True)
            torch.cuda.empty_cache()
        finally:
            save()

    sections = set(args.sections.split(","))
    t_build, (native, ours, cfg) = timed(lambda: (build_ours_only if args.skip_native else build)(args.layers))
    R["setup"] = {"slice": f"{args.layers} layers {cfg.layer_types} / {cfg.mlp_layer_types}, real 48B-A3B widths",
                  "params_B": round(sum(p.numel() for p in ours.parameters()) / 1e9, 3), "build_s": round(t_build, 1),
                  "weights_GiB": gib(param_bytes(ours))}
    gen = torch.Generator(device="cuda").manual_seed(0)
    rand = lambda B, T: torch.randint(0, cfg.vocab_size, (B, T), device="cuda", generator=gen)  # noqa: E731

    # cold start: the first call of each model (ours first: FLA autotuning lands on it)
    ids = rand(1, 4096)
    with torch.no_grad():
        R["ours"]["cold_first_prefill_4096_s"] = round(timed(lambda: ours(ids, use_cache=False, logits_to_keep=1))[0], 2)
        if not args.skip_native:
            R["native"]["cold_first_prefill_4096_s"] = round(
                timed(lambda: native(ids, use_cache=False, logits_to_keep=1))[0], 2)
        if not args.skip_native:
            # parity: same weights -> same logits (bf16)
            a = ours(ids[:, :512], use_cache=False).logits.float()
            b = native(ids[:, :512], use_cache=False).logits.float()
            R["setup"]["parity_rel_rms_ours_vs_native_bf16"] = ((a - b).norm() / b.norm()).item()
            R["setup"]["parity_argmax_agree"] = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
            del a, b
    save()

    # -- prefill -------------------------------------------------------------------------------------------------
    for T in [int(x) for x in args.contexts.split(",")] if "prefill" in sections else []:
        ids = rand(1, T)
        for name, model in (("ours", ours), ("native", native)):
            if name == "native" and args.skip_native:
                continue

            def run(model=model):
                with torch.no_grad():
                    model(ids[:, :1024], use_cache=True, logits_to_keep=1)  # warm
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats()
                    base = torch.cuda.memory_allocated()
                    first, _ = timed(lambda: model(ids, use_cache=True, logits_to_keep=1))
                    dt, _ = timed(lambda: model(ids, use_cache=True, logits_to_keep=1))
                    return {"first_s": round(first, 3), "s": round(dt, 3), "tok_s": round(T / dt),
                            "peak_GiB": gib(torch.cuda.max_memory_allocated()),
                            "peak_over_weights_GiB": gib(torch.cuda.max_memory_allocated() - base)}
            r = guard(f"prefill {name} {T}", run)
            R[name].setdefault("prefill", {})[str(T)] = r
            print(name, "prefill", T, r, flush=True)
        torch.cuda.empty_cache()
    if "prefill" in sections:
        T = max(int(x) for x in args.contexts.split(","))
        r = guard("prefill per layer", lambda: prefill_layer_times(ours, rand(1, T)))
        if r:
            R["ours"]["prefill_per_layer_s"] = {"T": T, "total_s": r[0], "layers": r[1]}

    # -- decode --------------------------------------------------------------------------------------------------
    def ours_decode(B, T):
        ids = rand(B, T)
        dyn, last = ours_prefill(ours, cfg, ids)
        dyn_rep = cache_check(dyn, cfg)
        st = to_static_cache(dyn, T + 256)
        del dyn
        torch.cuda.empty_cache()
        first = last.argmax(-1, keepdim=True)
        # eager steps on the static cache (reference for the graph's effect)
        snap = st.snapshot()
        eager = []
        with torch.no_grad():
            nxt = first
            for _ in range(6):
                dt, o = timed(lambda: ours(nxt, past_key_values=st, use_cache=True))
                eager.append(dt)
                nxt = o.logits[:, -1].argmax(-1, keepdim=True)
        st.restore(snap)
        del snap
        t_cap, dec = timed(lambda: GraphDecoder(ours, st))
        # correctness: graph step == eager step from the same state
        snap = st.snapshot()
        with torch.no_grad():
            ref = ours(first, past_key_values=st, use_cache=True).logits[:, -1].float()
        st.restore(snap)
        got = dec.step(first).float()
        err = ((got - ref).norm() / ref.norm()).item()
        st.restore(snap)
        pipelined, synced = graph_decode_time(dec, first)
        del dec
        comp = {}
        if args.compile_decode:  # the same step through torch.compile, then captured; from the same state
            st.restore(snap)
            t_comp, cdec = timed(lambda: GraphDecoder(ours, st, compile=True))
            st.restore(snap)
            got_c = cdec.step(first).float()
            st.restore(snap)
            c_pipe, c_sync = graph_decode_time(cdec, first)
            comp = {"compiled_graph_ms_per_step": round(c_pipe * 1e3, 4),
                    "compiled_graph_ms_per_step_synced": round(c_sync * 1e3, 4),
                    "compiled_tokens_per_s": round(B / c_pipe, 1), "compile_and_capture_s": round(t_comp, 1),
                    "compiled_vs_eager_rel_err": ((got_c - ref).norm() / ref.norm()).item()}
            del cdec
        st.restore(snap)
        del snap
        per_layer = per_layer_decode(ours, st, B) if B == 1 else None
        torch.cuda.reset_peak_memory_stats()
        return {"B": B, "context": T, **comp, "graph_ms_per_step": round(pipelined * 1e3, 4),
                "graph_ms_per_step_synced": round(synced * 1e3, 4),
                "tokens_per_s": round(B / pipelined, 1),
                "eager_ms_per_step_median": round(1e3 * sorted(eager[1:])[len(eager[1:]) // 2], 2),
                "capture_s": round(t_cap, 2), "graph_vs_eager_rel_err": err,
                "cache_after_prefill": dyn_rep, "cache_static": cache_check(st, cfg),
                "per_layer_ms": {k: round(v * 1e3, 4) for k, v in per_layer.items()} if per_layer else None}

    def native_dec(B, T):
        return {"B": B, "context": T, "ms_per_step_median": round(native_decode(native, rand(B, T)) * 1e3, 2)}

    cases = [(1, int(x)) for x in args.decode_contexts.split(",")] + [(32, args.batch32_context)]
    cases = cases if "decode" in sections else []
    for B, T in cases:
        r = guard(f"decode ours B{B} T{T}", lambda: ours_decode(B, T))
        R["ours"].setdefault("decode", {})[f"B{B}_T{T}"] = r
        print("ours decode", B, T, {k: v for k, v in (r or {}).items() if k != "per_layer_ms"}, flush=True)
        torch.cuda.empty_cache()
        if not args.skip_native:
            r = guard(f"decode native B{B} T{T}", lambda: native_dec(B, T))
            R["native"].setdefault("decode", {})[f"B{B}_T{T}"] = r
            print("native decode", B, T, r, flush=True)
            torch.cuda.empty_cache()
        fb, det = floor_bytes(ours, cfg, B, T)
        fb27, det27 = floor_bytes(ours, cfg, B, T, n_layers_full=27)
        R.setdefault("floor", {})[f"B{B}_T{T}"] = {"bytes": fb, "ms": fb / HBM_BPS * 1e3, "detail": det,
                                                   "full27_bytes": fb27, "full27_ms": fb27 / HBM_BPS * 1e3,
                                                   "full27_detail": det27}
        save()

    # -- long context --------------------------------------------------------------------------------------------
    del native
    torch.cuda.empty_cache()
    t_used = 0.0
    for L in [int(x) for x in args.long.split(",") if x] if "long" in sections else []:
        if t_used and t_used * (L / prev) ** 2 > args.long_budget_s:  # noqa: F821
            R["ours"].setdefault("long", {})[str(L)] = {"skipped": f"projected {t_used * (L / prev) ** 2:.0f} s "
                                                                  f"> budget {args.long_budget_s} s"}
            continue

        def run_long(L=L):
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            ids = rand(1, L)
            warm_s = None
            if args.long_warmup:
                warm_s, (w, _) = timed(lambda: ours_prefill(ours, cfg, ids[:, :2 * args.long_chunk],
                                                            chunk=args.long_chunk))
                del w
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            chunk_s = []
            dt, (dyn, last) = timed(lambda: ours_prefill(ours, cfg, ids, chunk=args.long_chunk, times=chunk_s))
            peak_prefill = torch.cuda.max_memory_allocated()
            rep_dyn = cache_check(dyn, cfg)
            st = to_static_cache(dyn, L + 128)
            del dyn
            torch.cuda.empty_cache()
            dec = GraphDecoder(ours, st)
            pipelined, synced = graph_decode_time(dec, last.argmax(-1, keepdim=True), steps=32)
            return {"tokens": L, "chunk": args.long_chunk, "prefill_s": round(dt, 2), "prefill_tok_s": round(L / dt),
                    "chunk_s": chunk_s, "warmup_two_chunks_s": warm_s, "decode": "CUDA graph, not compiled",
                    "peak_prefill_GiB": gib(peak_prefill), "peak_GiB": gib(torch.cuda.max_memory_allocated()),
                    "decode_ms_per_step": round(pipelined * 1e3, 4), "decode_ms_synced": round(synced * 1e3, 4),
                    "cache_after_prefill": rep_dyn, "cache_static": cache_check(st, cfg)}
        r = guard(f"long {L}", run_long)
        R["ours"].setdefault("long", {})[str(L)] = r
        print("long", L, r, flush=True)
        if r:
            t_used, prev = r["prefill_s"], L
    save()
    print(json.dumps({k: R[k] for k in ("versions", "setup")}, default=str))
    print_table(R)


def print_table(R):
    o, n, f = R["ours"], R["native"], R.get("floor", {})
    print("\n| metric | kimi-hybrid | native kimi_linear | ratio |")
    print("|---|---|---|---|")
    for T, r in (o.get("prefill") or {}).items():
        nr = (n.get("prefill") or {}).get(T) or {}
        if r:
            ratio = f"{r['tok_s'] / nr['tok_s']:.2f}x" if nr.get("tok_s") else "-"
            print(f"| prefill {T} tok/s | {r['tok_s']} | {nr.get('tok_s', '-')} | {ratio} |")
    for key, r in (o.get("decode") or {}).items():
        nr = (n.get("decode") or {}).get(key) or {}
        if r:
            ms = r["graph_ms_per_step"]
            nms = nr.get("ms_per_step_median")
            fl = f.get(key, {}).get("ms")
            print(f"| decode {key} ms/step | {ms} (floor {fl:.3f}, {ms / fl:.2f}x floor) | {nms or '-'} | "
                  f"{(nms / ms if nms else float('nan')):.1f}x |")
            cms = r.get("compiled_graph_ms_per_step")
            if cms:
                print(f"| decode {key} ms/step, compiled | {cms} ({cms / fl:.2f}x floor) | {nms or '-'} | "
                      f"{(nms / cms if nms else float('nan')):.1f}x |")
    for L, r in (o.get("long") or {}).items():
        if r and "prefill_s" in r:
            print(f"| long {L}: prefill s / peak GiB / decode ms | {r['prefill_s']} / {r['peak_GiB']} / "
                  f"{r['decode_ms_per_step']} | - | - |")


if __name__ == "__main__":
    main()
