"""Micro-benchmarks of our decode kernels at the full model's shapes, each against its reference and the copy
bandwidth measured in the same run.

Shapes (Kimi-Linear-48B-A3B, /work/shared/docs/checkpoint-facts.md): hidden 2304; KDA 32 heads x 128 (state
``[B, 32, 128, 128]`` fp32); 256 experts top-8, expert intermediate 1024; MLA 32 heads, latent 512 + 64.

Sections (a small registry, ``--sections`` picks; each row: time per call, bytes it must move, achieved GB/s and
that as a fraction of the measured copy bandwidth, the reference's time, the speed-up):

  copy            device-to-device copy of 4 GiB after warm-up, median of 12: read + write bytes / time (the
                  bandwidth the others are read against)
  mla_decode      split-KV latent decode (``kernels.mla_decode``) vs ``mla_kimi_hybrid.latent_context``: batch 1 at
                  4K / 16K / 32K / 128K / 1M, batch 32 at 4K, batch 8 at 16K; bytes = the latents + queries + output
  mla_sweep       the split-KV kernel at 1M and 128K over split counts / key tiles / pipeline stages
  moe_gemv        expert GEMVs (``kernels.moe_decode``) vs the grouped-GEMM path, batch 1 / 2 / 4 / 8 / 16 / 32;
                  bytes = the distinct experts hit (gate/up + down) + activations
  moe_gemv_sweep  the expert GEMVs at batch 1, 4 and 32 over tile configurations
  routing         one-launch routing vs ``moe_kimi_hybrid.route_topk``, batch 1 / 32 (time only: bytes are tiny)
  kda_decode      Triton KDA recurrence (``kernels.kda_decode``) vs FLA ``fused_recurrent_kda`` (if installed) and the
                  plain-PyTorch reference, batch 1 / 32; bytes = state read + write + q/k/v/g/beta + output
  kda_decode_step the fused decode step (conv update ... gated RMSNorm, ``kda_decode_step``) vs the same step as
                  separate torch ops, batch 1 / 8 / 32; bytes = state + conv windows read + written, inputs, output

Timing: each measured call is replayed from a CUDA graph holding ``reps`` calls on rotating input copies (together
larger than the L2 cache, so no call reads another's data from L2); time = median replay / reps.

    python -m kimi_hybrid.kernels.bench_kernels --out kernels.json [--sections copy,mla_decode,...]

Expected runtime on an H200: ~2 minutes for all sections (compilation included). Needs CUDA.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import traceback
from typing import Callable, Dict, List, Sequence

import torch

from kimi_hybrid.kernels.probe_h200 import cuda_time

HIDDEN, KDA_HEADS, KDA_DIM = 2304, 32, 128
EXPERTS, TOP_K, MOE_INTER = 256, 8, 1024
MLA_HEADS, LATENT_R, LATENT_ROPE = 32, 512, 64
L2_FLUSH_BYTES = 256 << 20  # rotating inputs of at least this many bytes per graph (H200 L2: 50 MiB)

SECTIONS: Dict[str, Callable[[dict], List[dict]]] = {}


def section(name: str):
    """Register a benchmark section: ``fn(ctx) -> rows`` (``ctx["copy_gbps"]`` holds the copy bandwidth)."""
    def register(fn):
        SECTIONS[name] = fn
        return fn
    return register


def time_per_call(make_args: Callable[[int], tuple], fn: Callable, n_sets: int, reps: int = 20,
                  replays: int = 5) -> float:
    """Median seconds per ``fn(*args)`` call, ``reps`` calls per CUDA graph over ``n_sets`` rotating argument sets
    (``make_args(i)``); falls back to eager launches if capture fails."""
    sets = [make_args(i) for i in range(n_sets)]
    with torch.no_grad():
        for a in sets[:2]:
            fn(*a)  # compile / autotune outside the capture
        torch.cuda.synchronize()
        calls = [sets[i % n_sets] for i in range(reps)]
        try:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for a in calls:
                    fn(*a)
            run = graph.replay
        except Exception:  # noqa: BLE001 - a path that cannot be captured (host sync): time eager launches
            def run():
                for a in calls:
                    fn(*a)
        return cuda_time(run, replays) / reps


def sets_for(bytes_per_set: int) -> int:
    """Rotating argument sets so that one graph's inputs exceed the L2 cache (at most 16)."""
    return max(1, min(16, -(-L2_FLUSH_BYTES // max(1, bytes_per_set))))


def row(ctx: dict, name: str, seconds: float, nbytes: int, ref_seconds=None, **extra) -> dict:
    gbps = nbytes / seconds / 1e9
    r = {"case": name, "us": round(seconds * 1e6, 2), "bytes": int(nbytes), "GB/s": round(gbps, 1),
         "of_copy_bw": round(gbps / ctx["copy_gbps"], 3) if ctx.get("copy_gbps") else None}
    if ref_seconds is not None:
        r["ref_us"] = round(ref_seconds * 1e6, 2)
        r["speedup"] = round(ref_seconds / seconds, 2)
    r.update(extra)
    return r


@section("copy")
def bench_copy(ctx: dict) -> List[dict]:
    """Device-to-device copy of 4 GiB (far beyond L2), after warm-up copies; median of 12 timed copies, bytes =
    read + write. Timed with events around single eager copies (a 4 GiB copy dwarfs the launch)."""
    n = 4 << 30
    a = torch.empty(n, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    for _ in range(4):
        b.copy_(a)
    torch.cuda.synchronize()
    times = []
    for _ in range(12):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        b.copy_(a)
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) / 1e3)
    t = sorted(times)[len(times) // 2]
    ctx["copy_gbps"] = 2 * n / t / 1e9
    del a, b
    return [{"case": "d2d copy 4 GiB", "us": round(t * 1e6, 1), "bytes": 2 * n, "GB/s": round(ctx["copy_gbps"], 1),
             "min_us": round(min(times) * 1e6, 1), "timed_copies": len(times)}]


def _mla_inputs(B: int, S: int, i: int):
    g = torch.Generator(device="cuda").manual_seed(i)
    q = torch.randn(B, MLA_HEADS, LATENT_R + LATENT_ROPE, device="cuda", generator=g).bfloat16()
    lat = torch.randn(B, S, LATENT_R + LATENT_ROPE, device="cuda", generator=g).bfloat16()
    return q, lat


def _mla_bytes(B: int, S: int) -> int:
    D = LATENT_R + LATENT_ROPE
    return 2 * (B * S * D + B * MLA_HEADS * D + B * MLA_HEADS * LATENT_R)


@section("mla_decode")
def bench_mla_decode(ctx: dict) -> List[dict]:
    from kimi_hybrid.kernels.mla_decode import latent_decode_attention, naive_latent_decode

    kw = dict(num_heads=MLA_HEADS, kv_lora_rank=LATENT_R, scaling=0.07)
    rows = []
    for B, S in ((1, 4096), (1, 16384), (1, 32768), (1, 131072), (1, 1 << 20), (32, 4096), (8, 16384)):
        n = sets_for(_mla_bytes(B, S))
        make = lambda i, B=B, S=S: _mla_inputs(B, S, i)  # noqa: E731
        t = time_per_call(make, lambda q, lat: latent_decode_attention(q, lat, None, **kw), n)
        t_ref = time_per_call(make, lambda q, lat: naive_latent_decode(q, lat, None, **kw), n, reps=5)
        rows.append(row(ctx, f"B{B} S{S}", t, _mla_bytes(B, S), t_ref))
    return rows


@section("mla_sweep")
def bench_mla_sweep(ctx: dict) -> List[dict]:
    from kimi_hybrid.kernels.mla_decode import default_num_splits, latent_decode_attention

    kw = dict(num_heads=MLA_HEADS, kv_lora_rank=LATENT_R, scaling=0.07)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for S in (1 << 20, 131072):
        make = lambda i, S=S: _mla_inputs(1, S, i)  # noqa: E731
        n = sets_for(_mla_bytes(1, S))
        for splits in (sms, 2 * sms, 3 * sms, 4 * sms):
            for block_n, stages, warps in ((64, 3, 4), (64, 2, 4), (32, 3, 4), (64, 4, 4), (128, 2, 4), (64, 3, 8)):
                fn = lambda q, lat, s=splits, bn=block_n, st=stages, w=warps: latent_decode_attention(  # noqa: E731
                    q, lat, None, num_splits=s, block_n=bn, num_stages=st, num_warps=w, **kw)
                try:
                    t = time_per_call(make, fn, n, reps=10, replays=3)
                    rows.append(row(ctx, f"S{S} splits{splits} BN{block_n} stages{stages} warps{warps}", t,
                                    _mla_bytes(1, S), default=splits == default_num_splits(S, torch.device("cuda"))
                                    and (block_n, stages, warps) == (64, 3, 4)))
                except Exception as e:  # noqa: BLE001 - a config that does not fit (shared memory): recorded
                    rows.append({"case": f"S{S} splits{splits} BN{block_n} stages{stages} warps{warps}",
                                 "error": f"{type(e).__name__}: {str(e)[:120]}"})
    return rows


def _experts():
    g = torch.Generator(device="cuda").manual_seed(0)
    gate_up = (torch.randn(EXPERTS, 2 * MOE_INTER, HIDDEN, device="cuda", generator=g) * 0.02).bfloat16()
    down = (torch.randn(EXPERTS, HIDDEN, MOE_INTER, device="cuda", generator=g) * 0.02).bfloat16()
    return gate_up, down


def _routes(N: int, i: int):
    g = torch.Generator(device="cuda").manual_seed(1000 + i)
    x = torch.randn(N, HIDDEN, device="cuda", generator=g).bfloat16()
    idx = torch.stack([torch.randperm(EXPERTS, device="cuda", generator=g)[:TOP_K] for _ in range(N)])
    w = torch.rand(N, TOP_K, device="cuda", generator=g)
    return x, idx, w


def _moe_bytes(idx: torch.Tensor, N: int) -> int:
    distinct = int(torch.unique(idx).numel())
    return distinct * 3 * MOE_INTER * HIDDEN * 2 + 2 * N * HIDDEN * 2


class _ExpertsStub(torch.nn.Module):
    """The attributes ``moe_kimi_hybrid.grouped_experts_forward`` reads, over the benchmark's weights."""

    def __init__(self, gate_up, down):
        super().__init__()
        from kimi_hybrid import KimiHybridConfig

        self.config = KimiHybridConfig(hidden_size=HIDDEN, num_experts=EXPERTS, num_experts_per_token=TOP_K,
                                       moe_intermediate_size=MOE_INTER)
        self.num_experts = EXPERTS
        self.gate_up_proj, self.down_proj = gate_up, down

    def local_routes(self, idx, w):
        return idx, w


@section("moe_gemv")
def bench_moe_gemv(ctx: dict) -> List[dict]:
    from kimi_hybrid import moe_kimi_hybrid as moe
    from kimi_hybrid.kernels.moe_decode import moe_decode_gemv

    gate_up, down = _experts()
    stub = _ExpertsStub(gate_up, down)
    rows = []
    for N in (1, 2, 4, 8, 16, 32):
        nbytes = sum(_moe_bytes(_routes(N, i)[1], N) for i in range(8)) // 8  # mean over the rotating routes
        make = lambda i, N=N: _routes(N, i)  # noqa: E731
        t = time_per_call(make, lambda x, idx, w: moe_decode_gemv(x, idx, w, gate_up, down), 8)
        t_ref = time_per_call(make, lambda x, idx, w: moe.grouped_experts_forward(stub, x, idx, w), 8)
        rows.append(row(ctx, f"B{N} top{TOP_K}", t, nbytes, t_ref, ref="grouped GEMM path"))
    return rows


@section("moe_gemv_sweep")
def bench_moe_gemv_sweep(ctx: dict) -> List[dict]:
    from kimi_hybrid.kernels.moe_decode import GemvConfig, gemv_config, moe_decode_gemv

    gate_up, down = _experts()
    configs = [GemvConfig(gate_up_n=a, gate_up_k=b, down_n=c, down_k=d, num_warps=w, num_stages=s)
               for a, b, c, d, w, s in ((8, 256, 16, 256, 4, 4), (8, 128, 16, 256, 4, 4), (8, 256, 16, 256, 4, 5),
                                        (8, 256, 8, 256, 4, 4), (8, 128, 8, 128, 4, 5), (4, 256, 8, 256, 4, 4),
                                        (8, 256, 16, 128, 4, 4), (4, 512, 8, 512, 4, 3), (16, 512, 32, 256, 8, 3))]
    rows = []
    for N in (1, 4, 32):
        nbytes = sum(_moe_bytes(_routes(N, i)[1], N) for i in range(8)) // 8
        make = lambda i, N=N: _routes(N, i)  # noqa: E731
        for cfg in configs:
            fn = lambda x, idx, w, c=cfg: moe_decode_gemv(x, idx, w, gate_up, down, config=c)  # noqa: E731
            try:
                t = time_per_call(make, fn, 8, reps=10, replays=3)
                rows.append(row(ctx, f"B{N} {cfg}", t, nbytes, default=cfg == gemv_config(N * TOP_K)))
            except Exception as e:  # noqa: BLE001 - a config that does not compile / fit: recorded
                rows.append({"case": f"B{N} {cfg}", "error": f"{type(e).__name__}: {str(e)[:120]}"})
    return rows


@section("routing")
def bench_routing(ctx: dict) -> List[dict]:
    from kimi_hybrid import moe_kimi_hybrid as moe
    from kimi_hybrid.kernels.moe_decode import route_topk_triton

    kw = dict(top_k=TOP_K, num_groups=1, topk_group=1, sigmoid=True, renormalize=True, scaling=2.446)
    bias = torch.randn(EXPERTS, device="cuda") * 0.01
    rows = []
    for N in (1, 32):
        make = lambda i, N=N: (torch.randn(N, EXPERTS, device="cuda"),)  # noqa: E731
        t = time_per_call(make, lambda lg: route_topk_triton(lg, bias, **kw), 4)
        t_ref = time_per_call(make, lambda lg: moe.route_topk(lg, bias, **kw), 4)
        rows.append(row(ctx, f"B{N} E{EXPERTS} top{TOP_K}", t, N * EXPERTS * 4, t_ref))
    return rows


def _kda_bytes(B: int) -> int:
    state = B * KDA_HEADS * KDA_DIM * KDA_DIM * 4
    return 2 * state + B * KDA_HEADS * KDA_DIM * (2 * 3 + 4 + 2)


@section("kda_decode")
def bench_kda_decode(ctx: dict) -> List[dict]:
    from kimi_hybrid import kda_kimi_hybrid as kk
    from kimi_hybrid.kernels.kda_decode import kda_decode_triton, naive_kda_decode
    from kimi_hybrid.kernels.testing import kda_inputs

    rows = []
    for B in (1, 32):
        n = sets_for(_kda_bytes(B))
        make = lambda i, B=B: tuple(kda_inputs(B, 1, KDA_HEADS, KDA_DIM, KDA_DIM, seed=i, state=True))  # noqa: E731
        t = time_per_call(make, lambda *a: kda_decode_triton(*a), n)
        t_ref = time_per_call(make, lambda *a: naive_kda_decode(*a), n, reps=5)
        extra = {}
        if kk.fla_available():
            from fla.ops.kda import fused_recurrent_kda

            extra["fla_us"] = round(1e6 * time_per_call(make, lambda q, k, v, g, b, h0: fused_recurrent_kda(
                q, k, v, g, b, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True), n), 2)
        rows.append(row(ctx, f"B{B} T1", t, _kda_bytes(B), t_ref, **extra))
    return rows


def _kda_step_inputs(B: int, i: int):
    g = torch.Generator(device="cuda").manual_seed(i)
    P, W = KDA_HEADS * KDA_DIM, 4
    r = lambda *shape: torch.randn(*shape, device="cuda", generator=g)  # noqa: E731
    return (r(B, 3 * P).bfloat16(), r(B, 3 * P, W).bfloat16(), (r(3 * P, 1, W) * 0.5).bfloat16(), r(B, P).bfloat16(),
            torch.rand(KDA_HEADS, device="cuda", generator=g), r(P), r(B, KDA_HEADS).bfloat16(), r(B, P).bfloat16(),
            torch.ones(KDA_DIM, device="cuda"), r(B, KDA_HEADS, KDA_DIM, KDA_DIM) * 0.1)


def _kda_step_bytes(B: int) -> int:
    P, W = KDA_HEADS * KDA_DIM, 4
    return 2 * B * KDA_HEADS * KDA_DIM * KDA_DIM * 4 + 2 * B * 3 * P * W * 2 + B * (3 * P + 2 * P + KDA_HEADS) * 2 \
        + B * P * 2


@section("kda_decode_step")
def bench_kda_decode_step(ctx: dict) -> List[dict]:
    """The fused KDA decode step vs the same step as separate torch ops (the composed reference)."""
    from kimi_hybrid.kernels.kda_decode import kda_decode_step, naive_kda_decode_step

    kw = dict(num_heads=KDA_HEADS, eps=1e-5)
    rows = []
    for B in (1, 8, 32):
        n = sets_for(_kda_step_bytes(B))
        make = lambda i, B=B: _kda_step_inputs(B, i)  # noqa: E731
        t = time_per_call(make, lambda *a: kda_decode_step(*a, **kw), n)
        t_ref = time_per_call(make, lambda *a: naive_kda_decode_step(*a, **kw), n, reps=5)
        rows.append(row(ctx, f"B{B} H{KDA_HEADS} K{KDA_DIM}", t, _kda_step_bytes(B), t_ref,
                        ref="separate torch ops"))
    return rows


def environment() -> dict:
    """Machine, versions and commit of this run."""
    props = torch.cuda.get_device_properties(0)
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    import transformers

    commit = os.environ.get("GIT_COMMIT")
    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                    cwd=os.path.dirname(os.path.abspath(__file__)), timeout=10).stdout.strip()
        except Exception:  # noqa: BLE001 - not a checkout
            commit = None
    return {"gpu": props.name, "sms": props.multi_processor_count, "memory_gib": round(props.total_memory / 2**30, 1),
            "host": platform.node(), "python": platform.python_version(), "torch": torch.__version__,
            "cuda": torch.version.cuda, "triton": triton_version, "transformers": transformers.__version__,
            "commit": commit or None, "date": datetime.datetime.now(datetime.timezone.utc).isoformat()}


def print_table(name: str, rows: Sequence[dict]) -> None:
    print(f"\n== {name}")
    for r in rows:
        print("  " + "  ".join(f"{k}={v}" for k, v in r.items()))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="bench_kernels.json", help="JSON file to write")
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, of {', '.join(SECTIONS)}")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_kernels needs CUDA (the kernels are Triton GPU kernels)", file=sys.stderr)
        return 2
    wanted = [s for s in args.sections.split(",") if s]
    unknown = [s for s in wanted if s not in SECTIONS]
    if unknown:
        p.error(f"unknown sections {unknown}; choose from {list(SECTIONS)}")
    if "copy" not in wanted:
        wanted.insert(0, "copy")  # every GB/s is read against it
    record = {"environment": environment(), "sections": {}}
    ctx: dict = {}
    for name in wanted:
        try:
            rows = SECTIONS[name](ctx)
        except Exception as e:  # noqa: BLE001 - one failing section must not lose the others
            rows = [{"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-2000:]}]
        record["sections"][name] = rows
        print_table(name, rows)
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
