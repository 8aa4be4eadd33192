#!/usr/bin/env python
"""Tokenize the stdlib corpus into flat uint16 id arrays for pre-training.

Reads ``train.txt`` / ``heldout.txt`` written by prepare_stdlib_corpus.py, splits them back into source files at
the separator lines ``\\n# <file: PATH>\\n`` (the separator itself is dropped), encodes every file with
``KimiHybridTokenizer`` (special-token names inside source text stay ordinary text), and writes

  ``{split}_ids.npy``: 1-D ``uint16`` array ``file_0 [EOS] file_1 [EOS] ... file_n [EOS]``
  ``tokenized_meta.json``: tokenizer dir, eos id, vocab_size, per split: files, bytes, tokens, bytes/token.

uint16 needs ``vocab_size <= 65536`` (8448 for the shipped tokenizer); a larger vocabulary raises ValueError.

Usage:
  python examples/tokenize_corpus.py --corpus data/stdlib --tokenizer models/kimi-hybrid-stdlib --out data
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import numpy as np
from tqdm import tqdm

from kimi_hybrid import tokenization_kimi_hybrid

SEPARATOR_RE = re.compile(r"\n# <file: ([^>\n]*)>\n")


def split_files(text: str) -> list[tuple[str, str]]:
    """``[(path, file_text), ...]`` from a corpus text (leading text before the first separator is an error)."""
    parts = SEPARATOR_RE.split(text)
    if parts[0]:
        raise ValueError("corpus text does not start with a file separator")
    return list(zip(parts[1::2], parts[2::2]))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--corpus", default="data/stdlib")
    parser.add_argument("--tokenizer", default="models/kimi-hybrid-stdlib")
    parser.add_argument("--out", default="data")
    args = parser.parse_args(argv)

    tk = tokenization_kimi_hybrid
    tok = tk.KimiHybridTokenizer.from_pretrained(args.tokenizer)
    if tok.vocab_size > np.iinfo(np.uint16).max + 1:
        raise ValueError(f"vocab_size {tok.vocab_size} does not fit uint16")
    eos = tok.eos_token_id
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"tokenizer": args.tokenizer, "eos_token_id": eos, "vocab_size": tok.vocab_size, "splits": {}}
    for split in ("train", "heldout"):
        files = split_files((Path(args.corpus) / f"{split}.txt").read_text(encoding="utf-8"))
        ids: list[int] = []
        n_bytes = n_text_tokens = 0
        for _path, text in tqdm(files, desc=f"tokenizing {split}", unit="file"):
            file_ids = tok.encode_ids(text, allow_special=False)
            n_bytes += len(text.encode("utf-8"))
            n_text_tokens += len(file_ids)
            ids.extend(file_ids)
            ids.append(eos)
        array = np.asarray(ids, dtype=np.uint16)
        np.save(out / f"{split}_ids.npy", array)
        meta["splits"][split] = {
            "file": f"{split}_ids.npy",
            "num_files": len(files),
            "num_bytes": n_bytes,
            "num_text_tokens": n_text_tokens,
            "num_ids_with_eos": int(array.size),
            "bytes_per_token": round(n_bytes / n_text_tokens, 4),
        }
        print(f"{split}: {len(files)} files, {n_bytes:,} bytes -> {n_text_tokens:,} tokens "
              f"({n_bytes / n_text_tokens:.3f} bytes/token), {array.size:,} ids with EOS")
    (out / "tokenized_meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta


if __name__ == "__main__":
    main()
