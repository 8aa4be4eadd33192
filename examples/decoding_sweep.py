"""Measure how much greedy / sampled completions of a model repeat themselves, to choose the CLI's default decoding.

For each decoding setting and each prompt, generate ``--new-tokens`` tokens and compute the distinct-4-gram ratio
of the new token ids (distinct 4-grams / all 4-grams; 1.0 = no 4-gram repeats, low values = loops). A
``no_repeat_ngram_size`` of n <= 4 makes that ratio 1.0 by construction, so the grid blocks 8-grams only. Prints one
line per setting (mean and minimum over the prompts) and writes the table as JSON with ``--out``.

    python examples/decoding_sweep.py --model models/kimi-hybrid-stdlib --new-tokens 200 --out sweep.json

The settings are transformers ``generate`` keyword sets; the CLI's defaults are
``kimi_hybrid.app.cli.DEFAULT_DECODING``, the first row.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from kimi_hybrid.app.cli import DEFAULT_DECODING

PROMPTS = [
    "def read_config(path):\n",
    "import os\nimport sys\n\n\n",
    "class Stack:\n    def __init__(self):\n",
    "def fibonacci(n):\n",
    "for i in range(10):\n",
    "    def __repr__(self):\n",
]

SETTINGS = {
    "cli-default": dict(do_sample=False, repetition_penalty=DEFAULT_DECODING["repetition_penalty"],
                        no_repeat_ngram_size=DEFAULT_DECODING["no_repeat_ngram_size"]),
    "greedy": dict(do_sample=False),
    "greedy+rep1.2": dict(do_sample=False, repetition_penalty=1.2),
    "greedy+rep1.3": dict(do_sample=False, repetition_penalty=1.3),
    "greedy+ngram8": dict(do_sample=False, no_repeat_ngram_size=8),
    "greedy+rep1.1+ngram8": dict(do_sample=False, repetition_penalty=1.1, no_repeat_ngram_size=8),
    "greedy+rep1.2+ngram8": dict(do_sample=False, repetition_penalty=1.2, no_repeat_ngram_size=8),
    "greedy+rep1.3+ngram8": dict(do_sample=False, repetition_penalty=1.3, no_repeat_ngram_size=8),
    "sample t0.8 p0.95 k50": dict(do_sample=True, temperature=0.8, top_p=0.95, top_k=50),
}


# every knob a setting does not name is off: a model folder's generation_config.json may set a repetition penalty or
# an n-gram block (the embedded one does), which generate would otherwise apply to "greedy" as well
NEUTRAL = dict(repetition_penalty=1.0, no_repeat_ngram_size=0, temperature=None, top_p=None, top_k=None)


def decoding_kwargs(name: str) -> dict:
    """The ``generate`` keywords of setting ``name``: its own on top of :data:`NEUTRAL`, so the result does not
    depend on the folder's generation config."""
    return {**NEUTRAL, **SETTINGS[name]}


def distinct_ngram_ratio(ids: list[int], n: int = 4) -> float:
    """Distinct n-grams / all n-grams of a token-id list (1.0 when shorter than n + 1 tokens)."""
    grams = [tuple(ids[i:i + n]) for i in range(len(ids) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 1.0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="models/kimi-hybrid-stdlib")
    p.add_argument("--new-tokens", type=int, default=200)
    p.add_argument("--settings", nargs="*", default=list(SETTINGS), help="names from SETTINGS")
    p.add_argument("--out", default=None, help="write the table as JSON here")
    args = p.parse_args()
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    rows = {}
    for name in args.settings:
        kw = decoding_kwargs(name)
        ratios, texts = [], []
        t0 = time.perf_counter()
        for i, prompt in enumerate(PROMPTS):
            torch.manual_seed(i)
            ids = tok(prompt, return_tensors="pt").input_ids
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.new_tokens,
                                 min_new_tokens=args.new_tokens, pad_token_id=tok.pad_token_id, **kw)
            new = out[0, ids.shape[1]:].tolist()
            ratios.append(distinct_ngram_ratio(new))
            texts.append(tok.decode(new))
        rows[name] = {"kwargs": SETTINGS[name], "distinct4": ratios, "mean": sum(ratios) / len(ratios), "min": min(ratios),
                      "seconds": time.perf_counter() - t0,
                      "texts": texts}
        print(f"{name:<24} distinct-4 mean {rows[name]['mean']:.3f} min {rows[name]['min']:.3f}", flush=True)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump({"model": args.model, "new_tokens": args.new_tokens, "prompts": PROMPTS, "rows": rows}, f,
                      indent=2)


if __name__ == "__main__":
    main()
