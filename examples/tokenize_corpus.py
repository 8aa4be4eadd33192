#!/usr/bin/env python
"""Tokenize the Python corpus of ``examples/build_python_corpus.py`` into flat uint16 id arrays, in parallel.

Reads ``python_corpus_manifest.json.gz``, re-reads every listed file from its root, checks its sha256 against the
manifest (a mismatch raises ValueError naming the file: the machine's files are not the ones the manifest lists),
encodes it with ``KimiHybridTokenizer.encode_ids`` (special-token names inside source text stay ordinary text) in
``--workers`` processes, and writes per split (``train``, ``heldout_packages``, ``heldout_stdlib``):

  ``{split}_ids.npy``: 1-D ``uint16`` array ``file_0 [EOS] file_1 [EOS] ... file_n [EOS]`` (manifest order)
  ``tokenized_meta.json``: tokenizer, eos id, vocab size, per split: files, bytes, tokens, bytes/token and the
  tokens of each package.

uint16 needs ``vocab_size <= 65536`` (8448 for the shipped tokenizer); a larger vocabulary raises ValueError.

Usage:
  python examples/tokenize_corpus.py --manifest data/python_corpus_manifest.json.gz \\
      --tokenizer models/kimi-hybrid-stdlib --out data --workers 16
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import hashlib
import json
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path
from typing import List, Optional, Tuple

import numpy as np

from kimi_hybrid.tokenization_kimi_hybrid import KimiHybridTokenizer

SPLITS = ("train", "heldout_packages", "heldout_stdlib")
_TOKENIZER: Optional[KimiHybridTokenizer] = None  # set in the parent before the worker processes fork


def _encode_file(job: Tuple[str, str, str]) -> Tuple[np.ndarray, int]:
    """``(root, relative path, sha256)`` -> (uint16 ids of the file, its UTF-8 byte count)."""
    root, rel, digest = job
    data = (Path(root) / rel).read_bytes()
    if hashlib.sha256(data).hexdigest() != digest:
        raise ValueError(f"{root}/{rel}: sha256 differs from the manifest (rebuild it on this machine with "
                         "examples/build_python_corpus.py)")
    ids = _TOKENIZER.encode_ids(data.decode("utf-8"), allow_special=False)
    return np.asarray(ids, dtype=np.uint16), len(data)


def load_manifest(path: Path) -> dict:
    """The manifest written by build_python_corpus.py (``.json.gz`` or ``.json``)."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as fh:
        return json.load(fh)


def tokenize(manifest: dict, tokenizer: KimiHybridTokenizer, out: Path, workers: int, log=print) -> dict:
    """Write the id arrays and ``tokenized_meta.json`` into ``out``; returns the meta dict. ``workers > 1`` encodes
    in that many forked processes (the files keep the manifest order), 1 in this process."""
    global _TOKENIZER
    if len(tokenizer) > np.iinfo(np.uint16).max + 1:
        raise ValueError(f"vocabulary of {len(tokenizer)} ids does not fit uint16")
    _TOKENIZER = tokenizer
    eos = tokenizer.eos_token_id
    out.mkdir(parents=True, exist_ok=True)
    meta = {"tokenizer": str(Path(tokenizer.vocab_file).parent.name), "eos_token_id": eos,
            "vocab_size": len(tokenizer), "splits": {}}
    ctx = mp.get_context("fork") if "fork" in mp.get_all_start_methods() else mp.get_context()
    with ctx.Pool(workers) if workers > 1 else contextlib.nullcontext() as pool:
        imap = pool.imap if pool is not None else (lambda fn, jobs, chunksize: map(fn, jobs))
        for split in SPLITS:
            t0 = time.perf_counter()
            packages = [p for p in manifest["packages"] if p["split"] == split]
            jobs: List[Tuple[str, str, str]] = []
            owners: List[str] = []
            for p in packages:
                for rel, digest, _n in p["files"]:
                    jobs.append((p["root"], rel, digest))
                    owners.append(p["name"])
            pieces: List[np.ndarray] = []
            eos_arr = np.asarray([eos], dtype=np.uint16)
            n_bytes = n_tokens = 0
            per_package: dict = {}
            for owner, (ids, nb) in zip(owners, imap(_encode_file, jobs, chunksize=16)):
                pieces += [ids, eos_arr]
                n_bytes += nb
                n_tokens += ids.size
                per_package[owner] = per_package.get(owner, 0) + int(ids.size)
            array = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.uint16)
            np.save(out / f"{split}_ids.npy", array)
            meta["splits"][split] = {
                "file": f"{split}_ids.npy", "num_files": len(jobs), "num_bytes": n_bytes,
                "num_text_tokens": n_tokens, "num_ids_with_eos": int(array.size),
                "bytes_per_token": round(n_bytes / max(n_tokens, 1), 4), "tokens_per_package": per_package,
            }
            log(f"{split}: {len(jobs):,} files, {n_bytes:,} bytes -> {n_tokens:,} tokens "
                f"({n_bytes / max(n_tokens, 1):.3f} bytes/token) in {time.perf_counter() - t0:.1f} s")
    (out / "tokenized_meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    return meta


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--manifest", default="data/python_corpus_manifest.json.gz")
    parser.add_argument("--tokenizer", default="models/kimi-hybrid-stdlib")
    parser.add_argument("--out", default="data")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args(argv)
    manifest_path = Path(args.manifest)
    if not manifest_path.is_file():
        print(f"error: no manifest at {manifest_path} (run examples/build_python_corpus.py first)", file=sys.stderr)
        return 2
    tokenizer = KimiHybridTokenizer.from_pretrained(args.tokenizer)
    try:
        tokenize(load_manifest(manifest_path), tokenizer, Path(args.out), args.workers)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
