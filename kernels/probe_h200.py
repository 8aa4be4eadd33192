"""H200 diagnostics behind the benchmark's design choices (not a benchmark of the model itself).

Two probes, each printed and saved to JSON with the machine, versions and commit:

* ``attention``: the MLA prefill attention (32 heads, q/k head dim 192 = 128 NoPE + 64 rope, v head dim 128, bf16)
  through each SDPA backend that accepts it: flash (v zero-padded to 192: flash needs one head dim), cuDNN and
  mem-efficient (unpadded), for one-shot causal prefill at ``--attn-T`` and for a chunked-prefill piece (a query
  chunk against a longer key prefix, bottom-right causal ``CausalBias``). Time per call (CUDA events, median of
  ``--reps`` after a warm-up) and the relative L2 difference to the flash result.
* ``decode``: the kernel census of one eager batch-1 decode step of the benchmark slice (torch.profiler: kernel
  count and summed kernel time per step), the graph-replayed step, and the torch.compile-d graph-replayed step.

Usage: ``python kernels/probe_h200.py --out probe.json [--probes attention,decode]``
"""

from __future__ import annotations

import argparse
import json
import os
import time
import traceback

import torch
import torch.nn.functional as F


from kimi_hybrid.kernels.bench_h200 import build_ours_only, graph_decode_time, ours_prefill, versions  # noqa: E402
from kimi_hybrid.engine_kimi_hybrid import GraphDecoder, to_static_cache  # noqa: E402


def cuda_time(fn, reps):
    """Median seconds of ``fn()`` over ``reps`` calls (CUDA events), after one untimed call."""
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b) / 1e3)
    ts.sort()
    return ts[len(ts) // 2]


def probe_attention(T_list, chunk, prefix, reps):
    """Time MLA prefill attention per SDPA backend (see the module doc); returns {case: {backend: result}}."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    H, DQK, DV = 32, 192, 128
    out = {}
    backends = {"flash_padded_v": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
                "cudnn_padded_v": SDPBackend.CUDNN_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION}
    cases = [(f"causal_T{T}", T, T) for T in T_list] + [(f"chunk_q{chunk}_kv{prefix}", chunk, prefix)]
    for name, Tq, Tk in cases:
        g = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(1, H, Tq, DQK, device="cuda", dtype=torch.bfloat16, generator=g)
        k = torch.randn(1, H, Tk, DQK, device="cuda", dtype=torch.bfloat16, generator=g)
        v = torch.randn(1, H, Tk, DV, device="cuda", dtype=torch.bfloat16, generator=g)
        vp = F.pad(v, (0, DQK - DV))
        mask = None if Tq == Tk else causal_lower_right(Tq, Tk)
        flops = 2 * H * (DQK + DV) * (Tq * Tk - Tq * (Tq - 1) / 2 if Tq < Tk else Tq * (Tq + 1) / 2)
        res, ref = {}, None
        for bname, be in backends.items():
            if bname == "efficient" and Tq * Tk > 32768 ** 2:
                continue  # ~10x slower than flash at these sizes (measured at 32K): not a candidate
            vv = vp if bname.endswith("padded_v") else v

            def call(vv=vv, be=be):
                with sdpa_kernel([be]):
                    if mask is None:
                        o = F.scaled_dot_product_attention(q, k, vv, is_causal=True)
                    else:
                        o = F.scaled_dot_product_attention(q, k, vv, attn_mask=mask)
                return o[..., :DV]
            try:
                s = cuda_time(call, reps)
                o = call().float()
                if ref is None:
                    ref = o
                err = ((o - ref).norm() / ref.norm()).item()
                res[bname] = {"s": round(s, 5), "TFLOPs_useful": round(flops / s / 1e12, 1), "rel_err_vs_first": err}
            except Exception as e:  # noqa: BLE001
                res[bname] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            torch.cuda.empty_cache()
        out[name] = res
        print(name, json.dumps(res), flush=True)
        del q, k, v, vp
        torch.cuda.empty_cache()
    return out


@torch.no_grad()
def probe_decode(layers, ctx, compile_too, R, save):
    """Kernel census and graph timings of a batch-1 decode step (see the module doc), written into ``R["decode"]``
    and saved after each variant."""
    from torch.profiler import ProfilerActivity, profile

    from kimi_hybrid import kda_kimi_hybrid as kk

    _, model, cfg = build_ours_only(layers)
    gen = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (1, ctx), device="cuda", generator=gen)
    dyn, last = ours_prefill(model, cfg, ids)
    st = to_static_cache(dyn, ctx + 512)
    del dyn
    first = last.argmax(-1, keepdim=True)
    snap = st.snapshot()
    res = R.setdefault("decode", {"layers": layers, "context": ctx})

    def reset():
        st.restore(snap)

    def census(tag):
        for _ in range(3):
            model(first, past_key_values=st, use_cache=True)
        reset()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                model(first, past_key_values=st, use_cache=True)
            torch.cuda.synchronize()
        reset()
        kernels = {}
        for e in prof.key_averages():
            if e.device_type.name == "CUDA" and e.count:
                t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
                kernels[e.key[:90]] = {"count_per_step": e.count / 3, "us_per_step": round(t / 3, 2)}
        n_k = sum(v["count_per_step"] for v in kernels.values())
        t_k = sum(v["us_per_step"] for v in kernels.values())
        res[tag] = {"kernels_per_step": n_k, "kernel_us_per_step": round(t_k, 1),
                    "top_kernels": dict(sorted(kernels.items(), key=lambda kv: -kv[1]["us_per_step"])[:30])}
        print(tag, n_k, "kernels,", round(t_k, 1), "us of kernel time", flush=True)
        save()

    def graph(tag, **kw):
        t = time.perf_counter()
        dec = GraphDecoder(model, st, **kw)
        res[tag + "_build_s"] = round(time.perf_counter() - t, 1)
        res[tag + "_ms"] = round(graph_decode_time(dec, first, steps=64)[0] * 1e3, 4)
        del dec
        reset()
        print(tag, res[tag + "_ms"], "ms/step", flush=True)
        save()

    for tag, fn in [("census_triton_decode", lambda: census("census_triton_decode")),
                    ("graph_triton_decode", lambda: graph("graph_triton_decode")),
                    ("graph_fla_decode", lambda: (setattr(kk, "USE_TRITON_DECODE", False),
                                                  graph("graph_fla_decode"))),
                    ("census_fla_decode", lambda: census("census_fla_decode")),
                    ("graph_compiled", lambda: (setattr(kk, "USE_TRITON_DECODE", True),
                                                graph("graph_compiled", compile=True)) if compile_too else None)]:
        try:
            fn()
        except Exception as e:  # noqa: BLE001
            R["errors"].append({"where": tag, "error": repr(e)[:400], "trace": traceback.format_exc()[-1500:]})
            print("ERROR", tag, traceback.format_exc()[-1500:], flush=True)
            kk.USE_TRITON_DECODE = True
            save()
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--probes", default="attention,decode")
    ap.add_argument("--attn-T", default="32768,131072")
    ap.add_argument("--chunk", type=int, default=65536)
    ap.add_argument("--prefix", type=int, default=262144)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--decode-context", type=int, default=4096)
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "probe_h200.json"))
    a = ap.parse_args()
    R = {"versions": versions(), "args": vars(a), "errors": []}
    probes = set(a.probes.split(","))

    def save():
        with open(a.out, "w") as f:
            json.dump(R, f, indent=1, default=str)
    if "attention" in probes:
        try:
            R["attention"] = probe_attention([int(x) for x in a.attn_T.split(",")], a.chunk, a.prefix, a.reps)
        except Exception as e:  # noqa: BLE001
            R["errors"].append({"where": "attention", "error": repr(e), "trace": traceback.format_exc()[-1500:]})
        save()
    if "decode" in probes:
        try:
            probe_decode(a.layers, a.decode_context, not a.no_compile, R, save)
        except Exception as e:  # noqa: BLE001
            R["errors"].append({"where": "decode", "error": repr(e), "trace": traceback.format_exc()[-1500:]})
            print(traceback.format_exc(), flush=True)
        save()


if __name__ == "__main__":
    main()
