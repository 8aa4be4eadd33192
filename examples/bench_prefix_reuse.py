"""Benchmark: many prompts that share a long prefix, with and without reusing one prefix cache.

Without reuse every prompt recomputes the prefix; with reuse the prefix runs once
(``KimiHybridForCausalLM.prefill_prefix``) and each continuation starts from a fork of its cache
(``generate_from_prefix`` batches them: rows ``prefix | pads | suffix_i``; or one ``prefix_cache.fork()`` per prompt).
Greedy decoding; the generated ids of the reused and the recomputed runs are checked to be identical.

Four timings (seconds, wall clock, minimum and median over ``--repeats`` interleaved runs; the prefix prefill is
included in the reuse timings; time saved is computed from the minima):
``scratch_batched`` (all prompts in one left-padded batch), ``reuse_batched``, ``scratch_sequential`` (one prompt at
a time) and ``reuse_sequential``. Prints a table and writes JSON (machine, versions, commit, settings, timings, time
saved) to ``examples/results/prefix_reuse.json``.

    python examples/bench_prefix_reuse.py --preset small.json    # a small random model, CPU
    python examples/bench_prefix_reuse.py --preset small.json --prefix-len 4096 --num-prompts 16

``--preset``: a shipped preset name or a ``.json`` file of KimiHybridConfig arguments (``small.json``: e.g. the
"tiny-kda-first" config of tests/presets.py written with ``json.dump``; the recorded results used it).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import transformers

from kimi_hybrid import KimiHybridConfig, KimiHybridForCausalLM

ROOT = Path(__file__).resolve().parents[1]


def git_commit() -> dict:
    def run(*a):
        return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    try:
        return {"commit": run("rev-parse", "HEAD"), "branch": run("rev-parse", "--abbrev-ref", "HEAD"),
                "dirty": bool(run("status", "--porcelain", "--untracked-files=no"))}
    except OSError:
        return {"commit": None}


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", required=True, help="shipped preset name or .json file of config arguments")
    ap.add_argument("--prefix-len", type=int, default=2048)
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--suffix-min", type=int, default=8)
    ap.add_argument("--suffix-max", type=int, default=24)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: leave the default)")
    ap.add_argument("--out", default=str(ROOT / "examples" / "results" / "prefix_reuse.json"))
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    torch.manual_seed(args.seed)
    config = KimiHybridConfig.from_preset(args.preset)
    model = KimiHybridForCausalLM(config).eval()
    g = torch.Generator().manual_seed(args.seed + 1)
    V = config.vocab_size
    prefix = torch.randint(3, V, (1, args.prefix_len), generator=g)
    suffixes = [torch.randint(3, V, (int(torch.randint(args.suffix_min, args.suffix_max + 1, (1,), generator=g)),),
                              generator=g) for _ in range(args.num_prompts)]
    prompts = [torch.cat([prefix[0], s]) for s in suffixes]
    gkw = dict(max_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0, eos_token_id=None)

    def new_tokens_of(seq_row, prompt_len_in_row):
        return seq_row[prompt_len_in_row:].tolist()

    @torch.no_grad()
    def scratch_batched():
        T = max(len(p) for p in prompts)
        ids = torch.zeros(len(prompts), T, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):
            ids[i, T - len(p):], mask[i, T - len(p):] = p, 1
        out = model.generate(ids, attention_mask=mask, **gkw)
        return [new_tokens_of(out[i], T) for i in range(len(prompts))]

    @torch.no_grad()
    def reuse_batched():
        cache = model.prefill_prefix(prefix)
        out = model.generate_from_prefix(cache, prefix, suffixes, **gkw)
        T = args.prefix_len + max(len(s) for s in suffixes)
        return [new_tokens_of(out[i], T) for i in range(len(prompts))]

    @torch.no_grad()
    def scratch_sequential():
        return [new_tokens_of(model.generate(p.unsqueeze(0), **gkw)[0], len(p)) for p in prompts]

    @torch.no_grad()
    def reuse_sequential():
        cache = model.prefill_prefix(prefix)
        return [new_tokens_of(model.generate(p.unsqueeze(0), past_key_values=cache.fork(), **gkw)[0], len(p))
                for p in prompts]

    modes = (("scratch_batched", scratch_batched), ("reuse_batched", reuse_batched),
             ("scratch_sequential", scratch_sequential), ("reuse_sequential", reuse_sequential))
    reuse_batched()  # warm-up (lazy imports, allocator)
    runs, outputs = {name: [] for name, _ in modes}, {}
    for _ in range(args.repeats):  # interleaved, so that load from other processes hits every mode alike
        for name, fn in modes:
            t, outputs[name] = timed(fn)
            runs[name].append(t)
    results = {}
    for name, _ in modes:
        results[name] = {"min_s": min(runs[name]), "median_s": statistics.median(runs[name]), "runs_s": runs[name]}
        print(f"{name:20s} min {min(runs[name]):8.3f} s  median {statistics.median(runs[name]):8.3f} s", flush=True)
    equal = {
        "batched": outputs["scratch_batched"] == outputs["reuse_batched"],
        "sequential": outputs["scratch_sequential"] == outputs["reuse_sequential"],
        "batched_vs_sequential": outputs["reuse_batched"] == outputs["reuse_sequential"],
    }
    # the minimum over repeats is the estimate least disturbed by other processes on the machine
    saved = {
        mode: {"saved_s": results[f"scratch_{mode}"]["min_s"] - results[f"reuse_{mode}"]["min_s"],
               "speedup": results[f"scratch_{mode}"]["min_s"] / results[f"reuse_{mode}"]["min_s"],
               "saved_fraction": 1 - results[f"reuse_{mode}"]["min_s"] / results[f"scratch_{mode}"]["min_s"]}
        for mode in ("batched", "sequential")
    }
    for mode, v in saved.items():
        print(f"{mode:10s}: reuse saves {v['saved_s']:.3f} s per {args.num_prompts} prompts "
              f"({v['speedup']:.2f}x faster)")
    print(f"identical generated ids: {equal}")

    report = {
        "benchmark": "prefix_reuse",
        "what": "greedy generation for num_prompts prompts sharing a prefix; scratch = prefix recomputed per "
                "prompt, reuse = one prefill_prefix() cache forked for every prompt (its prefill time included)",
        "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                    "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(), "device": "cpu",
                    "load_average_1_5_15": list(os.getloadavg()) if hasattr(os, "getloadavg") else None},
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": transformers.__version__},
        "git": git_commit(),
        "settings": {**vars(args), "dtype": "float32", "suffix_lengths": [len(s) for s in suffixes]},
        "model": {"preset": args.preset, "num_parameters": sum(p.numel() for p in model.parameters()),
                  "layer_types": config.layer_types},
        "timings": results,
        "saved": saved,
        "identical_outputs": equal,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")
    if not all(equal.values()):
        sys.exit("reused and recomputed generations differ")


if __name__ == "__main__":
    main()
