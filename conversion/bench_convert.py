"""Benchmark: synthesize a multi-GB released-layout Kimi-Linear checkpoint and convert it (released -> ours, then
optionally ours -> released), reporting throughput and peak memory.

  python -m kimi_hybrid.conversion.bench_convert --size-gb 4 [--shard-gb 1] [--export] \
      [--json results/conversion/x.json]

The synthetic model keeps the released structure (KDA / MLA layers, layer-0 dense MLP, 1-based lists, fp32 A_log
[1,1,H,1] and dt_bias, per-expert w1/w2/w3 in bf16) with hidden 1024, 64 experts of width 512, and as many layers
as needed for the requested size. Shards are cut by bytes, so the experts of a layer span shard boundaries as in
the released index. Data is a tiled random block (content does not change the speed). Each conversion runs in a
fresh child process that reports its own peak RSS (VmHWM), so the numbers exclude the synthesizer.
GB/s = source bytes / wall time of the whole conversion (header checks, streaming copy, sha256 of every source
and destination tensor, fsync, verification re-read of the output).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def bench_config(n_layers: int) -> dict:
    kda = [i for i in range(1, n_layers + 1) if i % 4 != 0]
    full = [i for i in range(1, n_layers + 1) if i % 4 == 0]
    return {
        "architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear", "dtype": "bfloat16",
        "vocab_size": 32768, "hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": n_layers,
        "num_attention_heads": 8, "num_key_value_heads": 8, "head_dim": 128, "hidden_act": "silu",
        "initializer_range": 0.02, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "rope_scaling": None,
        "model_max_length": 1048576, "tie_word_embeddings": False, "use_cache": True, "bos_token_id": 1,
        "eos_token_id": 2, "pad_token_id": 0, "q_lora_rank": None, "kv_lora_rank": 256, "qk_nope_head_dim": 64,
        "qk_rope_head_dim": 32, "v_head_dim": 64, "mla_use_nope": True, "num_nextn_predict_layers": 0,
        "num_experts": 64, "num_experts_per_token": 4, "moe_intermediate_size": 512, "num_shared_experts": 1,
        "first_k_dense_replace": 1, "moe_layer_freq": 1, "routed_scaling_factor": 2.446,
        "moe_router_activation_func": "sigmoid", "use_grouped_topk": True, "num_expert_group": 1, "topk_group": 1,
        "moe_renormalize": True, "transformers_version": "4.57.0",
        "linear_attn_config": {"head_dim": 64, "num_heads": 8, "short_conv_kernel_size": 4, "kda_layers": kda,
                               "full_attn_layers": full},
    }


def synthesize(folder: str, size_gb: float, shard_gb: float) -> dict:
    """Write a released-layout checkpoint of about `size_gb` GB, shard by shard (bounded memory)."""
    from safetensors.torch import save_file

    from kimi_hybrid.conversion.inventory import inventory

    per_layer = 64 * 3 * 1024 * 512 * 2
    n_layers = max(2, round(size_gb * 1e9 / per_layer))
    cfg = bench_config(n_layers)
    inv = inventory(cfg, with_keys=True)
    os.makedirs(folder, exist_ok=True)
    block = torch.randn(32 << 20, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    blk32 = block[: 1 << 20].float()

    def make(shape, dt):
        n = 1
        for s in shape:
            n *= s
        src = block if dt == "BF16" else blk32
        reps = -(-n // src.numel())
        return (src.repeat(reps)[:n] if reps > 1 else src[:n].clone()).reshape(shape)

    limit = shard_gb * 1e9
    shards: list[list[tuple[str, list, str]]] = [[]]
    size = 0
    for r in inv["source"]["keys"]:
        nb = torch.empty(r["shape"], device="meta").numel() * (4 if r["dtype"] == "F32" else 2)
        if shards[-1] and size + nb > limit:
            shards.append([])
            size = 0
        shards[-1].append((r["key"], r["shape"], r["dtype"]))
        size += nb
    n = len(shards)
    wm = {}
    total = 0
    for i, group in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        tensors = {k: make(shape, dt) for k, shape, dt in group}
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        save_file(tensors, os.path.join(folder, name), metadata={"format": "pt"})
        wm.update({k: name for k in tensors})
        del tensors
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": wm}, f)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    split = sum(1 for i in range(n_layers)
                if len({wm[k] for k in wm if k.startswith(f"model.layers.{i}.block_sparse_moe.experts.")}) > 1)
    return {"layers": n_layers, "tensors": len(wm), "bytes": total, "shards": n, "layers_with_experts_split": split}


CHILD = r"""
import json, sys, time
from kimi_hybrid.conversion.convert import convert_checkpoint
t = time.perf_counter()
rep = convert_checkpoint({src!r}, {out!r}, src_format={fmt!r}, dst_format={dst!r}, progress=False,
                         checksum={checksum!r}, max_shard_size="5GB")
wall = time.perf_counter() - t
hwm = [int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM:")][0]
print(json.dumps({{"wall_s": wall, "peak_rss_mib": hwm / 1024, "peak_buffer_bytes": rep["peak_buffer_bytes"],
                  "bytes": rep["source"]["bytes"], "src_tensors": rep["source"]["tensors"],
                  "dst_tensors": rep["destination"]["tensors"], "dst_shards": len(rep["destination"]["shards"])}}))
"""


def run_child(src, out, fmt, dst, checksum):
    code = CHILD.format(src=src, out=out, fmt=fmt, dst=dst, checksum=checksum)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(r.stderr[-4000:])
    res = json.loads(r.stdout.strip().splitlines()[-1])
    res["gb_per_s"] = res["bytes"] / 1e9 / res["wall_s"]
    return res


def _git_commit() -> str:
    """HEAD of the checkout this script runs from ("+dirty" with uncommitted changes), or "unknown"."""
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True).stdout.strip()
        return rev + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gb", type=float, default=4.0)
    ap.add_argument("--shard-gb", type=float, default=1.0)
    ap.add_argument("--checksum", default="sha256",
                    help="comma list of sha256 / crc32 / none: released -> ours is timed once per entry")
    ap.add_argument("--export", action="store_true", help="also time ours -> released and check bit-exactness")
    ap.add_argument("--workdir", default=None, help="where to put the synthetic checkpoint (default: a temp dir)")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    work = tempfile.mkdtemp(prefix="kh-bench-", dir=args.workdir)
    try:
        t = time.perf_counter()
        synth = synthesize(os.path.join(work, "released"), args.size_gb, args.shard_gb)
        synth["synthesize_s"] = round(time.perf_counter() - t, 2)
        print(f"synthesized {synth}", flush=True)
        res = {"machine": {"platform": platform.platform(), "python": platform.python_version(),
                           "torch": torch.__version__, "cpus": os.cpu_count(),
                           "mem_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)},
               "commit": _git_commit(), "checksum": args.checksum, "synthetic": synth}
        kinds = args.checksum.split(",")
        for kind in kinds[::-1]:  # the first one last, so its output folder is the one exported
            shutil.rmtree(os.path.join(work, "ours"), ignore_errors=True)
            key = "released_to_ours" if kind == kinds[0] else f"released_to_ours_{kind}"
            res[key] = run_child(os.path.join(work, "released"), os.path.join(work, "ours"), "released", "ours", kind)
            res[key]["checksum"] = kind
            print(key, res[key], flush=True)
        args.checksum = kinds[0]
        if args.export:
            res["ours_to_released"] = run_child(os.path.join(work, "ours"), os.path.join(work, "back"), "ours",
                                                "released", args.checksum)
            print("ours -> released", res["ours_to_released"], flush=True)
            a = json.load(open(os.path.join(work, "ours", "conversion_report.json")))["sources"]
            b = json.load(open(os.path.join(work, "back", "conversion_report.json")))["destinations"]
            res["round_trip_bit_exact"] = (args.checksum != "none" and set(a) == set(b)
                                           and all(a[k][args.checksum] == b[k][args.checksum] for k in a))
            print("round trip bit-exact (sha per tensor):", res["round_trip_bit_exact"])
        if args.json:
            os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
            with open(args.json, "w") as f:
                json.dump(res, f, indent=2)
                f.write("\n")
        print(json.dumps(res, indent=2))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
